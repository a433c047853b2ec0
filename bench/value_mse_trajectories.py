"""Value-estimate MSE of online-probe baselines on real training trajectories (``bench/value_mse.py --trajectories``).

Input: a recording of ``bench/record_trajectories.py``: a real training run's batches (with features and extra
sibling rollouts) at every step, and at each recorded step t, K rollouts of P fixed prompts from the policy of
step t. No model is loaded.

Protocol, per recorded step t and batch size B (prompts)
---------------------------------------------------------
The replay buffer an online probe may read at step t holds the training steps s < t only (``buffer_size`` newest
rows): for one-rollout estimators the run's own rollouts, for two-rollout estimators those plus their recorded
sibling (the rows a 2-rollout run's buffer holds, with sibling targets). Each probe is fitted once per step, exactly
as the estimator fits it (``fit_poise_probe`` / ``fit_prompt_probe``), then every resample draws B of the P prompts
and a random order of each prompt's K samples: sample 0 is "the rollout" (one-rollout estimators), samples 0 and 1
the pair (two-rollout estimators); each estimator's baseline for sample 0 comes from the registered code path
(``poise_with_probe``, ``basis_probe_with_probe``, ``basis_baseline``). The truth is the mean of the samples the
baseline did not read, with its sampling noise subtracted (``sq_err`` in bench/lib/value_errors.py): all K for
one-rollout leave-one-out estimators, all but sample 1 for two-rollout ones (they read the sibling), all but sample
0 for REINFORCE++'s batch mean. Group means and RLOO with G rollouts are exact in expectation (V(1 - V)/G and
V(1 - V)/(G - 1), V(1 - V) estimated from all K samples), as in value_mse.py.

Rows (rollouts per prompt in brackets): ``reinforce_pp`` (1), ``rloo_G2`` (2, exact) and ``rloo_G2_emp`` (2,
resampled), ``group_mean_G2/G4/G8`` (G, exact), ``x:sibling_shrunk`` (2: the sibling's reward shrunk halfway to the
other prompts' mean), ``basis:default`` (1, no prior), ``basis_probe:<v>`` (1) and ``poise:<v>`` (2), the variants
in ``PROBE_VARIANTS``.

``--kinds add2`` (``analyse(kinds=...)``) scores only the probe prompts of those problem kinds (a built-in task's
prompt id is ``task/kind/index``); the report always gives the kind mix of the training batches and of the probe
prompts, which should match (recordings made before the recorder sampled its probe prompts uniformly took the head
of the train split, whose mix is not the batches').
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from basis_lite.estimators import EstimatorContext
from basis_lite.estimators.basis import basis_baseline
from basis_lite.estimators.poise import basis_probe_with_probe, fit_poise_probe, fit_prompt_probe, poise_with_probe
from basis_lite.estimators.probe import ReplayBuffer
from basis_lite.estimators.probe_options import poise_options, split_basis_probe
from bench.lib.report import fmt_na, markdown_table, write_json
from bench.lib.value_errors import ErrorSums, summarise

# name -> (estimator, options); the defaults first
PROBE_VARIANTS = {
    "basis_probe:default": ("basis_probe", {}),
    "basis_probe:prior_only": ("basis_probe", {"use_features": False}),
    "basis_probe:ridge100": ("basis_probe", {"ridge": 100.0}),
    "basis_probe:logistic": ("basis_probe", {"probe": "logistic", "ridge": 100.0}),
    "poise:default": ("poise", {}),
    "poise:cv": ("poise", {"ridge": "cv"}),
    "poise:+reward": ("poise", {"features": ["prompt", "hidden", "stats", "reward"], "ridge": "cv"}),
    "poise:+reward_recenter": ("poise", {"features": ["prompt", "hidden", "stats", "reward"], "ridge": "cv",
                                         "recenter": True}),
    "poise:recenter": ("poise", {"recenter": True}),
    "poise:stats": ("poise", {"features": ["stats"], "ridge": "cv"}),
    "poise:stats+reward": ("poise", {"features": ["stats", "reward"], "ridge": "cv"}),
    "poise:hidden": ("poise", {"features": ["hidden"], "ridge": "cv"}),
    "poise:prompt": ("poise", {"features": ["prompt"], "ridge": "cv"}),
    "poise:own_target": ("poise", {"target": "own"}),
    "poise:logistic": ("poise", {"probe": "logistic"}),
    "poise:no_pca": ("poise", {"pca_prompt": 0, "pca_hidden": 0, "ridge": "cv"}),
}
KEY_ROWS = ("reinforce_pp", "rloo_G2", "rloo_G2_emp", "group_mean_G8", "x:sibling_shrunk", "basis:default",
            "basis_probe:default", "poise:default")


def load(path: str | Path) -> dict:
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        arr = {k: z[k] for k in z.files if k != "meta"}
    if meta.get("kind") != "trajectories":
        raise SystemExit(f"{path}: not a recording of bench/record_trajectories.py")
    rec = {"meta": meta, "path": str(path)}
    for k, v in arr.items():
        rec[k] = v.astype(np.float32)
    return rec


def kind_of(prompt_id: str) -> str:
    """The problem kind of a built-in task's prompt id ``task/kind/index`` (e.g. ``add2``); other ids: the id's head."""
    parts = str(prompt_id).split("/")
    return parts[1] if len(parts) == 3 else parts[0]


def kind_mix(ids) -> dict[str, float]:
    """{kind: share of the ids}, largest first."""
    kinds = [kind_of(i) for i in ids]
    shares = {k: kinds.count(k) / len(kinds) for k in set(kinds)} if kinds else {}
    return dict(sorted(shares.items(), key=lambda kv: (-kv[1], kv[0])))


def select_kinds(rec: dict, kinds: list[str]) -> dict:
    """The recording with only the probe prompts of the given kinds (the training steps are left whole)."""
    meta = rec["meta"]
    keep = [i for i, pid in enumerate(meta["probe_ids"]) if kind_of(pid) in kinds]
    if len(keep) < 4:
        have = sorted(kind_mix(meta["probe_ids"]))
        raise SystemExit(f"--kinds {','.join(kinds)}: {len(keep)} probe prompts of those kinds in {rec['path']} "
                         f"(need >= 4); its probe prompts are of kinds {have}")
    out = dict(rec)
    for k in ("probe_rewards", "probe_prompt_features", "probe_trajectory"):
        out[k] = rec[k][:, keep]
    out["meta"] = {**meta, "probe_prompts": len(keep), "kinds": list(kinds),
                   **{k: [meta[k][i] for i in keep] for k in ("probe_ids", "probe_questions", "probe_answers")
                      if k in meta}}
    return out


def buffers(rec: dict, t: int, capacity: int) -> tuple[ReplayBuffer, ReplayBuffer]:
    """(one-rollout buffer, two-rollout buffer) of the training steps before t."""
    meta = rec["meta"]
    g = meta["rollouts_per_prompt"]
    b1, b2 = ReplayBuffer(capacity), ReplayBuffer(capacity)
    for s in range(1, t):
        ids = meta["train_ids"][s - 1]
        r = torch.from_numpy(rec["train_rewards"][s - 1])
        pf = torch.from_numpy(rec["train_prompt_features"][s - 1])
        tr = torch.from_numpy(rec["train_trajectory"][s - 1])
        b1.add(s, ids, r[:, :g], pf, tr[:, :g])
        if r.shape[1] >= 2:
            b2.add(s, ids, r, pf, tr)
    return b1, b2


def analyse_step(rec: dict, ti: int, batch_sizes: list[int], resamples: int, rng: np.random.Generator,
                 variants: dict, capacity: int) -> dict:
    meta = rec["meta"]
    t = meta["record_steps"][ti]
    pol_all = rec["probe_rewards"][ti].astype(np.float64)  # [P, K]
    pf_all = torch.from_numpy(rec["probe_prompt_features"][ti])
    tr_all = torch.from_numpy(rec["probe_trajectory"][ti])
    P, K = pol_all.shape
    b1, b2 = buffers(rec, t, capacity)
    fitted, diag = {}, {}
    for name, (est, opts) in variants.items():
        if est == "poise":
            o = poise_options(opts)
            probe = fit_poise_probe(b2, o)
            fitted[name] = (probe, o)
        else:
            po, _ = split_basis_probe(opts)
            probe = fit_prompt_probe(b1, po)
            fitted[name] = (probe, None)
        diag[name] = {"warm": probe is not None, "ridge": None if probe is None else probe.ridge,
                      "rows": None if probe is None else probe.rows}
    res = {}
    for B in sorted({min(b, P) for b in batch_sizes}):
        R = max(min(10, resamples), math.ceil(resamples * 32 / B))
        names = ["reinforce_pp", "rloo_G2_emp", "x:sibling_shrunk", "basis:default", *variants]
        sums = ErrorSums(names, P)
        t0 = time.time()
        for _ in range(R):
            idx = np.sort(rng.choice(P, size=B, replace=False))
            perm = np.argsort(rng.random((B, K)), axis=1)
            pol = np.take_along_axis(pol_all[idx], perm, 1)
            tr = torch.stack([tr_all[i][torch.from_numpy(perm[j])] for j, i in enumerate(idx)])
            pf = pf_all[idx]
            r = torch.from_numpy(pol[:, :2]).float()
            ids = [meta["probe_ids"][i] for i in idx]
            used0, used1, none = (np.zeros_like(pol, dtype=bool) for _ in range(3))
            used0[:, 0] = True
            used1[:, 1] = True
            others = (pol[:, :2].sum() - pol[:, :2].sum(1)) / max(1, 2 * (B - 1))
            out = {"reinforce_pp": (np.full(B, pol[:, 0].mean()), used0),
                   "rloo_G2_emp": (pol[:, 1], used1),
                   "x:sibling_shrunk": ((pol[:, 1] + others) / 2, used1),
                   "basis:default": (basis_baseline(r[:, 0].double(), None, pf.double()).numpy(), none)}
            for name, (est, opts) in variants.items():
                probe, o = fitted[name]
                if est == "poise":
                    ctx = EstimatorContext(prompt_ids=ids, features=pf, trajectory_features=tr[:, :2], replay=b2,
                                           options=opts)
                    _, base = poise_with_probe(r, ctx, probe, o)
                    out[name] = (base[:, 0].double().numpy(), used1)
                else:
                    ctx = EstimatorContext(prompt_ids=ids, features=pf, replay=b1, options=opts)
                    _, base = basis_probe_with_probe(r[:, :1], ctx, probe)
                    out[name] = (base[:, 0].double().numpy(), none)
            for name, (b, used) in out.items():
                sums.add(name, idx, b, pol, used)
            sums.count[idx] += 1
        per, per_raw, per_noise = sums.per_prompt(pol_all.var(1, ddof=1))
        res[B] = summarise(per, per_raw, per_noise, rng, R, time.time() - t0)
    pm = pol_all.mean(1)
    return {"step": t, "n_prompts": P, "samples": K, "mean_reward": float(pol_all.mean()),
            "value_var": float(max(0.0, pm.var() - (pm * (1 - pm) / (K - 1)).mean())),
            "buffer_rows_one_rollout": b1.rows, "buffer_rows_two_rollouts": b2.rows, "probes": diag,
            "results": {str(B): v for B, v in res.items()}}


def analyse(path: str, batch_sizes: list[int], resamples: int, seed: int, capacity: int = 4096,
            variants: list[str] | None = None, command: str = "", min_rows: int | None = None,
            kinds: list[str] | None = None) -> dict:
    """``min_rows`` (if given) replaces every variant's own: the buffer rows a probe needs before it is used.
    ``kinds`` (if given) keeps only the probe prompts of those problem kinds (``kind_of``)."""
    t0 = time.time()
    rec = load(path)
    all_probe_ids = rec["meta"]["probe_ids"]
    if kinds:
        rec = select_kinds(rec, kinds)
    meta = rec["meta"]
    vs = {k: (e, {**o, **({"min_rows": min_rows} if min_rows else {})}) for k, (e, o) in PROBE_VARIANTS.items()
          if variants is None or k in variants}
    rng = np.random.default_rng(seed)
    torch.set_num_threads(1)
    steps = {}
    for ti, t in enumerate(meta["record_steps"]):
        steps[str(t)] = analyse_step(rec, ti, batch_sizes, resamples, rng, vs, capacity)
        print(f"step {t}: done in {time.time() - t0:.0f} s", flush=True)
    n = meta["steps"]
    mid = [t for t in meta["record_steps"] if n / 4 <= t <= 3 * n / 4] or list(meta["record_steps"])
    report = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command, "recording": {
        "file": Path(path).name, "preset": meta["preset"], "family": meta["family"], "steps": n,
        "record_steps": meta["record_steps"], "batch_size": meta["batch_size"],
        "rollouts_per_prompt": meta["rollouts_per_prompt"], "train_siblings": meta["train_siblings"],
        "probe_prompts": meta["probe_prompts"], "samples": meta["samples"], "seconds": meta.get("seconds"),
        "probe_selection": meta.get("probe_selection", "the first prompts of the train split"),
        "kinds": meta.get("kinds"), "train_kind_mix": kind_mix([i for s in meta["train_ids"] for i in s]),
        "recorded_probe_kind_mix": kind_mix(all_probe_ids), "probe_kind_mix": kind_mix(meta["probe_ids"]),
        "train_reward_by_step": [m.get("reward_mean") for m in meta.get("metrics", [])]},
        "settings": {"batch_sizes": batch_sizes, "resamples_at_B32": resamples, "seed": seed,
                     "buffer_size": capacity, "variants": {k: v for k, v in vs.items()}, "mid_steps": mid},
        "steps": steps}
    report["targets"] = targets(report)
    report["analysis_seconds"] = time.time() - t0
    return report


def _geo(vals):
    vals = [v for v in vals if v is not None and v > 0 and math.isfinite(v)]
    return float(np.exp(np.mean(np.log(vals)))) if vals else float("nan")


def targets(report: dict) -> dict:
    """The issue's value targets on the mid-training steps, per batch size."""
    mid = [str(t) for t in report["settings"]["mid_steps"]]
    out = {}
    for t in mid:
        for B, cell in report["steps"][t]["results"].items():
            if "poise:default" not in cell or "basis_probe:default" not in cell:  # --variants left them out
                continue
            g8 = cell["group_mean_G8"]["mse"]
            out[f"step {t} B={B}"] = {
                "poise_default_mse": cell["poise:default"]["mse"], "group_mean_G8_mse": g8,
                "poise_below_group_mean_G8": cell["poise:default"]["mse"] < g8,
                "best_poise": min((n for n in cell if n.startswith("poise:")), key=lambda n: cell[n]["mse"]),
                "basis_probe_ratio": cell["basis_probe:default"]["ratio"],
                "basis_probe_le_0.8": cell["basis_probe:default"]["ratio"] <= 0.8}
    rows = sorted({n for s in report["steps"].values() for c in s["results"].values() for n in c
                   if not n.startswith("_")})
    rank = {n: _geo([report["steps"][t]["results"][B].get(n, {}).get("ratio") for t in mid
                     for B in report["steps"][t]["results"]]) for n in rows}
    ranked = sorted(rank.items(), key=lambda kv: (math.isnan(kv[1]), kv[1]))
    return {"cells": out, "geo_mean_ratio_mid_steps": dict(ranked)}


def markdown(report: dict) -> str:
    rec = report["recording"]
    cols = [(t, B) for t, s in report["steps"].items() for B in s["results"]]
    rows: list[str] = []
    for s in report["steps"].values():
        for c in s["results"].values():
            rows += [n for n in c if not n.startswith("_") and n not in rows]
    order = [n for n in KEY_ROWS if n in rows] + [n for n in rows if n not in KEY_ROWS]
    lines = ["# Value-estimate MSE of online probes on real training trajectories", "",
             f"Generated {report['created']} by `{report['command']}` in {report['analysis_seconds']:.0f} s from "
             f"`{rec['file']}`: preset `{rec['preset']}` ({rec['family']}), {rec['steps']} steps of "
             f"{rec['batch_size']} prompts x {rec['rollouts_per_prompt']} (+{rec['train_siblings']} recorded "
             f"sibling per prompt for the 2-rollout buffers); at steps {rec['record_steps']}, {rec['probe_prompts']} "
             f"fixed prompts x {rec['samples']} samples from that step's policy.", "",
             f"Problem kinds (share of prompts): training batches {_mix(rec['train_kind_mix'])}; recorded probe "
             f"prompts ({rec['probe_selection']}) {_mix(rec['recorded_probe_kind_mix'])}"
             + (f"; analysed here: only kinds {', '.join(rec['kinds'])} ({rec['probe_prompts']} prompts)."
                if rec.get("kinds") else "; all analysed."), "",
             "Cells: truth-noise-corrected MSE of the baseline against the prompt's value (ratio to REINFORCE++'s "
             "batch mean). Estimators at step t read only the training steps before t (their replay buffer, "
             f"newest {report['settings']['buffer_size']} rows) and one (or two, for `poise:*`, `rloo_G2*` and "
             "`x:sibling_shrunk`) samples of each prompt at step t. Group means and RLOO use G rollouts per prompt. "
             "Variants: " + "; ".join(f"`{k}` = {v[0]} {v[1] or '(defaults)'}"
                                      for k, v in report["settings"]["variants"].items()) + ".", ""]
    for t, s in report["steps"].items():
        pr = s["probes"]
        lines.append(f"- **step {t}**: mean reward {s['mean_reward']:.3f}, Var(V) across prompts "
                     f"{s['value_var']:.4f}; buffer rows {s['buffer_rows_one_rollout']} (one rollout) / "
                     f"{s['buffer_rows_two_rollouts']} (two); poise:default "
                     + ("warm, ridge " + fmt_na(pr['poise:default']['ridge'], 0)
                        if pr.get("poise:default", {}).get("warm") else "not warm (RLOO)")
                     + ", basis_probe:default "
                     + ("warm, ridge " + fmt_na(pr['basis_probe:default']['ridge'], 0)
                        if pr.get("basis_probe:default", {}).get("warm") else "not warm (BASIS)"))
    rows = []
    for n in order:
        cells = []
        for t, B in cols:
            c = report["steps"][t]["results"][B].get(n)
            cells.append("" if c is None else f"{fmt_na(c['mse'])} ({fmt_na(c['ratio'], 2)})")
        rows.append([n] + cells)
    lines += ["", markdown_table(["estimator"] + [f"step {t} B={B}" for t, B in cols], rows)]
    tg = report["targets"]
    lines += ["", f"## Targets on the mid-training steps {report['settings']['mid_steps']}", ""]
    for cell, v in tg["cells"].items():
        lines.append(f"- {cell}: poise:default MSE {v['poise_default_mse']:.4f} vs group mean G=8 "
                     f"{v['group_mean_G8_mse']:.4f} (below: **{v['poise_below_group_mean_G8']}**; best POISE "
                     f"variant `{v['best_poise']}`); basis_probe:default {v['basis_probe_ratio']:.2f}x REINFORCE++ "
                     f"(<= 0.8: **{v['basis_probe_le_0.8']}**)")
    lines += ["", "Geometric-mean ratio to REINFORCE++ over the mid-training steps and batch sizes:", ""]
    lines += [f"{i + 1}. `{n}`: {v:.3f}" for i, (n, v) in enumerate(tg["geo_mean_ratio_mid_steps"].items())]
    return "\n".join(lines) + "\n"


def _mix(m: dict) -> str:
    return ", ".join(f"{k} {v:.1%}" for k, v in m.items())


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Bs = sorted({int(B) for s in report["steps"].values() for B in s["results"]})
    fig, axes = plt.subplots(1, len(Bs), figsize=(5 * len(Bs), 4.2), squeeze=False)
    steps = [int(t) for t in report["steps"]]
    for j, B in enumerate(Bs):
        ax = axes[0, j]
        for ci, name in enumerate(KEY_ROWS[1:]):
            ys = [report["steps"][str(t)]["results"].get(str(B), {}).get(name, {}).get("ratio", np.nan)
                  for t in steps]
            ax.plot(steps, ys, marker="o", ms=3, label=name, color=plt.cm.tab10(ci % 10),
                    ls="--" if name.startswith(("group", "rloo")) else "-")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"B = {B} prompts")
        ax.set_xlabel("training step")
        ax.set_ylabel("MSE / MSE(REINFORCE++)")
        ax.set_ylim(0, 2.0)
    axes[0, 0].legend(fontsize=7)
    kinds = report["recording"].get("kinds")
    fig.suptitle("Value MSE on a real training run's policies, relative to REINFORCE++"
                 + (f" (probe prompts of kinds {', '.join(kinds)})" if kinds else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(paths: list[str], batch_sizes: list[int], resamples: int, seed: int, out: Path, no_plot: bool,
         command: str, capacity: int = 4096, variants: list[str] | None = None, min_rows: int | None = None,
         kinds: list[str] | None = None) -> int:
    for p in paths:
        report = analyse(p, batch_sizes, resamples, seed, capacity, variants, command, min_rows, kinds)
        prefix = out if len(paths) == 1 else out.with_name(f"{out.name}_{Path(p).stem}")
        md = markdown(report)
        write_json(prefix.with_suffix(".json"), report)
        prefix.with_suffix(".md").write_text(md)
        if not no_plot:
            plot(report, prefix.with_suffix(".png"))
        print(md)
    return 0
