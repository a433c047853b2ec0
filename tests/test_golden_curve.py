"""A pinned short training curve (torchtune-style golden values): a refactor that changes the numbers fails here.

Three steps of the `smoke` preset with a fixed seed and the deterministic user reward `char_sum_reward` (so that
rewards vary and every step really updates the adapter), once with BASIS alone and once with a K=2 prior. The
pinned values were recorded from the code before the redesign; rewards are exact, everything computed in floating
point is compared with a relative tolerance that one-thread CPU runs meet with room to spare. Re-recorded when
`estimator.normalize: auto` made BASIS divide its advantages by the batch std (advantage_std 1.0 per step).

If a change is MEANT to change the numbers (a new default, a bug fix in the loss), re-record them with
`python -m pytest tests/test_golden_curve.py --golden-print` and say why in the commit message.
"""
from __future__ import annotations

import math

import pytest
from conftest import VARIED, adapter_weights, step_records, train_smoke

FIELDS = ("reward_mean", "baseline_mean", "advantage_std", "loss", "grad_norm")

GOLDEN = {
    "basis": {
        "steps": [
            (0.4999999701976776, 0.4989069104194641, 0.9999977350234985, -0.0024208277463912964, 0.16931980848312378),
            (0.7083333730697632, 0.7124142050743103, 0.9999973177909851, 0.010817103087902069, 0.27371495962142944),
            (0.5208333134651184, 0.5152848958969116, 0.9999974966049194, -0.01360619068145752, 0.22762887179851532),
        ],
        "lora_b_abs_sum": 5.790187373757362,
    },
    "basis_prior2": {
        "steps": [
            (0.4999999701976776, 0.49741023778915405, 0.9999976754188538, -0.005845606327056885, 0.1689758449792862),
            (0.7083333730697632, 0.7006371021270752, 0.9999971389770508, -0.021243572235107422, 0.2747783660888672),
            (0.5208333134651184, 0.5065205693244934, 0.9999974966049194, -0.034925252199172974, 0.22887395322322845),
        ],
        "lora_b_abs_sum": 5.78869540989399,
    },
}
EXTRA = {"basis": [], "basis_prior2": ["estimator.prior_samples=2"]}
RTOL = 1e-4


def _curve(tmp_path, name):
    run = train_smoke(tmp_path / name, *VARIED, *EXTRA[name])
    steps = [tuple(r[k] for k in FIELDS) for r in step_records(run)]
    w = adapter_weights(run / "adapter")
    b_sum = sum(float(v.abs().sum()) for k, v in w.items() if "lora_B" in k)  # B starts at 0: all of it is learned
    return steps, b_sum


@pytest.mark.parametrize("name", list(GOLDEN))
def test_pinned_curve(tmp_path, name, request):
    steps, b_sum = _curve(tmp_path, name)
    if request.config.getoption("--golden-print"):
        print(f"\n{name}: steps={steps!r}\n{name}: lora_b_abs_sum={b_sum!r}")
    golden = GOLDEN[name]
    assert len(steps) == len(golden["steps"])
    for i, (got, want) in enumerate(zip(steps, golden["steps"])):
        assert got[0] == want[0], f"step {i + 1}: reward_mean {got[0]} != pinned {want[0]}"
        for field, g, w in zip(FIELDS[1:], got[1:], want[1:]):
            assert math.isclose(g, w, rel_tol=RTOL, abs_tol=1e-7), f"step {i + 1}: {field} {g} != pinned {w}"
    assert math.isclose(b_sum, golden["lora_b_abs_sum"], rel_tol=RTOL), \
        f"final adapter: sum |lora_B| {b_sum} != pinned {golden['lora_b_abs_sum']}"
