"""Value-estimate MSE of single-rollout baselines (BASIS variants) against REINFORCE++, GRPO group means and RLOO.

Input: recordings from ``bench/record_rollouts.py`` (``bench/results/record_rollouts/rollouts_*.npz``: real SmolLM2
rollouts, many per prompt, from the reference model and from shifted policies, with the policies' prompt features).
No model is loaded here: the analysis re-runs from the recording in seconds to a minute.

Protocol (per task family x policy x batch size B)
-------------------------------------------------
A *scenario* is a family and a policy. For ``t0.7`` / ``trained`` policies the BASIS prior comes from the reference
samples (T = 1.0, base model); for the ``ref`` scenario (no drift: the policy IS the reference, as at step 0 of
training) each prompt's reference samples are split at random, per resample, into prior samples and policy samples.

Each resample draws B distinct prompts and, for every prompt, a random permutation of its policy samples: the first
is "the rollout" r_i (the only reward a single-rollout estimator sees for prompt i), the second is the "earlier
epoch" reward h_i used by the per-prompt history estimators. A prior with K reference samples is built exactly as
``basis_lite.rl.priors.prior_values`` does, from K reference samples drawn at random per prompt (and the run's history
{id: (h_i, 1)} for the history variants).

Monte-Carlo truth, per estimator: v_i = the mean of prompt i's policy samples that the estimator did NOT use (all of
them for leave-one-out estimators such as BASIS, whose b_i is independent of every sample of prompt i; all but r_i
for REINFORCE++'s batch mean; all but h_i for the history estimators). The squared error (b_i - v_i)^2 then has
expectation MSE_i + Var(v_i), and Var(v_i) = v(1 - v)/m is removed with its unbiased estimate v_i (1 - v_i)/(m - 1)
(m = the number of truth samples). So every MSE reported is the truth-noise-corrected one (an unbiased estimate of
E (b_i - V_i)^2, V_i the true value); the uncorrected number and the subtracted constant are in the JSON.

Group estimators with G rollouts do not depend on the batch: the group mean (GRPO's value estimate, r_i included)
has MSE V(1 - V)/G and RLOO (the mean of the other G - 1) V(1 - V)/(G - 1), exactly; both are evaluated with the
unbiased per-prompt estimate of V(1 - V) from all policy samples, so any G (2, 4, 8) is available whatever the
number of recorded samples. ``basis:<v>`` rows are ``BASIS_VARIANTS[v]`` (bench/basis_variants.py); ``x:`` rows
are candidate estimators that are not (yet) in ``basis_lite/estimators`` (see the table header in value_mse.md). ``group_mean_G*_emp`` rows are the same estimators resampled empirically (a check; only
where enough samples were recorded).

``basis:mix@K0`` is BASIS with ``estimator.options: {mix: true}`` (no prior), which learns across steps (its parts'
errors, a value tracker, a probe on a replay buffer): it is scored on simulated runs instead (``run_mix_streams``),
with REINFORCE++ on the same rows as its reference.

Per-prompt MSEs are averaged over resamples and then over prompts; ratios to REINFORCE++ carry a paired bootstrap
90% interval over prompts.

    python bench/value_mse.py                         # all bench/results/record_rollouts/rollouts_*.npz
                                                      # -> bench/results/value_mse/value_mse.{json,md,png}
    python bench/value_mse.py bench/results/record_rollouts/rollouts_arithmetic_default.npz \
        --out bench/results/value_mse/default/value_mse      # the default preset's task, a policy mid-training
    python bench/value_mse.py --resamples 50 --ks 2 4 8 --batch-sizes 32 64 128 256

Online probes on real training trajectories (``bench/record_trajectories.py`` recordings; protocol in
bench/value_mse_trajectories.py): every estimator at step t reads only steps < t and the current batch.

    python bench/value_mse.py --trajectories          # bench/results/record_trajectories/trajectories_*.npz
                                                      # -> bench/results/value_mse_trajectories/value_mse_trajectories.*
    python bench/value_mse.py --trajectories --kinds add2 \
        --out bench/results/value_mse_trajectories/value_mse_trajectories_add2
        # only the probe prompts of the problem kinds the training batches draw (98 % add2 on the default preset)
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from basis_lite.estimators import EstimatorContext  # noqa: E402
from basis_lite.estimators.basis import basis_baseline  # noqa: E402
from basis_lite.estimators.basis_blocks import calibrate_shift, calibrated_values, similarity_pool  # noqa: E402
from basis_lite.estimators.basis_mix import basis_mix, make_state  # noqa: E402
from basis_lite.estimators.basis_options import BASIS_DEFAULTS  # noqa: E402
from basis_lite.estimators.probe import ReplayBuffer  # noqa: E402
from basis_lite.estimators.probe_options import mix_replay_capacity  # noqa: E402
from basis_lite.rl.priors import PSEUDO_COUNT, prior_values  # noqa: E402
from bench.basis_variants import BASIS_VARIANTS  # noqa: E402
from bench.lib.paths import results_dir  # noqa: E402
from bench.lib.report import fmt_na, markdown_table, write_json  # noqa: E402
from bench.lib.value_errors import GROUP_SIZES, ErrorSums, sq_err, summarise  # noqa: E402

RECORDINGS = results_dir("record_rollouts")  # rollouts_*.npz of bench/record_rollouts.py
TRAJECTORIES = results_dir("record_trajectories")  # trajectories_*.npz of bench/record_trajectories.py
TARGET_RATIO = 0.31  # issue: BASIS MSE <= 0.31x REINFORCE++ (the paper's "69% lower")
KEY_ROWS = ("reinforce_pp", "basis:default@K0", "basis:mix@K0", "basis:loo_mean", "group_mean_G2", "group_mean_G4",
            "group_mean_G8", "rloo_G8")
MIX_OPTIONS = {"mix": True}  # estimator.options of the mix row (its other settings: BASIS_DEFAULTS)
MIX_STREAM_STEPS = 20  # steps per simulated run of the mix (the first half warms its state up, the second is scored)


# ----------------------------------------------------------------------------------------------------------------
# recordings


@dataclass
class Family:
    name: str
    ids: list
    ref: np.ndarray  # [N, Kref] uint8
    policies: dict = field(default_factory=dict)  # name -> (rewards [N, M] uint8, features [N, D] float32)
    meta: list = field(default_factory=list)  # per-file summaries


def load_recordings(paths: list[str]) -> dict[str, Family]:
    """Families from recording files, keyed by their label (``record_rollouts.py --label``, by default the file name
    after ``rollouts_``; the task family for older recordings); files of one label are concatenated (prompts must
    differ)."""
    fams: dict[str, Family] = {}
    for path in sorted(paths):
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            arrays = {k: z[k] for k in z.files if k != "meta"}
        fam = meta.get("label") or meta["family"]  # record_rollouts.py --label (recordings before it: the family)
        pols = {}
        for name, pm in meta["policies"].items():
            if pm.get("done", meta["n_prompts"]) < meta["n_prompts"]:
                print(f"note: {path}: policy {name} is unfinished ({pm['done']}/{meta['n_prompts']} prompts); left "
                      "out", file=sys.stderr)
                continue
            pols[name] = (arrays[f"{name}_rewards"].astype(np.uint8), arrays[f"{name}_features"].astype(np.float32))
        summary = {"file": str(Path(path).resolve().relative_to(ROOT)) if Path(path).resolve().is_relative_to(ROOT)
                   else str(path), "family": meta["family"], "label": fam, "levels": meta.get("levels"),
                   "n_prompts": meta["n_prompts"],
                   "offset": meta.get("offset", 0), "policies": meta["policies"], "dtype": meta.get("dtype"),
                   "device": meta.get("device", "cpu"), "threads": meta.get("threads"),
                   "max_new_tokens": meta.get("max_new_tokens"), "recorded_at": meta.get("recorded_at"),
                   "total_seconds": meta.get("total_seconds"), "require_boxed": meta.get("require_boxed")}
        if fam not in fams:
            if "ref" not in pols:
                raise SystemExit(f"{path}: no reference samples ('ref')")
            fams[fam] = Family(fam, list(meta["ids"]), pols["ref"][0],
                               {k: v for k, v in pols.items()}, [summary])
            continue
        f = fams[fam]
        if set(meta["ids"]) & set(f.ids):
            raise SystemExit(f"{path}: prompts overlap with another {fam} recording")
        common = set(f.policies) & set(pols)
        dropped = sorted(set(f.policies) ^ set(pols))
        if dropped:
            print(f"note: {fam}: policies {dropped} are not in every file; they are left out", file=sys.stderr)
        f.ids += list(meta["ids"])
        f.ref = _cat(f.ref, pols["ref"][0])
        f.policies = {k: (_cat(f.policies[k][0], pols[k][0]), np.concatenate([f.policies[k][1], pols[k][1]]))
                      for k in common}
        f.meta.append(summary)
    return fams


def _cat(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    m = min(a.shape[1], b.shape[1])
    return np.concatenate([a[:, :m], b[:, :m]])


def write_synthetic(path: str | Path, n_prompts: int = 64, ref_samples: int = 8, policy_samples: int = 16,
                    dim: int = 16, clusters: int = 4, family: str = "synthetic", seed: int = 0) -> Path:
    """A recording in ``record_rollouts.py``'s format with known structure (no model): prompts in clusters that share
    a feature centre and a success logit; the policy drifts from the reference by a per-cluster logit shift."""
    rng = np.random.default_rng(seed)
    c = rng.integers(0, clusters, n_prompts)
    centres = rng.normal(size=(clusters, dim)) * 3.0
    feats = centres[c] + rng.normal(size=(n_prompts, dim))
    logit_ref = rng.permutation(np.linspace(-2.5, 2.0, clusters))[c] + rng.normal(0, 0.5, n_prompts)
    logit_pol = logit_ref + rng.normal(1.0, 0.5, clusters)[c]
    p_ref, p_pol = 1 / (1 + np.exp(-logit_ref)), 1 / (1 + np.exp(-logit_pol))
    ref = (rng.random((n_prompts, ref_samples)) < p_ref[:, None]).astype(np.uint8)
    pol = (rng.random((n_prompts, policy_samples)) < p_pol[:, None]).astype(np.uint8)
    meta = {"family": family, "levels": [], "n_prompts": n_prompts, "ids": [f"{family}-{i}" for i in range(n_prompts)],
            "policies": {"ref": {"samples": ref_samples, "temperature": 1.0},
                         "drift": {"samples": policy_samples, "temperature": 1.0}},
            "synthetic": True, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path = Path(path)
    np.savez_compressed(path, meta=np.array(json.dumps(meta)), ref_rewards=ref, ref_features=feats.astype(np.float16),
                        drift_rewards=pol, drift_features=feats.astype(np.float16),
                        ref_lengths=np.zeros_like(ref), drift_lengths=np.zeros_like(pol))
    return path


# ----------------------------------------------------------------------------------------------------------------
# estimators


def estimator_specs(ks: list[int], variants: list[str] | None = None) -> list[dict]:
    """Every single-rollout estimator row: name, kind, K (prior samples, 0 = none), options, history flag."""
    specs = [dict(name="reinforce_pp", kind="rpp", k=0)]
    vs = dict(BASIS_VARIANTS)
    vs["default_nofeat"] = dict(use_features=False)  # the defaults when no features are available
    names = [v for v in vs if variants is None or v in variants]
    for v in names:
        opts = vs[v]
        uses_prior = opts.get("use_prior", True)
        k_list = ([0] if v in ("default", "default_nofeat") else []) + (list(ks) if uses_prior else [0])
        if not uses_prior:
            k_list = [0]
        for k in k_list:
            specs.append(dict(name=f"basis:{v}" + (f"@K{k}" if uses_prior else ""), kind="basis", k=k,
                              opts=opts, variant=v))
    if variants is None or "experimental" in variants:
        # x: not in BASIS_VARIANTS; candidate changes, measured here as evidence
        for h in (0.1, 0.3, 1.0):
            for lam in (0.5, 2.0, 8.0):
                specs.append(dict(name=f"x:features_h{h:g}_l{lam:g}", kind="basis", k=0,
                                  opts=dict(use_prior=False, bandwidth=h, shrink=lam), variant="features_fixed"))
        for k in ks:
            for c in (4.0, 8.0):  # prior pseudo-count c toward the dataset mean (compare priors.PSEUDO_COUNT)
                specs.append(dict(name=f"x:prior_shift_pc{c:g}@K{k}", kind="basis", k=k, pc=c,
                                  opts=dict(use_features=False), variant="prior_shift"))
                specs.append(dict(name=f"x:default_pc{c:g}@K{k}", kind="basis", k=k, pc=c, opts={},
                                  variant="default"))
            for lam in (2.0, 8.0):  # features pooled toward the calibrated prior (the prior as shrinkage target)
                specs.append(dict(name=f"x:features_toward_prior_l{lam:g}@K{k}", kind="toward_prior", k=k,
                                  pc=4.0, bandwidth=0.3, shrink=lam))
    if variants is None or "history" in variants:
        specs.append(dict(name="history_raw", kind="history_raw", k=0))  # prior_values with history only
        specs.append(dict(name="basis:default+history@K0", kind="basis", k=0, opts={}, variant="default",
                          history=True))
        if ks:
            kmax = max(ks)
            specs.append(dict(name=f"basis:default+history@K{kmax}", kind="basis", k=kmax, opts={},
                              variant="default", history=True))
    return specs


# ----------------------------------------------------------------------------------------------------------------
# one scenario


@dataclass
class Scenario:
    family: str
    policy: str
    ids: list
    pol: np.ndarray  # [N, M] policy rewards (for "ref": all reference samples, split per resample)
    feats: np.ndarray  # [N, D]
    ref: np.ndarray  # [N, Kref]
    shared: bool  # policy IS the reference: split the reference samples into prior / policy per resample
    n_prior_cols: int = 0  # shared only: reference samples set aside for the prior


def scenarios_of(fams: dict[str, Family], ks: list[int]) -> list[Scenario]:
    out = []
    for fam in fams.values():
        for pname, (rew, feats) in fam.policies.items():
            if pname == "ref":
                kref = fam.ref.shape[1]
                npc = max([k for k in ks if kref - k >= 4] or [0])
                if npc == 0:
                    continue
                out.append(Scenario(fam.name, "ref", fam.ids, rew, feats, fam.ref, True, npc))
            else:
                out.append(Scenario(fam.name, pname, fam.ids, rew, feats, fam.ref, False))
    return out


def _prior_pc(table: dict, ids: list, c: float) -> torch.Tensor:
    """prior_values without history but with pseudo-count c: (s + c m) / (K + c)."""
    m = min(max(table["mean"], 0.02), 0.98)
    return torch.tensor([(table["counts"][i] + c * m) / (table["k"] + c) for i in ids], dtype=torch.float64)


def run_scenario(sc: Scenario, specs: list[dict], batch_sizes: list[int], resamples: int, rng: np.random.Generator,
                 group_emp: bool = True) -> dict:
    N = sc.pol.shape[0]
    feats_t = torch.as_tensor(sc.feats, dtype=torch.float64)
    ks_avail = sc.n_prior_cols if sc.shared else sc.ref.shape[1]
    specs = [s for s in specs if s["k"] <= ks_avail]
    M = sc.pol.shape[1] - (sc.n_prior_cols if sc.shared else 0)
    res: dict = {}
    for B in batch_sizes:
        R = max(min(10, resamples), math.ceil(resamples * 32 / min(B, N)))
        names = [s["name"] for s in specs]
        emp_groups = [g for g in GROUP_SIZES if group_emp and g <= M - 2]
        names_all = names + [f"group_mean_G{g}_emp" for g in emp_groups] + [f"rloo_G{g}_emp" for g in emp_groups]
        sums = ErrorSums(names_all, N)
        t0 = time.time()
        for _ in range(R):
            idx = np.sort(rng.choice(N, size=B, replace=False))
            # policy / prior columns of each prompt
            if sc.shared:
                perm_all = np.argsort(rng.random(sc.ref.shape), axis=1)
                prior_pool = np.take_along_axis(sc.ref, perm_all[:, :sc.n_prior_cols], 1)
                pol_all = np.take_along_axis(sc.ref, perm_all[:, sc.n_prior_cols:], 1)
            else:
                prior_pool, pol_all = sc.ref, sc.pol
            pol = pol_all[idx].astype(np.float64)  # [B, M]
            perm = np.argsort(rng.random(pol.shape), axis=1)
            pol = np.take_along_axis(pol, perm, 1)  # column 0 = the rollout r_i, column 1 = the history h_i
            r, h = pol[:, 0], pol[:, 1]
            used_none = np.zeros_like(pol, dtype=bool)
            used_r, used_h = used_none.copy(), used_none.copy()
            used_r[:, 0] = True
            used_h[:, 1] = True
            r_t = torch.as_tensor(r)
            f_t = feats_t[idx]
            ids = [sc.ids[i] for i in idx]
            priors: dict = {}
            for k in sorted({s["k"] for s in specs}):
                if k == 0:
                    continue
                sel = np.argsort(rng.random(prior_pool.shape), axis=1)[:, :k]  # K random reference samples
                succ = np.take_along_axis(prior_pool, sel, 1).sum(1)
                table = {"k": k, "counts": {sc.ids[i]: int(succ[i]) for i in range(N)},
                         "mean": float(succ.sum() / (k * N))}
                priors[k] = table
            hist = {ids[j]: (int(h[j]), 1) for j in range(B)}
            for s in specs:
                if s["kind"] == "rpp":
                    b, used = np.full(B, r.mean()), used_r
                elif s["kind"] == "history_raw":
                    b, used = prior_values(ids, None, hist).double().numpy(), used_h
                elif s["kind"] == "toward_prior":
                    p = _prior_pc(priors[s["k"]], ids, s["pc"])
                    shift = calibrate_shift(r_t, p)  # leave-one-out: row i's shift ignores r_i
                    mu = calibrated_values(p, shift)
                    b = similarity_pool(r_t, f_t, target=mu, bandwidth=s["bandwidth"], shrink=s["shrink"])
                    b, used = b.clamp(0.0, 1.0).numpy(), used_none
                else:
                    table = priors.get(s["k"])
                    hp = hist if s.get("history") else None
                    if "pc" in s:
                        p = _prior_pc(table, ids, s["pc"])
                    else:
                        p = prior_values(ids, table, hp) if (table is not None or hp) else None
                    b = basis_baseline(r_t, None if p is None else p.double(), f_t, **s["opts"]).numpy()
                    used = used_h if s.get("history") else used_none
                sums.add(s["name"], idx, b, pol, used)
            for g in emp_groups:
                used_g = np.zeros_like(used_none)
                used_g[:, :g] = True
                gm = pol[:, :g].mean(1)
                rl = pol[:, 1:g].mean(1)
                for n, b in ((f"group_mean_G{g}_emp", gm), (f"rloo_G{g}_emp", rl)):
                    sums.add(n, idx, b, pol, used_g)
            sums.count[idx] += 1
        pol_cols = sc.pol if not sc.shared else sc.ref  # shared: all reference samples estimate V(1 - V)
        pm = pol_cols.mean(1)
        mm = pol_cols.shape[1]
        per_prompt, per_raw, per_noise = sums.per_prompt(pm * (1 - pm) * mm / (mm - 1))
        res[B] = summarise(per_prompt, per_raw, per_noise, rng, R, time.time() - t0)
    return res


def base_id(i: str) -> str:
    """The question's id of a recorded prompt: ``record_rollouts.py`` records a revisited question as ``ID#k``."""
    return str(i).split("#", 1)[0]


def run_mix_streams(sc: Scenario, B: int, resamples: int, rng: np.random.Generator,
                    options: dict | None = None, steps: int = MIX_STREAM_STEPS) -> dict | None:
    """BASIS with ``mix: true`` (basis_lite/estimators/basis_mix.py), which learns across steps, on simulated runs.

    A run draws its batches as the trainer's ``PromptSampler`` does (consecutive B prompts of a fresh permutation
    each epoch) and gives a prompt, at its c-th draw, the c-th of a random order of its policy samples; the mix
    carries its state (parts' errors, value tracker, replay buffer for the probe) from step to step exactly as the
    trainer does (``observe`` and ``ReplayBuffer.add`` after the baselines), with the tracker keyed by the question
    (a revisited question, ``ID#k``, is the same prompt to it, as in training). Truth: the prompt's samples no step
    has used so far (so nothing the tracker or the probe saw); the steps are limited so that at least 2 remain. The
    first half of each run's steps warms the state up, the second half is scored, with REINFORCE++'s batch mean and
    the plain default (``basis:default@K0``) scored on the same rows: the mix's ratio is to that REINFORCE++.
    ``None`` when the recording has too few samples for a run of at least 2 steps. No prior (K = 0), as the
    default preset. The policy is fixed here: in training it drifts, which ages the tracker's counts."""
    opts = dict(MIX_OPTIONS if options is None else options)
    pol_all = (sc.ref if sc.shared else sc.pol).astype(np.float64)  # shared: every reference sample is a policy one
    N, M = pol_all.shape
    L = min(steps, (M - 2) * N // B)
    if L < 2:
        return None
    warm = L // 2
    n_runs = max(2, math.ceil(resamples / (L - warm)))
    feats_t = torch.as_tensor(sc.feats, dtype=torch.float32)
    names = ("basis:mix@K0", "reinforce_pp", "basis:default@K0", "basis:loo_mean")
    raw = {n: np.zeros(N) for n in names}
    noise = {n: np.zeros(N) for n in names}
    count = np.zeros(N)
    weights = []
    t0 = time.time()
    for _ in range(n_runs):
        state = make_state(opts)
        cap = mix_replay_capacity(opts)
        replay = ReplayBuffer(cap) if cap else None
        col_order = np.argsort(rng.random((N, M)), axis=1)
        uses = np.zeros(N, dtype=int)
        order = np.concatenate([rng.permutation(N) for _ in range(math.ceil(L * B / N) + 1)])
        for t in range(L):
            idx = order[t * B:(t + 1) * B]
            cols = np.empty(B, dtype=int)
            for j, i in enumerate(idx):  # a prompt drawn twice in one batch (epoch boundary) takes two samples
                cols[j] = col_order[i, uses[i]]
                uses[i] += 1
            r = pol_all[idx, cols]
            ids = [base_id(sc.ids[i]) for i in idx]
            f_t = feats_t[idx]
            rew = torch.as_tensor(r, dtype=torch.float32).view(B, 1)
            ctx = EstimatorContext(prompt_ids=ids, features=f_t, replay=replay, options=opts, state=state)
            _, b_mix = basis_mix(rew, ctx, state)
            if t >= warm:
                # truth: the samples of each prompt that no step of this run used (this batch's included)
                used = np.ones((B, M), dtype=bool)
                for j, i in enumerate(idx):
                    used[j, col_order[i, uses[i]:]] = False
                pol = pol_all[idx]
                r_t = torch.as_tensor(r)
                rows = {"basis:mix@K0": b_mix.double().view(-1).numpy(), "reinforce_pp": np.full(B, r.mean()),
                        "basis:default@K0": basis_baseline(r_t, None, f_t.double()).numpy(),
                        "basis:loo_mean": basis_baseline(r_t, None, None, **BASIS_VARIANTS["loo_mean"]).numpy()}
                for n, b in rows.items():
                    e_raw, e_noise = sq_err(b, pol, used)
                    np.add.at(raw[n], idx, e_raw)
                    np.add.at(noise[n], idx, e_noise)
                np.add.at(count, idx, 1)
                weights.append(dict(state.weights))
            state.observe(t, ids, rew)
            if replay is not None:
                replay.add(t, ids, rew, f_t)
    seen = count > 0
    per = {n: (raw[n][seen] - noise[n][seen]) / count[seen] for n in names}
    per_raw = {n: raw[n][seen] / count[seen] for n in names}
    per_noise = {n: noise[n][seen] / count[seen] for n in names}
    out = summarise(per, per_raw, per_noise, rng, n_runs * (L - warm), time.time() - t0)
    cell = out["basis:mix@K0"]
    cell["stream"] = {"runs": n_runs, "steps": L, "scored_from_step": warm, "options": opts,
                      "mean_weights": {k: float(np.mean([w[k] for w in weights])) for k in weights[0]},
                      **{f"{n}_mse_same_rows": out[n]["mse"] for n in names[1:]},
                      **{f"{n}_ratio_same_rows": out[n]["ratio"] for n in names[2:]}}
    return cell


# ----------------------------------------------------------------------------------------------------------------
# report


def markdown(report: dict) -> str:
    scen = report["scenarios"]
    cols = [(sk, B) for sk, s in scen.items() for B in s["results"]]
    rows: list[str] = []
    for s in scen.values():
        for B, r in s["results"].items():
            for n in r:
                if not n.startswith("_") and n not in rows:
                    rows.append(n)
    order = [n for n in KEY_ROWS if n in rows] + [n for n in rows if n not in KEY_ROWS]
    lines = ["# Value-estimate MSE against the Monte-Carlo value", "",
             f"Generated {report['created']} by `{report['command']}` in {report['analysis_seconds']:.0f} s.", "",
             "Cells: truth-noise-corrected MSE (ratio to REINFORCE++'s batch mean). Group-mean / RLOO rows use G "
             "rollouts per prompt (G times the generation cost); every other row uses ONE rollout per prompt. "
             "`@K` = BASIS prior from K reference samples per prompt (0 = none), built as `priors.prior_values` does "
             f"(pseudo-count {PSEUDO_COUNT:g} toward the dataset mean). `basis:<v>` rows are `BASIS_VARIANTS[v]`; "
             "`basis:default_nofeat` = BASIS_DEFAULTS without features. `x:` rows are candidates that are NOT in "
             "basis_lite/estimators: `x:features_h<h>_l<lambda>` fixed similarity pooling; `x:*_pc<c>` a prior with "
             "pseudo-count c; `x:features_toward_prior_l<lambda>` the kernel mean of the other prompts' REWARDS shrunk "
             "toward the calibrated prior mu_i (similarity_pool(r, f, target=mu, bandwidth=0.3, shrink=lambda), "
             "prior pseudo-count 4) instead of mu_i + pooled residuals. `history_raw` = prior_values with one earlier "
             "reward of the prompt and no reference prior. Every MSE has the truth noise (reported per scenario) "
             "subtracted. `<family>/ref` scenarios are the no-drift case (policy = reference: each prompt's "
             "reference samples are split at random, per resample, into prior samples and policy samples; the "
             "counts are in the scenario lines). `basis:mix@K0` = `estimator.options: {mix: true}` "
             "(basis_lite/estimators/basis_mix.py), which learns across steps: scored on simulated runs of "
             f"{report['settings'].get('mix_steps', MIX_STREAM_STEPS)} steps (fewer where a prompt would run out of "
             "samples) whose batches are drawn as the "
             "trainer draws them, its state carried from step to step, the second half of each run scored; its "
             "ratio is to REINFORCE++ on the same rows (`run_mix_streams`).", ""]
    for m in report["recordings"]:
        pols = ", ".join(f"{k}: {v['samples']}/prompt at T={v['temperature']} ({v.get('seconds', 0):.0f} s, mean reward "
                         f"{v.get('mean_reward', float('nan')):.3f})" for k, v in m["policies"].items())
        lines.append(f"- recording `{m['file']}`: {m['family']} levels {m['levels']}, {m['n_prompts']} prompts, "
                     f"{m.get('dtype')} on {m.get('device')} ({m.get('threads')} thread(s)), max_new_tokens "
                     f"{m.get('max_new_tokens')}; {pols}; total {m.get('total_seconds')} s")
    for sk, s in scen.items():
        lines.append(f"- **{sk}**: {s['n_prompts']} prompts, policy {s['policy']} ({s['policy_samples']} samples/prompt, "
                     f"mean reward {s['mean_reward_policy']:.3f}), reference T=1.0 ({s['ref_samples']} samples/prompt, "
                     f"mean reward {s['mean_reward_ref']:.3f}); Var(V) across prompts = {s['value_var']:.4f}; truth "
                     f"noise subtracted (leave-one-out rows) = {s['truth_noise_none']:.4f}")
    rows = []
    for n in order:
        cells = []
        for sk, B in cols:
            c = scen[sk]["results"][B].get(n)
            cells.append("" if c is None else f"{fmt_na(c['mse'])} ({fmt_na(c['ratio'], 2)})")
        rows.append([n] + cells)
    lines += ["", markdown_table(["estimator"] + [f"{sk} B={B}" for sk, B in cols], rows)]
    mix = [(sk, B, r["basis:mix@K0"]) for sk, s in scen.items() for B, r in s["results"].items() if "basis:mix@K0" in r]
    if mix:
        lines += ["", "## BASIS mix on simulated runs", "",
                  "Per cell: runs x steps (scored from step), MSE ratio to REINFORCE++ of the mix, of the plain "
                  "default and of the leave-one-out mean on the same rows, and the mix's mean weights on the scored "
                  "steps.", ""]
        rows = []
        for sk, B, c in mix:
            st = c["stream"]
            rows.append([f"{sk} B={B}", f"{st['runs']} x {st['steps']} ({st['scored_from_step']})",
                         f"{fmt_na(c['ratio'], 2)} [{fmt_na(c['ratio_ci90'][0], 2)}, {fmt_na(c['ratio_ci90'][1], 2)}]",
                         fmt_na(st["basis:default@K0_ratio_same_rows"], 2),
                         fmt_na(st["basis:loo_mean_ratio_same_rows"], 2),
                         ", ".join(f"{k} {v:.2f}" for k, v in st["mean_weights"].items())])
        lines.append(markdown_table(("cell", "runs x steps (scored from)", "mix", "basis:default@K0",
                                     "basis:loo_mean", "mean weights"), rows))
    t = report["targets"]
    lines += ["", "## Targets", "", f"Default tested: `{t['default_spec']}`", ""]
    for k, v in t["checks"].items():
        lines.append(f"- {k}: **{v['pass']}** — {v['detail']}")
    lines += ["", "## MSE ratio to REINFORCE++ as a function of K (largest B of each scenario)", "",
              markdown_table(["estimator", *report["k_curve"]["columns"]],
                             [[n, *(fmt_na(v, 2) for v in vals)] for n, vals in report["k_curve"]["rows"].items()])]
    rec = report["recommendation"]
    lines += ["", "## Recommendation", "", rec["text"], ""]
    return "\n".join(lines)


def _row(v: str, k: int) -> str:
    return f"{v}@K{k}" if v.startswith("x:") else f"basis:{v}@K{k}"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = report["scenarios"]
    n = len(scen)
    fig, axes = plt.subplots(2, n, figsize=(5.2 * n, 8.5), squeeze=False)
    show = [e for e in report["plot_rows"]]
    for j, (sk, s) in enumerate(scen.items()):
        ax = axes[0, j]
        Bs = [int(b) for b in s["results"]]
        for ci, name in enumerate(show):
            ys = [s["results"][B][name]["ratio"] if name in s["results"][B] else np.nan for B in s["results"]]
            if all(np.isnan(ys)):
                continue
            style = "--" if name.startswith(("group", "rloo")) else "-"
            ax.plot(Bs, ys, style, marker="o", ms=3, label=name, color=plt.cm.tab20(ci % 20))
        ax.axhline(TARGET_RATIO, color="k", lw=0.8, ls=":")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(Bs, [str(b) for b in Bs])
        ax.set_title(f"{sk} (N={s['n_prompts']})", fontsize=10)
        ax.set_xlabel("batch size B (prompts)")
        ax.set_ylabel("MSE / MSE(REINFORCE++)")
        ax.set_ylim(0, 2.0)
        ax = axes[1, j]
        Bmax = list(s["results"])[-1]
        r = s["results"][Bmax]
        for ci, fam_name in enumerate(report["k_curve"]["variants"]):
            ks, ys = [], []
            for k in [0] + report["settings"]["ks"]:
                c = r.get(_row(fam_name, k)) or (r.get(f"basis:{fam_name}") if k == 0 else None)
                if c is not None:
                    ks.append(k)
                    ys.append(c["ratio"])
            if len(ks) > 1:
                ax.plot(ks, ys, marker="o", ms=3, label=fam_name, color=plt.cm.tab10(ci % 10))
        for g in GROUP_SIZES:
            ax.axhline(r[f"group_mean_G{g}"]["ratio"], ls="--", lw=0.9, color=("0.75", "0.5", "0.1")[GROUP_SIZES.index(g)],
                       label=f"group mean G={g}")
        ax.axhline(TARGET_RATIO, color="k", lw=0.8, ls=":")
        ax.set_xlabel("K reference samples per prompt (prior)")
        ax.set_ylabel(f"MSE ratio at B={Bmax}")
        ax.set_ylim(0, 2.0)
        ax.set_title(f"{sk}: MSE vs K", fontsize=10)
    axes[0, 0].legend(fontsize=6, loc="upper right")
    axes[1, 0].legend(fontsize=6, loc="upper right")
    fig.suptitle("Value MSE relative to REINFORCE++ (dotted: 0.31 target; dashed: G-rollout group estimators)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def evaluate_targets(report: dict, default_k: int, ks: list[int]) -> dict:
    """The issue's done-when targets for the default baseline (BASIS_DEFAULTS, one rollout per prompt), per K."""
    scen = report["scenarios"]
    per_k = {}
    for k in [0] + list(ks):
        name, nofeat = f"basis:default@K{k}", f"basis:default_nofeat@K{k}"
        cells, ok_g8, ok_ratio, ok_nofeat, seen = [], True, True, True, False
        for sk, s in scen.items():
            for B, r in s["results"].items():
                if name not in r:
                    continue
                seen = True
                d, g8, rp, nf = r[name], r["group_mean_G8"], r["reinforce_pp"], r.get(nofeat)
                ok_g8 &= d["mse"] < g8["mse"]
                ok_ratio &= d["ratio"] <= TARGET_RATIO
                if nf is not None:
                    ok_nofeat &= nf["mse"] <= rp["mse"]
                cells.append({"cell": f"{sk} B={B}", "ratio": d["ratio"], "ratio_ci90": d["ratio_ci90"],
                              "mse": d["mse"], "group_mean_G8_mse": g8["mse"],
                              "nofeat_ratio": nf["ratio"] if nf else None})
        if seen:
            per_k[k] = {"beats_group_mean_G8": bool(ok_g8), f"ratio_le_{TARGET_RATIO}": bool(ok_ratio),
                        "nofeat_not_worse_than_batch_mean": bool(ok_nofeat), "cells": cells}
    checks = {}
    d = per_k.get(default_k)
    if d:
        detail = "; ".join(f"{c['cell']}: ratio {c['ratio']:.2f} [{c['ratio_ci90'][0]:.2f}, {c['ratio_ci90'][1]:.2f}], "
                           f"MSE {c['mse']:.4f} vs G8 {c['group_mean_G8_mse']:.4f}"
                           + (f", no-features ratio {c['nofeat_ratio']:.2f}" if c["nofeat_ratio"] is not None else "")
                           for c in d["cells"])
        checks[f"K={default_k}: default < group mean G=8"] = {"pass": d["beats_group_mean_G8"], "detail": detail}
        checks[f"K={default_k}: default <= {TARGET_RATIO} x REINFORCE++"] = {"pass": d[f"ratio_le_{TARGET_RATIO}"],
                                                                            "detail": "ratios above"}
        checks[f"K={default_k}: default without features <= batch mean"] = {
            "pass": d["nofeat_not_worse_than_batch_mean"], "detail": f"row basis:default_nofeat@K{default_k}"}
    for k, v in per_k.items():
        if k != default_k:
            checks[f"K={k}: all three"] = {
                "pass": v["beats_group_mean_G8"] and v[f"ratio_le_{TARGET_RATIO}"] and v["nofeat_not_worse_than_batch_mean"],
                "detail": f"beats G8: {v['beats_group_mean_G8']}, ratio <= {TARGET_RATIO}: {v[f'ratio_le_{TARGET_RATIO}']}, "
                          f"no-features <= batch mean: {v['nofeat_not_worse_than_batch_mean']}; ratios "
                          + ", ".join(f"{c['cell']}: {c['ratio']:.2f}" for c in v["cells"])}
    return {"default_spec": f"basis:default@K{default_k} = BASIS_DEFAULTS with a prior of K={default_k} reference "
                            f"samples (K=0: no prior) and the policy's prompt features",
            "per_k": {str(k): v for k, v in per_k.items()}, "checks": checks}


def recommend(report: dict, ks: list[int]) -> dict:
    """Rank single-rollout rows by the geometric mean of their MSE ratio to REINFORCE++.

    Primary ranking: over the drifted-policy scenarios (every K is available there) and all their batch sizes;
    secondary: over every scenario, for the rows present in all of them. ``basis:`` rows (BASIS_VARIANTS) and
    ``x:`` rows (experimental candidates) are ranked separately."""
    scen = report["scenarios"]
    all_cells = [(sk, B) for sk, s in scen.items() for B in s["results"]]
    drift_cells = [(sk, B) for sk, B in all_cells if not scen[sk]["shared_reference"]] or all_cells

    def rank(prefix, cells):
        names = {n for sk, B in cells for n in scen[sk]["results"][B] if n.startswith(prefix)}
        score = {}
        for n in names:
            vals = [scen[sk]["results"][B][n]["ratio"] for sk, B in cells if n in scen[sk]["results"][B]]
            if len(vals) == len(cells) and all(v > 0 for v in vals):
                score[n] = float(np.exp(np.mean(np.log(vals))))
        return sorted(score.items(), key=lambda kv: (kv[1], kv[0]))  # ties by name: the same order every run

    ranked, ranked_x = rank("basis:", drift_cells), rank("x:", drift_cells)
    ranked_all = rank("basis:", all_cells)

    def best_at(k, rk):
        c = [(n, v) for n, v in rk if (n.endswith(f"@K{k}") or ("@K" not in n and k == 0)) and "+history" not in n]
        return c[0] if c else None

    per_k = {k: best_at(k, ranked) for k in [0] + list(ks)}
    g8 = {f"{sk} B={B}": scen[sk]["results"][B]["group_mean_G8"]["ratio"] for sk, B in all_cells}
    dc = ", ".join(sorted({sk for sk, _ in drift_cells}))
    text = [f"Ranked by the geometric-mean MSE ratio to REINFORCE++ over the drifted-policy scenarios ({dc}), all "
            "batch sizes:", ""]
    text += [f"{i + 1}. `{n}`: {v:.3f}" for i, (n, v) in enumerate(ranked[:12])]
    text += ["", "Experimental candidates (not in BASIS_VARIANTS), same cells:", ""]
    text += [f"{i + 1}. `{n}`: {v:.3f}" for i, (n, v) in enumerate(ranked_x[:8])]
    text += ["", "Over every scenario (rows present in all):", ""]
    text += [f"{i + 1}. `{n}`: {v:.3f}" for i, (n, v) in enumerate(ranked_all[:6])]
    text.append("")
    for k, bv in per_k.items():
        if bv:
            text.append(f"- best BASIS_VARIANTS row with K={k}: `{bv[0]}` ({bv[1]:.3f})")
    text.append("- group mean G=8 (8x the rollouts): " + ", ".join(f"{c}: {v:.2f}" for c, v in g8.items()))
    return {"ranked": ranked, "ranked_experimental": ranked_x, "ranked_all_scenarios": ranked_all,
            "best_per_k": {str(k): v for k, v in per_k.items()}, "text": "\n".join(text)}


def k_curve(report: dict, ks: list[int]) -> dict:
    scen = report["scenarios"]
    variants = ["default", "default_nofeat", "prior_shift", "prior_shift_additive", "paper", "prior_features_cv",
                "prior_features_fixed", "x:prior_shift_pc8", "x:features_toward_prior_l8"]
    cols, rows = [], {}
    for sk, s in scen.items():
        Bmax = list(s["results"])[-1]
        for k in [0] + list(ks):
            cols.append(f"{sk} B={Bmax} K={k}")
    for v in variants:
        vals = []
        for sk, s in scen.items():
            r = s["results"][list(s["results"])[-1]]
            for k in [0] + list(ks):
                c = r.get(_row(v, k))
                if c is None and k == 0:
                    c = r.get("basis:loo_mean") if v in ("prior_shift", "prior_shift_additive", "paper") else None
                vals.append(c["ratio"] if c else float("nan"))
        rows[v] = vals
    return {"columns": cols, "rows": rows, "variants": variants}


def analyse(paths: list[str], batch_sizes: list[int], resamples: int, ks: list[int], seed: int,
            variants: list[str] | None = None, default_k: int | None = None, command: str = "",
            mix_steps: int = MIX_STREAM_STEPS) -> dict:
    with_mix = variants is None or "mix" in variants
    t0 = time.time()
    fams = load_recordings(paths)
    specs = estimator_specs(ks, variants)
    rng = np.random.default_rng(seed)
    torch.set_num_threads(1)
    scen_out = {}
    for sc in scenarios_of(fams, ks):
        N = sc.pol.shape[0]
        Bs = sorted({min(B, N) for B in batch_sizes if B <= N} | ({N} if max(batch_sizes) > N else set()))
        res = run_scenario(sc, specs, Bs, resamples, rng)
        if with_mix:
            for B in Bs:
                cell = run_mix_streams(sc, B, resamples, rng, steps=mix_steps)
                if cell is not None:
                    res[B]["basis:mix@K0"] = cell
        pol_cols = sc.ref if sc.shared else sc.pol
        pm = pol_cols.mean(1)
        mm = pol_cols.shape[1]
        s2 = pm * (1 - pm) * mm / (mm - 1)
        key = f"{sc.family}/{sc.policy}"
        scen_out[key] = {
            "family": sc.family, "policy": sc.policy, "n_prompts": int(N), "shared_reference": sc.shared,
            "policy_samples": int(pol_cols.shape[1] - (sc.n_prior_cols if sc.shared else 0)),
            "ref_samples": int(sc.n_prior_cols if sc.shared else sc.ref.shape[1]),
            "mean_reward_policy": float(pol_cols.mean()), "mean_reward_ref": float(sc.ref.mean()),
            "value_var": float(max(0.0, pm.var() - (s2 / mm).mean())),
            "truth_noise_none": float(res[Bs[-1]]["basis:loo_mean"]["truth_noise"]) if "basis:loo_mean" in res[Bs[-1]]
            else float("nan"),
            "results": {str(B): v for B, v in res.items()},
        }
        print(f"{key}: done in {time.time() - t0:.0f}s", flush=True)
    report = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command,
              "settings": {"batch_sizes": batch_sizes, "resamples_at_B32": resamples,
                           "resamples_rule": "R(B) = max(min(10, resamples), ceil(resamples * 32 / min(B, N)))", "ks": ks,
                           "seed": seed, "mix_steps": mix_steps, "pseudo_count": PSEUDO_COUNT, "group_sizes": list(GROUP_SIZES),
                           "target_ratio": TARGET_RATIO, "basis_defaults": {k: (list(v) if isinstance(v, tuple) else v)
                                                                            for k, v in BASIS_DEFAULTS.items()},
                           "mse": "truth-noise corrected (unbiased); mse_raw and truth_noise in every cell"},
              "recordings": [m for f in fams.values() for m in f.meta],
              "scenarios": scen_out}
    report["recommendation"] = recommend(report, ks)
    if default_k is None:
        default_k = max(ks) if ks else 0
    report["targets"] = evaluate_targets(report, default_k, ks)
    report["k_curve"] = k_curve(report, ks)
    report["plot_rows"] = [n for n in ["reinforce_pp", "basis:loo_mean", "basis:default@K0", "basis:mix@K0",
                                       *(f"basis:default@K{k}" for k in ks), "basis:features_fixed",
                                       *(f"x:features_toward_prior_l8@K{k}" for k in ks), "history_raw",
                                       "group_mean_G2", "group_mean_G4", "group_mean_G8", "rloo_G8"] if n]
    report["analysis_seconds"] = time.time() - t0
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recordings", nargs="*", help="default: bench/results/record_rollouts/rollouts_*.npz")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                    help="default 32 64 128 256 (16 32 64 128 with --trajectories)")
    ap.add_argument("--trajectories", nargs="*", default=None, metavar="NPZ",
                    help="analyse trajectory recordings instead (default: "
                         "bench/results/record_trajectories/trajectories_*.npz)")
    ap.add_argument("--buffer-size", type=int, default=4096, help="--trajectories: replay buffer rows")
    ap.add_argument("--min-rows", type=int, default=None,
                    help="--trajectories: buffer rows every probe needs before use (default: each variant's own)")
    ap.add_argument("--kinds", default=None,
                    help="--trajectories: comma list of problem kinds (prompt id task/KIND/index) to keep of the "
                         "probe prompts, e.g. add2 (default: all)")
    ap.add_argument("--resamples", type=int, default=60, help="resampled batches at B=32 (fewer at larger B)")
    ap.add_argument("--ks", type=int, nargs="*", default=[2, 4, 8], help="prior sizes K (reference samples)")
    ap.add_argument("--default-k", type=int, default=None, help="K of the default checked against the targets")
    ap.add_argument("--variants", nargs="*", default=None, help="subset of BASIS_VARIANTS (+ default_nofeat, history)")
    ap.add_argument("--mix-steps", type=int, default=MIX_STREAM_STEPS,
                    help="steps per simulated run of the basis:mix row (the second half scored)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output prefix (.json, .md, .png; default "
                    "bench/results/value_mse/value_mse, with --trajectories "
                    "bench/results/value_mse_trajectories/value_mse_trajectories)")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    cmd = "python bench/value_mse.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.trajectories is not None:
        from bench import value_mse_trajectories as vt

        paths = a.trajectories or sorted(glob.glob(str(TRAJECTORIES / "trajectories_*.npz")))
        if not paths:
            raise SystemExit("no trajectory recordings: run bench/record_trajectories.py first")
        out = Path(a.out) if a.out else results_dir("value_mse_trajectories") / "value_mse_trajectories"
        variants = None if a.variants is None else [v for v in a.variants if v in vt.PROBE_VARIANTS]
        return vt.main(paths, a.batch_sizes or [16, 32, 64, 128], a.resamples, a.seed, out, a.no_plot, cmd.strip(),
                       a.buffer_size, variants, a.min_rows,
                       [k for k in a.kinds.split(",") if k] if a.kinds else None)
    a.batch_sizes = a.batch_sizes or [32, 64, 128, 256]
    paths = a.recordings or sorted(glob.glob(str(RECORDINGS / "rollouts_*.npz")))
    if not paths:
        raise SystemExit("no recordings: run bench/record_rollouts.py first")
    report = analyse(paths, a.batch_sizes, a.resamples, a.ks, a.seed, a.variants, a.default_k, cmd.strip(),
                     a.mix_steps)
    out = Path(a.out) if a.out else results_dir("value_mse") / "value_mse"
    md = markdown(report)
    write_json(out.with_suffix(".json"), report)
    out.with_suffix(".md").write_text(md)
    if not a.no_plot:
        plot(report, out.with_suffix(".png"))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
