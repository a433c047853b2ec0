"""How a step's rollouts split into micro-batches (rl/update.micro_batches): by rows, and with
train.micro_batch_tokens also by padded tokens, so long rollouts train in smaller micro-batches than short ones."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from basis_lite.config import load_config
from basis_lite.rl.update import micro_batches
from tests.conftest import VARIED, step_records, train_smoke


def _rollouts(lengths: list[int], prompt: int = 5):
    return [SimpleNamespace(prompt_ids=[1] * prompt, completion_ids=[2] * (n - prompt)) for n in lengths]


def test_rows_only_without_a_token_budget():
    cfg = load_config("smoke", ["train.micro_batch_size=3"])
    rolls = _rollouts([9, 6, 12, 7, 6, 20, 8])
    assert micro_batches(cfg, rolls, torch.ones(7)) == [[1, 4, 3], [6, 0, 2], [5]]  # shortest first, stable


@pytest.mark.parametrize("budget", [20, 30, 48, 100])
def test_a_token_budget_caps_rows_x_longest(budget):
    cfg = load_config("smoke", ["train.micro_batch_size=4", f"train.micro_batch_tokens={budget}",
                                "model.max_seq_length=40"])
    lengths = [6, 7, 7, 9, 10, 12, 15, 16, 30, 45]  # the last is cut to 40 when packed
    adv = torch.ones(len(lengths))
    adv[3] = 0.0  # a zero advantage does not train (no KL term here)
    mbs = micro_batches(cfg, _rollouts(lengths), adv)
    flat = [i for mb in mbs for i in mb]
    assert flat == [i for i in range(len(lengths)) if i != 3]  # every row that trains, once, shortest first
    for mb in mbs:
        padded = len(mb) * min(max(lengths[i] for i in mb), 40)
        assert len(mb) <= 4 and (padded <= budget or len(mb) == 1), (mb, padded)
    for a, b in zip(mbs, mbs[1:]):  # greedy: the next row did not fit the previous micro-batch
        longest = min(lengths[b[0]], 40)
        assert len(a) == 4 or (len(a) + 1) * longest > budget
    if budget == 100:
        assert mbs[0] == [0, 1, 2, 4]  # short rows fill the row limit
        assert mbs[-1] == [8, 9]  # two rows of 30 and 40 (cut) tokens: 80 padded
    else:
        assert mbs[-1] == [9]  # the longest row alone


def test_a_step_with_a_token_budget_trains_the_same_gradient():
    """The same step split finer: the loss and gradient norm agree up to float rounding (each micro-batch divides
    by the whole step's token count)."""
    import tempfile

    common = VARIED + ["train.steps=1", "train.micro_batch_size=8", "estimator.rollouts_per_prompt=1",
                       "train.batch_size=8"]
    with tempfile.TemporaryDirectory() as d:
        whole = step_records(train_smoke(f"{d}/whole", *common))[0]
        split = step_records(train_smoke(f"{d}/split", *common, "train.micro_batch_tokens=1"))[0]
    assert whole["trained_sequences"] == split["trained_sequences"] > 1
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert whole["grad_norm"] > 0
