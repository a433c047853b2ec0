"""bench/scaling.py without training: the launch line, the value-quality analysis on the committed recordings, and the
report table."""
from __future__ import annotations

import pytest
from conftest import bench_module


@pytest.fixture(scope="module")
def sc():
    return bench_module("scaling.py")


def test_launch_command_is_torchrun_of_the_train_command(sc, tmp_path):
    cmd = sc.launch_command(2, "smoke", ["train.batch_size=8"], tmp_path / "r")
    assert cmd[1:8] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "basis_lite"]
    assert cmd[8:11] == ["train", "--preset", "smoke"] and cmd[-2:] == ["--set", "train.batch_size=8"]


def test_value_quality_pools_over_the_global_batch(sc):
    q = sc.value_quality([8, 64], resamples=3, seed=0)
    assert "arithmetic/t0.7" in q
    for cells in q.values():
        assert set(cells) == {"8", "64"}
        assert all(c["ratio"] > 0 and c["ci90"][0] <= c["ratio"] <= c["ci90"][1] for c in cells.values())


def test_markdown_table(sc):
    run = {"procs": 2, "global_batch": 8, "threads_per_rank": 1, "step_s": 2.0, "steps_per_s": 0.5,
           "prompts_per_s": 4.0, "generation_s": 1.5, "training_s": 0.4, "gather_s": 0.002, "gather_wait_s": 0.1,
           "gather_bytes": 4096, "gather_share": 0.001, "allreduce_s": 0.05, "allreduce_bytes": 2**21,
           "explained_variance": 0.1}
    info = {"cpu_model": "cpu", "cores": 2, "cpu_flags": {"avx2": True}, "git_commit": "abcdef1234567",
            "loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [2.0, 1.0, 1.0]}
    md = sc.markdown({"settings": {"preset": "smoke", "per_rank_batch": 4, "steps": 3}, "machine": info,
                      "command": "python bench/scaling.py", "runs": [run],
                      "value_quality": {"a/b": {"8": {"ratio": 0.9, "ci90": [0.8, 1.0], "prompts": 10}}}})
    assert "| 2 | 8 | 1 | 2.00 | 0.500 | 4.00 |" in md and "| 4.0 | 0.10% | 0.050 | 2.00 |" in md
    assert "| a/b | 0.90 [0.80, 1.00] |" in md
    assert "Measured on cpu, 2 cores; flags: avx2; commit abcdef1234; load average before / after [1.0" in md
