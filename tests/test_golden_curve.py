"""A pinned short training curve (torchtune-style golden values): a refactor that changes the numbers fails here.

Three steps of the `smoke` preset with a fixed seed and the deterministic user reward `char_sum_reward` (so that
rewards vary and every step really updates the adapter), once with BASIS alone and once with a K=2 prior. The
pinned values were recorded from the code before the redesign; rewards are exact, everything computed in floating
point is compared with a relative tolerance that one-thread CPU runs meet with room to spare.

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
            (0.5625, 0.5581628680229187, 0.46783801913261414, -0.004337124526500702, 0.09054144471883774),
            (0.625, 0.6267012357711792, 0.4469762444496155, 0.0017012283205986023, 0.10439446568489075),
            (0.4166666865348816, 0.4280533790588379, 0.3805430233478546, 0.011386740952730179, 0.0829363614320755),
        ],
        "lora_b_abs_sum": 5.693223983049393,
    },
    "basis_prior2": {
        "steps": [
            (0.5625, 0.5503898859024048, 0.46905261278152466, -0.012110181152820587, 0.09063863754272461),
            (0.625, 0.6215695142745972, 0.44986674189567566, -0.003430500626564026, 0.10497278720140457),
            (0.4166666865348816, 0.43476438522338867, 0.3775412142276764, 0.018097735941410065, 0.08144316077232361),
        ],
        "lora_b_abs_sum": 5.6816651076078415,
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
