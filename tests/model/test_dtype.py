"""model.dtype: auto on a CPU picks bf16 only with native bf16 flags AND a whole-step timing that confirms it (cached
per machine in the cache folder); an explicit bfloat16 on a CPU without native bf16 warns with the measured slowdown.
The flags and the timing are replaced here (the CPU this runs on has whatever flags it has); the last tests run the
real timings once."""
from __future__ import annotations

import logging
import weakref

import pytest
import torch

from basis_lite.model import dtypes
from basis_lite.model import loading as models
from basis_lite.model.dtypes import Bf16Check, resolve_dtype

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_check():
    dtypes.cpu_bf16_check.cache_clear()
    yield
    dtypes.cpu_bf16_check.cache_clear()


def test_auto_without_native_flags_is_float32_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(dtypes, "cpu_bf16_flags", lambda: ())
    monkeypatch.setattr(dtypes, "cpu_bf16_check", lambda: pytest.fail("no timing is needed without the flags"))
    with caplog.at_level(logging.INFO, logger="basis_lite"):
        assert resolve_dtype("auto", CPU) == torch.float32
    assert "float32" in caplog.text and "no native bf16" in caplog.text


@pytest.mark.parametrize("bf16_ms, fp32_ms, want", [(2.0, 4.0, torch.bfloat16), (40.0, 4.0, torch.float32),
                                                    (3.9, 4.0, torch.float32)])  # no faster: fp32
def test_auto_with_flags_follows_the_timing(monkeypatch, caplog, bf16_ms, fp32_ms, want):
    monkeypatch.setattr(dtypes, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    monkeypatch.setattr(dtypes, "cpu_bf16_check", lambda: Bf16Check(("avx512_bf16",), bf16_ms, fp32_ms))
    with caplog.at_level(logging.INFO, logger="basis_lite"):
        assert resolve_dtype("auto", CPU) == want
    assert f"{bf16_ms:.1f} ms in bf16" in caplog.text


def test_explicit_bf16_without_native_support_runs_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(dtypes, "cpu_bf16_check", lambda: Bf16Check((), 52.0, 4.0))
    with caplog.at_level(logging.WARNING, logger="basis_lite"):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert "13.0x" in caplog.text and "auto would pick float32" in caplog.text


def test_explicit_float32_never_times_anything(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_bf16_check", lambda: pytest.fail("float32 needs no check"))
    assert resolve_dtype("float32", CPU) == torch.float32


def test_the_real_check_times_both_dtypes():
    check = dtypes.cpu_bf16_check()
    assert check.bf16_ms > 0 and check.fp32_ms > 0
    assert set(check.flags) <= {"avx512_bf16", "amx_bf16"}
    assert check.probe == ("step" if check.flags else "linear")
    assert check.fast == (bool(check.flags) and check.bf16_ms < dtypes.BF16_MARGIN * check.fp32_ms)


SMALL_PROBE = dict(dtypes.STEP_PROBE, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=300,
                   prefill=(2, 8), decode_steps=2, train=(2, 12), completion=4)


def test_the_step_probe_times_prefill_decode_and_training_and_leaves_the_rng_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    ms = dtypes.cpu_step_probe_pair((torch.float32,), SMALL_PROBE)["float32"]
    assert torch.equal(torch.random.get_rng_state(), before)
    assert set(ms) == {"prefill", "decode", "train", "total"} and all(v > 0 for v in ms.values())
    w = SMALL_PROBE["weights"]
    assert ms["total"] == pytest.approx(sum(w[k] * ms[k] for k in w))


def test_the_probe_alternates_the_dtypes_rounds_with_one_model_alive_at_a_time(monkeypatch):
    """The timed rounds alternate between the dtypes (a burst of load elsewhere slows one round of each, not one
    dtype's whole measurement), each part keeps its fastest round, each dtype's first model is warmed up once, and
    no two probe models are alive together: each is built for its round and freed before the next one is built."""
    events, alive, most = [], set(), [0]
    seconds = {torch.float32: iter([9, 0.4, 0.6, 0.8]), torch.bfloat16: iter([9, 0.5, 3, 0.2])}

    class Model:
        pass

    def fake_step_probe(dtype, probe):
        model = Model()
        alive.add(id(model))
        weakref.finalize(model, alive.discard, id(model))
        most[0] = max(most[0], len(alive))
        events.append(("build", dtype))

        def one_round():
            assert model is not None  # the round's closure holds its model, as the real one does
            events.append(("run", dtype))
            s = next(seconds[dtype])
            return {"prefill": s, "decode": 2 * s, "train": 3 * s}
        return one_round

    monkeypatch.setattr(dtypes, "_step_probe", fake_step_probe)
    ms = dtypes.cpu_step_probe_pair(rounds=3)
    fp, bf = torch.float32, torch.bfloat16
    assert events == [("build", fp), ("run", fp), ("run", fp), ("build", bf), ("run", bf), ("run", bf),
                      ("build", fp), ("run", fp), ("build", bf), ("run", bf),
                      ("build", fp), ("run", fp), ("build", bf), ("run", bf)]
    assert most[0] == 1 and not alive
    assert ms["bfloat16"]["prefill"] == pytest.approx(200) and ms["float32"]["train"] == pytest.approx(1200)
    w = dtypes.STEP_PROBE["weights"]
    assert ms["float32"]["total"] == pytest.approx(w["prefill"] * 400 + w["decode"] * 800 + w["train"] * 1200)


def test_the_step_check_is_measured_once_per_machine_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("BASIS_LITE_CACHE", str(tmp_path))
    monkeypatch.setattr(dtypes, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    monkeypatch.setattr(dtypes, "_linear_ms", lambda dtype: 1.0)  # native bf16: the pre-screen lets the step decide
    calls = []

    def fake_pair(*a, **k):
        calls.append("pair")
        return {name: {"prefill": 1.0, "decode": 1.0, "train": 1.0, "total": total}
                for name, total in (("bfloat16", 10.0), ("float32", 30.0))}

    monkeypatch.setattr(dtypes, "cpu_step_probe_pair", fake_pair)
    first = dtypes.cpu_bf16_check()
    assert (first.probe, first.cached, first.bf16_ms, first.fp32_ms, first.fast) == ("step", False, 10.0, 30.0, True)
    assert calls == ["pair"]
    assert (tmp_path / dtypes.DTYPE_CHECK_FILE).is_file()
    dtypes.cpu_bf16_check.cache_clear()  # a new process on the same machine: read back, nothing timed
    again = dtypes.cpu_bf16_check()
    assert again.cached and (again.bf16_ms, again.fp32_ms) == (10.0, 30.0) and len(calls) == 1
    assert "measured earlier" in again.describe()


def _tiny_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(dtype)


@pytest.mark.parametrize("dtype, inside", [(torch.bfloat16, "eager"), (torch.float32, "sdpa")])
def test_training_attention_is_eager_for_bf16_on_the_cpu_only_and_gives_the_same_logprobs(dtype, inside):
    from basis_lite.losses.policy import sequence_logprobs

    model = _tiny_llama(dtype)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 300, (2, 12))
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0  # right padding, as the update packs
    comp = torch.zeros_like(ids)
    comp[:, 5:] = 1
    with torch.no_grad():
        plain = sequence_logprobs(model, ids, attn, comp)
        with models.training_attention(model):
            assert model.config._attn_implementation == inside
            switched = sequence_logprobs(model, ids, attn, comp)
    assert model.config._attn_implementation == "sdpa"  # restored: generation keeps its kernel
    m = plain.mask
    assert torch.allclose(plain.logprobs[m], switched.logprobs[m], atol=0.05 if dtype == torch.bfloat16 else 1e-5)


def test_probe_cache_key_changes_with_kernel_isa_caps(monkeypatch):
    """A timing taken with every kernel the CPU offers must not be reused under ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY
    caps (how an AVX2-only CPU is emulated on a newer one): the cache key names the caps."""
    for var in dtypes.ISA_CAP_VARS:
        monkeypatch.delenv(var, raising=False)
    plain = dtypes._probe_cache_key(("avx512_bf16",))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = dtypes._probe_cache_key(("avx512_bf16",))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    both = dtypes._probe_cache_key(("avx512_bf16",))
    assert len({plain, capped, both}) == 3
    assert capped.endswith("ONEDNN_MAX_CPU_ISA=AVX2") and "ATEN_CPU_CAPABILITY=avx2" in both


def test_an_emulated_bf16_linear_decides_without_the_step_timing(monkeypatch, tmp_path):
    """A CPU that reports avx512_bf16 but runs bf16 matmuls emulated (kernel caps, a hypervisor) is told apart by one
    linear layer: no minutes-long bf16 step timing, fp32 is chosen, and the decision is cached like a step timing."""
    monkeypatch.setenv("BASIS_LITE_CACHE", str(tmp_path))
    monkeypatch.setattr(dtypes, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    monkeypatch.setattr(dtypes, "_linear_ms", lambda dtype: 52.0 if dtype == torch.bfloat16 else 4.0)
    monkeypatch.setattr(dtypes, "cpu_step_probe_pair", lambda *a, **k: pytest.fail("no step timing for emulated bf16"))
    dtypes.cpu_bf16_check.cache_clear()
    try:
        first = dtypes.cpu_bf16_check()
        assert (first.probe, first.fast, first.cached, first.bf16_ms, first.fp32_ms) == ("linear", False, False, 52.0, 4.0)
        assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
        dtypes.cpu_bf16_check.cache_clear()
        monkeypatch.setattr(dtypes, "_linear_ms", lambda dtype: pytest.fail("read back from the cache"))
        again = dtypes.cpu_bf16_check()
        assert (again.probe, again.cached, again.fast) == ("linear", True, False)
        assert "linear layer" in again.describe()
    finally:
        dtypes.cpu_bf16_check.cache_clear()
