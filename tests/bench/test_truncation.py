"""bench/truncation.py: the cut-off share at a budget, and the premise it rests on: one pass at a large budget gives
every smaller budget's completions (the built-in model's real engine, sampled twice from the same seed)."""
from __future__ import annotations

import pytest
import torch
from conftest import bench_module


@pytest.fixture(scope="module")
def tr():
    return bench_module("truncation.py")


def test_cut_share_counts_longer_and_unstopped(tr):
    lengths = [3, 5, 5, 8, 8]
    stopped = [True, True, False, True, False]  # the third stopped never (cut at 5 by the pass's own budget)
    assert tr.cut_share(lengths, stopped, 8) == pytest.approx(2 / 5)  # the two unstopped
    assert tr.cut_share(lengths, stopped, 5) == pytest.approx(3 / 5)  # + the one of 8 that stopped
    assert tr.cut_share(lengths, stopped, 2) == pytest.approx(1.0)
    assert tr.smallest_budget(lengths, stopped, [2, 5, 8], at_most=0.5) == 8
    assert tr.smallest_budget(lengths, stopped, [2, 5, 8], at_most=0.3) is None
    with pytest.raises(ValueError, match="no completions"):
        tr.cut_share([], [], 4)


def test_a_large_budget_pass_gives_the_small_budgets_completions(tr):
    """Sampling the same prompts from the same seed at budgets 40 and 12: every completion that stopped within 12
    tokens in the long pass is the same token for token in the short one, and the share the long pass says 12 cuts
    off is the share of the short pass's completions that did not stop."""
    from basis_lite.config import load_config
    from basis_lite.data import format_prompt, load_examples
    from basis_lite.engines.base import params_from_config
    from basis_lite.runtime import build_policy, seed_everything

    cfg = load_config("cpu-smollm2-arith", ["model.dtype=float32", "train.threads=1"])
    model, tok, engine = build_policy(cfg, torch.device("cpu"), torch.float32)
    prompts = [format_prompt(tok, ex.prompt, cfg.data) for ex in load_examples(cfg.data, "train")[:12]]

    def sample(budget):
        seed_everything(3)
        return engine.generate(prompts, params_from_config(cfg.generation, max_new_tokens=budget), with_features=False)

    long, short = sample(40), sample(12)
    lengths, stopped = [len(r.completion_ids) for r in long], [r.finished for r in long]
    assert any(s and n <= 12 for n, s in zip(lengths, stopped)) and any(n > 12 or not s for n, s in zip(lengths, stopped))
    for a, b in zip(long, short):
        if a.finished and len(a.completion_ids) <= 12:
            assert b.completion_ids == a.completion_ids
    assert tr.cut_share(lengths, stopped, 12) == pytest.approx(sum(not r.finished for r in short) / len(short))
