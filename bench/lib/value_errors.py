"""The value-MSE bookkeeping shared by bench/value_mse.py (recorded rollouts) and bench/value_mse_trajectories.py
(training trajectories): each baseline's squared error against the Monte-Carlo value of its prompt, with the noise
of that truth taken out, summed per prompt over resamples and summarised with a paired bootstrap against
REINFORCE++'s batch mean."""
from __future__ import annotations

import math

import numpy as np

GROUP_SIZES = (2, 4, 8)  # G of the group-mean and RLOO rows, exact in expectation


def sq_err(b: np.ndarray, pol: np.ndarray, used: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row squared error of the baselines `b` against the mean of the samples the baseline did not use (`pol`
    where `used` is False): (raw, the truth's noise estimate v(1 - v)/(m - 1))."""
    keep = ~used
    m = keep.sum(1)
    v = (pol * keep).sum(1) / m
    raw = (b - v) ** 2
    noise = v * (1.0 - v) / np.maximum(m - 1, 1)
    return raw, noise


class ErrorSums:
    """Per-prompt sums, over the resamples that drew each prompt, of every baseline's squared error and of the
    noise of its truth (`sq_err`); `per_prompt` turns them into per-prompt means and adds the group rows that are
    exact in expectation."""

    def __init__(self, names: list[str], n_prompts: int):
        self.raw = {n: np.zeros(n_prompts) for n in names}
        self.noise = {n: np.zeros(n_prompts) for n in names}
        self.count = np.zeros(n_prompts)

    def add(self, name: str, idx: np.ndarray, b: np.ndarray, pol: np.ndarray, used: np.ndarray) -> None:
        raw, noise = sq_err(b, pol, used)
        self.raw[name][idx] += raw
        self.noise[name][idx] += noise

    def per_prompt(self, s2_all: np.ndarray) -> tuple[dict, dict, dict]:
        """(MSE with the truth noise taken out, raw MSE, truth noise) per prompt drawn at least once; the group mean
        and RLOO of G rollouts are exact: V(1 - V)/G and V(1 - V)/(G - 1), with `s2_all` each prompt's unbiased
        reward variance (V(1 - V) for 0/1 rewards)."""
        seen = self.count > 0
        c = self.count[seen]
        per = {n: (self.raw[n][seen] - self.noise[n][seen]) / c for n in self.raw}
        per_raw = {n: self.raw[n][seen] / c for n in self.raw}
        per_noise = {n: self.noise[n][seen] / c for n in self.raw}
        s2 = s2_all[seen]
        for g in GROUP_SIZES:
            per[f"group_mean_G{g}"] = per_raw[f"group_mean_G{g}"] = s2 / g
            per[f"rloo_G{g}"] = per_raw[f"rloo_G{g}"] = s2 / (g - 1)
            per_noise[f"group_mean_G{g}"] = per_noise[f"rloo_G{g}"] = np.zeros_like(s2)
        return per, per_raw, per_noise


def summarise(per_prompt, per_raw, per_noise, rng, R, seconds, n_boot=400) -> dict:
    """Every row's MSE (mean over prompts), raw MSE, truth noise, standard error, and its ratio to REINFORCE++'s
    with a paired bootstrap 90% interval over prompts; `R` resamples, `seconds` spent, under "_" keys."""
    base = per_prompt["reinforce_pp"]
    n = base.size
    boot = rng.integers(0, n, size=(n_boot, n))
    base_b = base[boot].mean(1)
    out = {"_resamples": R, "_seconds": round(seconds, 2), "_prompts": int(n)}
    for name, e in per_prompt.items():
        mse = float(e.mean())
        ratio = mse / float(base.mean()) if base.mean() > 0 else float("nan")
        rb = e[boot].mean(1) / np.where(base_b > 0, base_b, np.nan)
        lo, hi = np.nanpercentile(rb, [5, 95])
        out[name] = {"mse": mse, "mse_raw": float(per_raw[name].mean()), "truth_noise": float(per_noise[name].mean()),
                     "se": float(e.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
                     "ratio": ratio, "ratio_ci90": [float(lo), float(hi)]}
    return out
