"""The optional loggers of a run: TensorBoard tags grouped as train/... and eval/..., the W&B project configurable.

Neither tensorboard nor wandb is needed: both are replaced by recording fakes in sys.modules, so the test checks
what basis-lite hands them (tags, values, project), not the libraries themselves.
"""
from __future__ import annotations

import sys
import types

import pytest

from basis_lite.runs.metrics import MetricsLog


class _Writer:
    instances: list = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars = log_dir, []
        _Writer.instances.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        pass


@pytest.fixture
def fakes(monkeypatch):
    tb = types.ModuleType("torch.utils.tensorboard")
    tb.SummaryWriter = _Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tb)
    runs = []
    wandb = types.ModuleType("wandb")

    class _Run:
        def __init__(self, **kw):
            self.init, self.logged = kw, []

        def log(self, values, step):
            self.logged.append((values, step))

        def finish(self):
            pass

    def init(**kw):
        runs.append(_Run(**kw))
        return runs[-1]

    wandb.init = init
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    _Writer.instances.clear()
    return runs


STEP = {"step": 3, "reward_mean": 0.5, "loss": 0.1, "skipped": False, "zero_update": True, "note": "text"}
EVAL = {"accuracy": 0.25, "n": 8, "by_level": {"1": {"accuracy": 0.5, "n": 4}}}


def test_tensorboard_and_wandb_tags_are_grouped(tmp_path, fakes, monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    with MetricsLog(tmp_path, ["tensorboard", "wandb"], wandb_project="my-project") as m:
        m.start()
        m.step(STEP)
        m.eval(3, EVAL)
        m.eval(4, None)  # an empty eval split: nothing logged anywhere
    (tb,) = _Writer.instances
    assert sorted(tag for tag, _, _ in tb.scalars) == [
        "eval/accuracy", "eval/accuracy_level1", "eval/n", "train/loss", "train/reward_mean", "train/skipped",
        "train/zero_update"]
    assert ("train/zero_update", 1.0, 3) in tb.scalars and ("eval/accuracy", 0.25, 3) in tb.scalars
    (run,) = fakes
    assert run.init["project"] == "my-project"
    assert run.logged[0] == ({"train/reward_mean": 0.5, "train/loss": 0.1, "train/skipped": 0.0,
                              "train/zero_update": 1.0}, 3)
    assert run.logged[1][0]["eval/accuracy"] == 0.25 and len(run.logged) == 2
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


@pytest.mark.parametrize("configured,env,expected", [("", None, "basis-lite"), ("", "from-env", "from-env"),
                                                     ("mine", "from-env", "mine")])
def test_wandb_project_default(tmp_path, fakes, monkeypatch, configured, env, expected):
    if env is None:
        monkeypatch.delenv("WANDB_PROJECT", raising=False)
    else:
        monkeypatch.setenv("WANDB_PROJECT", env)
    MetricsLog(tmp_path, ["wandb"], wandb_project=configured).close()
    assert fakes[-1].init["project"] == expected
