"""bench/vs_trl.py's bookkeeping on hand-made numbers: the headline ratio, the table, the report files; and its
tempered-logits hook on the tiny model with TRL's own scoring.

The bookkeeping tests use no model and no trl: the arms' results are written by hand and run through the same
functions the benchmark uses.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import bench_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vs():
    return bench_module("vs_trl.py")


def _points(pairs, n=150):
    """[(step, clock_s, accuracy), ...] -> eval points as the workers write them."""
    return [{"step": s, "clock_s": c, "accuracy": a, "n": n, "by_level": {}, "final": i == len(pairs) - 1}
            for i, (s, c, a) in enumerate(pairs)]


def _arm(vs, arm, pairs, step_clocks, **extra):
    return vs.summarize_arm(arm, _points(pairs), step_clocks, extra=extra)


def test_headline_ratio_reached(vs):
    basis = _arm(vs, "basis", [(0, 0.0, 0.5), (10, 40.0, 0.7), (20, 80.0, 0.85)], [4.0] * 20)
    trl = _arm(vs, "trl8", [(0, 0.0, 0.5), (10, 150.0, 0.65), (20, 300.0, 0.8)], [15.0] * 20)
    assert basis["total_clock_s"] == 80.0 and trl["total_clock_s"] == 300.0
    assert basis["final_accuracy"] == 0.85 and trl["final_accuracy"] == 0.8 and trl["accuracy_before"] == 0.5
    h = vs.headline(basis, trl)
    # TRL ends at 0.8; basis first reaches it at step 20, clock 80 s: 80 / 300
    assert h["reached"] and h["basis_step_to_reach"] == 20
    assert h["ratio"] == pytest.approx(80.0 / 300.0)
    assert h["meets_target"] is True
    h2 = vs.headline(_arm(vs, "basis", [(0, 0.0, 0.5), (10, 40.0, 0.7), (20, 120.0, 0.85)], [6.0] * 20), trl)
    assert h2["ratio"] == pytest.approx(0.4) and h2["meets_target"] is False


def test_headline_not_reached_gives_a_lower_bound(vs):
    basis = _arm(vs, "basis", [(0, 0.0, 0.5), (10, 50.0, 0.6), (20, 100.0, 0.7)], [5.0] * 20)
    trl = _arm(vs, "trl4", [(0, 0.0, 0.5), (20, 200.0, 0.9)], [10.0] * 20)
    h = vs.headline(basis, trl)
    assert not h["reached"] and h["ratio"] is None and h["meets_target"] is False
    assert h["ratio_lower_bound"] == pytest.approx(0.5)
    text = vs.headline_text("trl4", h)
    assert "did not reach" in text and "0.500" in text and "misses" in text


def test_cumulative_and_summary(vs):
    assert vs.cumulative([1.0, 2.0, 3.5]) == [1.0, 3.0, 6.5]
    rec = _arm(vs, "basis", [(0, 0.0, 0.2), (2, 3.0, 0.4)], [1.0, 2.0], peak_rss_mb=2048.0)
    assert rec["steps"] == 2 and rec["mean_step_s"] == 1.5 and rec["peak_rss_mb"] == 2048.0


def _report(vs):
    arms = {
        "basis": _arm(vs, "basis", [(0, 0.0, 0.5), (10, 40.0, 0.7), (20, 80.0, 0.85)], [4.0] * 20,
                      prompts_per_step=32, rollouts_per_prompt=1, peak_rss_mb=3000.0, threads=2, generation_s=50.0,
                      update_s=30.0),
        "trl8": _arm(vs, "trl8", [(0, 0.0, 0.5), (10, 150.0, 0.65), (20, 300.0, 0.8)], [15.0] * 20,
                     prompts_per_step=4, rollouts_per_prompt=8, peak_rss_mb=3500.0, threads=2),
    }
    return {"arm_order": ["basis", "trl8"], "arms": arms,
            "headline": {"trl8": vs.headline(arms["basis"], arms["trl8"])},
            "settings": {"preset": "p", "model": "m", "dataset": "d", "steps": 20, "eval_every": 10, "eval_n": 150,
                         "rollouts_per_step": 32, "dtype": "float32", "shared": {"lr": 3e-4},
                         "trl_config": {"loss_type": "dapo"}},
            "not_matched": ["something"], "command": "python bench/vs_trl.py",
            "machine": {"cpu_model": "X", "cores": 2, "cpus_usable": 2, "cpu_flags": {"avx2": True, "amx_bf16": False},
                        "loadavg_before": [0.5, 0.4, 0.3], "git_commit": "abc", "git_dirty": True,
                        "python": "3.11", "torch": "2.x", "trl": "1.15.0"}}


def test_table_and_markdown(vs):
    rep = _report(vs)
    head, rows = vs.table_rows(rep)
    assert head[-3:] == ["acc @0", "acc @10", "acc @20"]
    assert [r[0] for r in rows] == ["basis", "trl8"]
    assert rows[0][1] == "32 x 1" and rows[1][1] == "4 x 8"
    assert rows[0][3] == "80 s" and rows[1][3] == "300 s" and rows[1][6] == "3.42 GB"
    assert rows[0][4] == "50 s + 30 s" and rows[1][4] == "-" and rows[0][5] == "4.00 s"
    assert rows[0][-1] == "0.850 (80 s)" and rows[1][-2] == "0.650 (150 s)"
    md = vs.markdown(rep)
    assert "ratio **0.267** (meets the 1/3 target)" in md
    assert vs.CLOCK_NOTE in md and "Not matched exactly: something" in md and "`loss_type=dapo`" in md
    assert "| basis | 32 x 1 | 20 |" in md
    assert "Machine: X, 2 cores; flags: avx2; without amx_bf16; 2 CPUs usable; load average at start [0.5, 0.4" in md
    assert "trl 1.15.0" in md and "Commit abc (with uncommitted changes)" in md


def test_write_outputs(vs, tmp_path):
    rep = _report(vs)
    vs.write_outputs(rep, tmp_path)
    assert json.loads((tmp_path / "vs_trl.json").read_text())["headline"]["trl8"]["ratio"] == pytest.approx(80 / 300)
    assert (tmp_path / "vs_trl.md").read_text().startswith("# basis-lite vs TRL")
    png = tmp_path / "vs_trl.png"
    if png.exists():  # matplotlib is optional
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trl_batch_mapping(vs):
    from basis_lite.config import ConfigError, load_config

    cfg = load_config("cpu-smollm2-arith", ["train.batch_size=32", "train.micro_batch_size=8"])
    kw = vs.trl_config_kwargs(cfg, 8, 40, "out", True)
    # 32 rollouts per step: micro-batches of 8 completions, accumulated 4 times, 8 generations per prompt
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"], kw["num_generations"]) == (8, 4, 8)
    assert kw["loss_type"] == "dapo" and kw["beta"] == cfg.train.kl_coef
    assert (kw["epsilon"], kw["epsilon_high"]) == (cfg.train.clip_low, cfg.train.clip_high)
    assert kw["max_completion_length"] == cfg.generation.max_new_tokens
    assert kw["temperature"] == cfg.generation.temperature and kw["max_steps"] == 40
    with pytest.raises(ConfigError, match="multiple of 8"):
        vs.trl_config_kwargs(load_config("cpu-smollm2-arith", ["train.batch_size=12", "train.micro_batch_size=4"]),
                             8, 40, "out", True)


def test_quick_flags_do_not_touch_the_results_folder(vs, tmp_path):
    args = vs.parse_args(["--quick", "--runs", str(tmp_path / "r")])
    assert (args.steps, args.eval_every, args.eval_limit) == (2, 1, 8)
    assert args.out == (tmp_path / "r").resolve() / "quick"
    args = vs.parse_args(["--steps", "5", "--arms", "basis,trl4"])
    assert args.out == ROOT / "bench" / "results" / "vs_trl" and args.arms == ["basis", "trl4"]
    assert args.eval_limit is None


def test_a2po_mapping(vs):
    """A2POConfig takes every mapped argument, and they mirror the basis-lite config."""
    pytest.importorskip("trl.experimental.a2po")
    from trl.experimental.a2po import A2POConfig

    from basis_lite.config import ConfigError, load_config

    cfg = load_config("cpu-smollm2-arith", ["train.batch_size=32", "train.micro_batch_size=4", "generation.top_k=0"])
    kw = vs.a2po_config_kwargs(cfg, 20, "out", True, 8, 0.5)
    conf = A2POConfig(**kw)
    assert (conf.per_device_train_batch_size, conf.gradient_accumulation_steps, conf.max_steps) == (4, 8, 20)
    assert (conf.num_value_samples, conf.beta1, conf.beta2) == (8, 0.5, cfg.train.astar_beta)
    assert conf.top_k is None and conf.temperature == cfg.generation.temperature
    assert conf.max_completion_length == cfg.generation.max_new_tokens and conf.learning_rate == cfg.train.lr
    with pytest.raises(ConfigError, match="multiple of train.micro_batch_size=4"):
        vs.a2po_config_kwargs(load_config("cpu-smollm2-arith", ["train.batch_size=30", "train.micro_batch_size=4"]),
                              20, "out", True, 8, 0.5)


def test_generate_counter_counts_to_the_first_stop_token(vs):
    import torch

    def fake_generate(input_ids, attention_mask, **kwargs):  # 2 prompts x 2 samples, 4 new tokens each
        new = torch.tensor([[5, 9, 2, 2], [5, 5, 5, 5], [9, 2, 7, 7], [2, 0, 0, 0]])
        return torch.cat([input_ids.repeat_interleave(2, 0), new], dim=1)

    counts, timing = {"prompt_tokens": 0, "generated_tokens": 0}, {"generation_s": 0.0}
    gen = vs._count_generated(fake_generate, [2], timing, counts)
    ids = torch.tensor([[0, 1, 1], [1, 1, 1]])
    gen(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    # completions: 3 (stop at the 3rd), 4 (never stops), 2, 1 tokens; prompts: (2 + 3) x 2 samples
    assert counts == {"prompt_tokens": 10, "generated_tokens": 10} and timing["generation_s"] > 0
    gen(ids, attention_mask=ids)  # a positional call (not A2PO's): passed through, not counted
    assert counts["generated_tokens"] == 10


def test_tempered_logits_reach_trl_reference_copy_and_its_scoring(vs):
    """temper_logits on the real tiny policy: TRL's reference model (its deep copy, made after the hook) carries it,
    A2POTrainer's own _get_sequence_logps then scores log_softmax(logits / T) for both models, and the switch turned
    off gives the raw logits back (what the evals see)."""
    pytest.importorskip("trl.experimental.a2po")
    import torch
    from trl.experimental.a2po import A2POTrainer
    from trl.experimental.utils import create_reference_model

    from basis_lite.config import ConfigError, load_config
    from basis_lite.model.loading import load_policy

    model, _ = load_policy(load_config("smoke", ["model.dtype=float32"]), torch.device("cpu"), torch.float32)
    ids = torch.tensor([[3, 7, 11, 5, 9, 2]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        raw = model(input_ids=ids, attention_mask=mask).logits
        switch = vs.temper_logits(model, 0.7)
        ref = create_reference_model(model)
        scorer = SimpleNamespace(model_kwarg_keys=())  # as for a PeftModel, whose forward names no logits_to_keep
        # the summed log-probs of the last 3 tokens under the tempered policy
        want = torch.log_softmax(raw[:, -4:-1] / 0.7, -1).gather(-1, ids[:, -3:, None])[..., 0].sum(-1)
        for m in (model, ref):
            got = A2POTrainer._get_sequence_logps(scorer, m, ids, mask, 3)
            assert torch.allclose(got, want, atol=1e-5), (got, want)
        switch["on"] = False
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, raw)
        assert torch.equal(ref(input_ids=ids, attention_mask=mask).logits, raw)
    with pytest.raises(ConfigError, match="temperature=0"):
        vs.temper_logits(model, 0)
