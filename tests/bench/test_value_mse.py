"""The value-MSE benchmark's analysis on a tiny synthetic recording (no model): fast, and checks its bookkeeping."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import bench_module


@pytest.fixture(scope="module")
def vm():
    return bench_module("value_mse.py")


@pytest.fixture(scope="module")
def report(vm, tmp_path_factory):
    d = tmp_path_factory.mktemp("vm")
    rec = vm.write_synthetic(d / "rollouts_syn.npz", n_prompts=32, ref_samples=8, policy_samples=16, dim=8, seed=1)
    out = d / "value_mse"
    vm.main([str(rec), "--batch-sizes", "16", "32", "--resamples", "3", "--ks", "2", "4",
             "--variants", "loo_mean", "prior_shift", "features_fixed", "default", "default_nofeat", "history", "mix",
             "--out", str(out), "--no-plot"])
    return json.loads(out.with_suffix(".json").read_text()), out


def test_output_keys(report):
    rep, out = report
    assert {"created", "command", "settings", "recordings", "scenarios", "targets", "recommendation", "k_curve",
            "analysis_seconds"} <= set(rep)
    assert set(rep["scenarios"]) == {"synthetic/ref", "synthetic/drift"}
    s = rep["scenarios"]["synthetic/drift"]
    assert list(s["results"]) == ["16", "32"]
    cell = s["results"]["32"]
    for name in ("reinforce_pp", "group_mean_G2", "group_mean_G4", "group_mean_G8", "rloo_G2", "rloo_G8",
                 "basis:loo_mean", "basis:prior_shift@K2", "basis:prior_shift@K4", "basis:features_fixed",
                 "basis:default@K0", "basis:default@K4", "basis:default_nofeat@K4", "history_raw"):
        assert name in cell, name
        assert {"mse", "mse_raw", "truth_noise", "ratio", "ratio_ci90", "se"} <= set(cell[name])
    assert cell["reinforce_pp"]["ratio"] == pytest.approx(1.0)
    # truth-noise correction: corrected = raw - noise
    c = cell["basis:loo_mean"]
    assert c["mse"] == pytest.approx(c["mse_raw"] - c["truth_noise"], abs=1e-9)
    assert out.with_suffix(".md").read_text().startswith("# Value-estimate MSE")
    assert "checks" in rep["targets"] and rep["targets"]["checks"]


def test_group_mean_g8_beats_g2(report):
    rep, _ = report
    for s in rep["scenarios"].values():
        for cell in s["results"].values():
            assert cell["group_mean_G8"]["mse"] < cell["group_mean_G4"]["mse"] < cell["group_mean_G2"]["mse"]
            assert cell["rloo_G8"]["mse"] < cell["rloo_G2"]["mse"]


def test_similarity_helps_on_clustered_data(report):
    # the synthetic prompts come in clusters that share a success rate: pooling by features must beat the batch mean
    rep, _ = report
    cell = rep["scenarios"]["synthetic/drift"]["results"]["32"]
    assert cell["basis:features_fixed"]["mse"] < cell["reinforce_pp"]["mse"]


def test_mix_row(report):
    # BASIS mix (estimator.options.mix) on simulated runs: a row in every cell, ratio to REINFORCE++ on its own rows
    rep, out = report
    for s in rep["scenarios"].values():
        for cell in s["results"].values():
            c = cell["basis:mix@K0"]
            st = c["stream"]
            assert st["steps"] >= 2 and st["scored_from_step"] == st["steps"] // 2 and st["runs"] >= 2
            assert set(st["mean_weights"]) == {"loo", "pool", "probe", "tracker"}
            assert sum(st["mean_weights"].values()) == pytest.approx(1.0)
            assert c["mse"] == pytest.approx(c["mse_raw"] - c["truth_noise"], abs=1e-9)
            assert c["ratio"] == pytest.approx(c["mse"] / st["reinforce_pp_mse_same_rows"])
    assert "## BASIS mix on simulated runs" in out.with_suffix(".md").read_text()


def test_mix_stream_truth_never_used(vm, monkeypatch):
    # the run length keeps at least 2 samples that no step has used for every scored row's truth, revisited
    # questions (ID#k) included; a recording with too few samples gets no mix row
    rng = np.random.default_rng(0)
    N, M = 24, 6
    pol = (rng.random((N, M)) < 0.5).astype(np.uint8)
    sc = vm.Scenario("syn", "p", [f"q{i % 8}" if i < 8 else f"q{i % 8}#{i // 8}" for i in range(N)], pol,
                     rng.normal(size=(N, 4)).astype(np.float32), pol, False)
    seen_sq = []
    orig = vm.sq_err

    def spy(b, p, used):
        seen_sq.append(used.copy())
        return orig(b, p, used)

    monkeypatch.setattr(vm, "sq_err", spy)
    cell = vm.run_mix_streams(sc, 8, 4, np.random.default_rng(1), steps=10)
    assert cell is not None and cell["stream"]["steps"] == min(10, (M - 2) * N // 8)
    for used in seen_sq:
        assert ((~used).sum(1) >= 2).all()  # at least 2 truth samples per scored row
    assert vm.run_mix_streams(vm.Scenario("syn", "p", sc.ids, pol[:, :3], sc.feats, pol, False), 24, 4,
                              np.random.default_rng(0)) is None


def test_unfinished_policy_left_out(vm, tmp_path, capsys):
    rec = vm.write_synthetic(tmp_path / "rollouts_syn.npz", n_prompts=16, ref_samples=8, policy_samples=8, dim=4)
    with np.load(rec) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    meta["policies"]["drift"]["done"] = 8  # stopped half-way (record_rollouts.py --max-seconds)
    np.savez_compressed(rec, meta=np.array(json.dumps(meta)), **arrays)
    fams = vm.load_recordings([str(rec)])
    assert set(fams["synthetic"].policies) == {"ref"}
    assert "unfinished" in capsys.readouterr().err


@pytest.fixture(scope="module")
def rr():
    return bench_module("record_rollouts.py")


def test_record_unique_ids(rr):
    assert rr.unique_ids(["a", "b", "a", "a", "c"]) == ["a", "b", "a#1", "a#2", "c"]


class _FakeEngine:
    """Answers drawn from torch's global RNG (as sampling is), one feature per row from the prompt."""

    batch_size = 8

    def generate(self, prompts, params, with_features=True):
        import torch

        from basis_lite.engines.base import Rollout

        out = []
        for p in prompts:
            ans = int(torch.randint(0, 2, (1,)))
            out.append(Rollout(prompt=p, prompt_ids=[1], completion_ids=[5] * (3 + ans), text=f"\\boxed{{{ans}}}",
                               finished=True, feature=torch.full((3,), float(len(p)))))
        return out


def test_record_resume_matches_one_run(rr):
    # --max-seconds then --append: the same rewards as one uninterrupted run (each chunk seeded by its first prompt)
    prompts = [f"q{i}" * (i + 1) for i in range(10)]
    answers = ["1"] * 10
    args = (_FakeEngine(), prompts, answers, 4, 1.0, 8, 3, False)
    full = rr.generate(*args)
    assert full[4] == 10
    part = rr.generate(*args, deadline=0.0)  # past: stops after the first chunk of 8 // 4 = 2 prompts
    assert part[4] == 2
    rest = rr.generate(*args, start=part[4], out=part[:3])
    assert rest[4] == 10
    np.testing.assert_array_equal(rest[0], full[0])
    np.testing.assert_array_equal(rest[1], full[1])
    np.testing.assert_array_equal(rest[2], full[2])
    assert 0 < full[0].mean() < 1
    with pytest.raises(ValueError, match="multiple"):
        rr.generate(*args, start=1, out=part[:3])


def test_label_keeps_recordings_apart(vm, tmp_path):
    # two recordings of one task family with overlapping prompts (an old and a new task mix): their labels keep
    # them apart; without a label (older recordings) the family is the key
    a = vm.write_synthetic(tmp_path / "rollouts_a.npz", n_prompts=16, dim=4, family="arith")
    b = vm.write_synthetic(tmp_path / "rollouts_b.npz", n_prompts=16, dim=4, family="arith", seed=1)
    with np.load(b) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    meta["label"] = "arith_default"
    np.savez_compressed(b, meta=np.array(json.dumps(meta)), **arrays)
    fams = vm.load_recordings([str(a), str(b)])
    assert set(fams) == {"arith", "arith_default"}
    with pytest.raises(SystemExit, match="overlap"):
        vm.load_recordings([str(a), str(a)])
