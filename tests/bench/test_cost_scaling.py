"""bench/cost_scaling.py's points and tables on hand-made numbers: no model, no trl, nothing trained."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import bench_module


@pytest.fixture(scope="module")
def cs():
    return bench_module("cost_scaling.py")


def test_points_walk_one_axis_at_a_time_around_the_base(cs):
    pts = cs.make_points(["builtin:smollm2-135m-instruct", "/m/SmolLM2-360M-Instruct"], [48, 128, 256],
                         [16, 32, 64], base_batch=32)
    names = [p["name"] for p in pts]
    assert names == ["smollm2-135m-instruct-t48-b32", "smollm2-135m-instruct-t128-b32",
                     "smollm2-135m-instruct-t256-b32", "smollm2-135m-instruct-t48-b16",
                     "smollm2-135m-instruct-t48-b64", "smollm2-360m-instruct-t48-b32"]
    assert pts[0]["axes"] == ["model", "tokens", "batch"]  # the base point lies on every axis
    assert pts[1]["axes"] == ["tokens"] and pts[3]["axes"] == ["batch"] and pts[5]["axes"] == ["model"]
    full = cs.make_points(["a", "b"], [48, 128], [16, 32], base_batch=32, grid="full")
    assert len(full) == 8 and full[-1]["axes"] == []  # b x 128 x 16 lies on no axis through the base


def test_bad_points_are_refused_with_the_point_named(cs):
    with pytest.raises(cs.ScalingError, match="same tag"):
        cs.make_points(["x/model", "y/model"], [48], [32], base_batch=32)
    pts = cs.make_points(["builtin:smollm2-135m-instruct"], [48], [12], base_batch=32)
    with pytest.raises(cs.ScalingError, match=r"t48-b12.*groups of 8"):
        cs.check_points("cpu-smollm2-arith", [], pts, ["basis", "trl8"])
    cs.check_points("cpu-smollm2-arith", [], pts, ["basis"])  # basis-lite alone takes any batch


def test_a_larger_budget_keeps_the_room_for_the_prompt(cs):
    from basis_lite.config import load_config

    cfg0 = load_config("cpu-smollm2-arith", [])
    room = cfg0.model.max_seq_length - cfg0.generation.max_new_tokens
    p = cs.make_points(["builtin:smollm2-135m-instruct"], [256], [32], base_batch=32)[0]
    ov = cs.point_overrides(cfg0, p)
    assert f"model.max_seq_length={room + 256}" in ov and "generation.max_new_tokens=256" in ov
    cfg = load_config("cpu-smollm2-arith", ov)
    assert cfg.model.max_seq_length - cfg.generation.max_new_tokens == room and cfg.train.batch_size == 32
    assert cfg.reward.functions == []  # the real model keeps the real reward
    shp = cs.make_points(["shapes:smollm2-360m"], [48], [32], base_batch=32)[0]
    cfg = load_config("cpu-smollm2-arith", cs.point_overrides(cfg0, {**shp, "model_path": "/m"}))
    assert cfg.reward.functions == [cs.SHAPES_REWARD] and cfg.model.name == "/m"
    from bench.lib.cost_reward import varied

    scores = varied(["p"] * 3, ["a", "b", "abc"])
    assert len(set(scores)) > 1 and all(0 <= x <= 1 for x in scores)


def _basis(step_s):
    """Three steps of a basis arm; the first (warm-up) is slow and must not count."""
    steps = [{"step": i + 1, "generation_s": g, "update_s": u, "forward_s": u * 0.5, "logprob_s": 0.0,
              "backward_s": u * 0.45, "optimizer_s": u * 0.05, "generated_tokens": 900, "clipped_fraction": c}
             for i, (g, u, c) in enumerate([(30.0, 40.0, 0.5)] + [(g, u, 0.25) for g, u in step_s])]
    return {"steps": steps, "peak_rss_mb": 2048.0, "plan_peak_gib": 1.5}


def test_summary_skips_the_warm_up_step_and_names_the_dominant_part(cs):
    s = cs.arm_summary("basis", _basis([(4.0, 10.0), (6.0, 10.0)]))
    assert s["generation_s"] == 5.0 and s["update_s"] == 10.0 and s["step_s"] == 15.0
    assert s["dominant"] == "generation_s" and s["dominant_share"] == pytest.approx(5 / 15)
    assert s["clipped_fraction"] == pytest.approx((0.5 + 0.25 + 0.25) / 3)  # every step counts for the cut-off rate
    # a step that trained nothing (all advantages 0) is no update time: left out of the update's mean
    rec = _basis([(4.0, 10.0), (6.0, 0.0)])
    rec["steps"][2].update(forward_s=0.0, backward_s=0.0, trained_sequences=0)
    u = cs.arm_summary("basis", rec)
    assert u["update_s"] == 10.0 and u["generation_s"] == 5.0 and u["untrained_steps"] == 1
    old = _basis([(4.0, 10.0), (6.0, 0.0)])  # a raw file without trained_sequences: no forward, no backward
    assert cs.arm_summary("basis", old)["untrained_steps"] == 1
    t = cs.arm_summary("trl8", {"steps": [{"step": 1, "generation_s": 9.0, "update_s": 1.0},
                                          {"step": 2, "generation_s": 2.0, "update_s": 6.0}], "peak_rss_mb": 1.0})
    assert t["step_s"] == 8.0 and t["dominant"] == "update_s" and t["plan_peak_gib"] is None


def _write_points(cs, out: Path):
    pts = cs.make_points(["builtin:smollm2-135m-instruct"], [48, 128], [32], base_batch=32)
    for p, scale in zip(pts, (1.0, 2.5)):
        rec = {**p, "arms": {"basis": _basis([(4.0 * scale, 10.0 * scale)] * 2),
                             "trl8": {"steps": [{"step": s, "generation_s": 20.0 * scale, "update_s": 20.0 * scale}
                                                for s in (1, 2, 3)], "peak_rss_mb": 3072.0}}}
        (out / "points").mkdir(parents=True, exist_ok=True)
        (out / "points" / f"{p['name']}.json").write_text(json.dumps(rec))
    (out / "scaling.json").write_text(json.dumps({"command": "python bench/cost_scaling.py", "points":
                                                  [p["name"] for p in pts]}))
    return pts


def test_growth_and_the_page_come_from_the_raw_files(cs, tmp_path):
    pts = _write_points(cs, tmp_path)
    loaded = cs.load_points(tmp_path)
    assert [p["name"] for p in loaded] == [p["name"] for p in pts]
    g = cs.growth(loaded, "basis")
    assert g[(pts[1]["name"], "tokens")] == pytest.approx(2.5) and g[(pts[0]["name"], "tokens")] == 1.0
    assert (pts[0]["name"], "batch") not in g  # one point on the batch axis: nothing to grow against
    page = cs.render(tmp_path)
    rows = [line for line in page.splitlines() if line.startswith(f"| {pts[1]['name']} ")]
    assert len(rows) == 2 and "tokens x2.50" in rows[0] and "35.0" in rows[0] and "1.50 GiB" in rows[0]
    assert "| 100.0 |" in rows[1] and "3.00 GiB" in rows[1]  # trl8: 50 + 50 seconds a step, no plan
    assert cs.main(["--report", str(tmp_path)]) == 0 and (tmp_path / "scaling.md").read_text() == page


def test_reading_a_basis_run_and_trl_history(cs, tmp_path):
    lines = [{"step": 1, "generation_s": 2.0, "training_s": 3.0, "forward_s": 1.0, "logprob_s": 0.5,
              "backward_s": 1.4, "optimizer_s": 0.1, "generated_tokens": 100, "clipped_fraction": 0.5,
              "completion_len": 25.0},
             {"event": "eval", "step": 1, "eval_accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (st,) = cs.basis_steps(tmp_path)
    assert st["update_s"] == 3.0 and st["logprob_s"] == 0.5 and st["clipped_fraction"] == 0.5
    result = {"per_step": [{"step": 1, "generation_s": 5.0, "update_s": 7.0}, {"step": 2, "generation_s": 4.0,
                                                                                "update_s": 6.0}]}
    hist = [{"loss": 0.1, "completions/mean_length": 30.0, "completions/clipped_ratio": 0.25}, {"loss": 0.2}]
    rows = cs.trl_steps(result, hist, batch=32)
    assert rows[0]["generated_tokens"] == 960 and rows[0]["clipped_fraction"] == 0.25
    assert rows[1]["generated_tokens"] is None and rows[1]["update_s"] == 6.0


def test_dry_run_checks_every_point_and_trains_nothing(cs, tmp_path, capsys):
    assert cs.main(["--dry-run", "--runs", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    # budgets 48/128/256 and batches 16/64 around the base, and the two shapes models: 7 points
    assert out.count("generation.max_new_tokens=") == 7 and not (tmp_path / "out").exists()
    assert "shapes-smollm2-360m-t48-b32: model;" in out
    assert cs.main(["--dry-run", "--batches", "12", "--out", str(tmp_path / "o")]) == 2
    assert "groups of 8" in capsys.readouterr().err


def test_shapes_models_are_compared_with_their_own_kind(cs, tmp_path):
    with pytest.raises(cs.ScalingError, match="shapes:smollm2-360m"):
        cs.shapes_name("shapes:smollm2-7b")
    assert cs.shapes_name("builtin:smollm2-135m-instruct") is None
    assert cs.shapes_model_dir("/some/folder", tmp_path) == "/some/folder"  # not a shapes model: as given
    pts = cs.make_points(["builtin:smollm2-135m-instruct", "shapes:smollm2-135m", "shapes:smollm2-360m"], [48],
                         [32], base_batch=32)
    assert [p["name"] for p in pts] == ["smollm2-135m-instruct-t48-b32", "shapes-smollm2-135m-t48-b32",
                                        "shapes-smollm2-360m-t48-b32"]
    for p, step in zip(pts, (10.0, 20.0, 50.0)):
        p["arms"] = {"basis": {"steps": [{"generation_s": step, "update_s": 0.0}]}}
    g = cs.growth(pts, "basis")
    assert g[(pts[2]["name"], "model")] == 2.5  # 360M against the 135M shapes, not against the real model
    assert (pts[0]["name"], "model") not in g  # the only real model: nothing of its kind to compare with


def test_a_shapes_model_is_built_once_with_its_sizes_and_loads(cs, tmp_path, monkeypatch):
    import torch

    from basis_lite.config import load_config
    from basis_lite.model.loading import load_policy

    monkeypatch.setitem(cs.SHAPES, "tiny-wide", {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3,
                                                 "num_attention_heads": 4, "num_key_value_heads": 2})
    folder = cs.shapes_model_dir("shapes:tiny-wide", tmp_path, str(tmp_path / "cache"), source="builtin:tiny-random")
    assert Path(folder) == tmp_path / "models" / "tiny-wide" and (Path(folder) / "tokenizer.json").exists()
    stamp = (Path(folder) / "model.safetensors").stat().st_mtime_ns
    assert cs.shapes_model_dir("shapes:tiny-wide", tmp_path, source="builtin:tiny-random") == folder
    assert (Path(folder) / "model.safetensors").stat().st_mtime_ns == stamp  # built once
    cfg = load_config("smoke", [f"model.name={folder}", "model.dtype=float32"])
    model, _ = load_policy(cfg, torch.device("cpu"), torch.float32)
    c = model.get_base_model().config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_key_value_heads) == (48, 96, 3, 2)
