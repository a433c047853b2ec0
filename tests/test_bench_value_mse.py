"""The value-MSE benchmark's analysis on a tiny synthetic recording (no model): fast, and checks its bookkeeping."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def vm():
    spec = importlib.util.spec_from_file_location("bench_value_mse", ROOT / "bench" / "value_mse.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_value_mse"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def report(vm, tmp_path_factory):
    d = tmp_path_factory.mktemp("vm")
    rec = vm.write_synthetic(d / "rollouts_syn.npz", n_prompts=32, ref_samples=8, policy_samples=16, dim=8, seed=1)
    out = d / "value_mse"
    vm.main([str(rec), "--batch-sizes", "16", "32", "--resamples", "3", "--ks", "2", "4",
             "--variants", "loo_mean", "prior_shift", "features_fixed", "default", "default_nofeat", "history", "--out", str(out), "--no-plot"])
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


def test_truth_noise_unbiased(vm):
    # with a constant baseline equal to the true value, the corrected squared error averages to ~0
    rng = np.random.default_rng(0)
    v = rng.uniform(0.1, 0.9, 4000)
    pol = (rng.random((4000, 6)) < v[:, None]).astype(float)
    raw, noise = vm._sq_err(v, pol, np.zeros_like(pol, dtype=bool))
    assert abs((raw - noise).mean()) < 3e-3
    assert raw.mean() > 0.02
