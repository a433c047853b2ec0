"""bench/job_memory.py: a real (smoke-preset) training job in the bench's process, its per-phase peaks and its
machine record."""
import json
import subprocess
import sys

from conftest import REPO, VARIED, sets, subprocess_env


def test_job_memory_writes_phase_peaks_and_the_machine_record_with_env(tmp_path):
    out = tmp_path / "mem.json"
    # VARIED: a reward that varies across rollouts, so the step updates (an all-zero batch skips the update)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "job_memory.py"), str(out), "--preset", "smoke",
                           *sets(VARIED + ["train.steps=1"]), "--no-progress", "--output", str(tmp_path / "run")],
                          cwd=REPO, env=subprocess_env(MALLOC_ARENA_MAX="2"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["exit"] == 0
    assert {"load_policy", "rollout", "update", "eval"} <= set(doc["peaks"])
    assert all(50 < mb < 8000 for mb in doc["peaks"].values())
    # ru_maxrss is the kernel's peak over the whole process: at least every sampled phase's peak, to sampling slack
    assert doc["maxrss_mb"] >= max(doc["peaks"].values()) - 5
    m = doc["machine"]
    assert m["env"]["MALLOC_ARENA_MAX"] == "2" and len(m["loadavg_before"]) == 3 and len(m["loadavg_after"]) == 3
    assert m["cpu_flags"] and m["git_commit"]
