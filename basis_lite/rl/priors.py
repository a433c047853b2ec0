"""BASIS offline prior: K reference rollouts per training prompt before training, cached on disk.

The reference policy is the base model (adapter disabled, which for a fresh LoRA is the same thing). Each prompt's
prior is its smoothed success rate, shrunk toward the dataset mean m with c pseudo-observations:

    p0_i = (s_i + c * m) / (K + c),       s_i = successes among K reference samples,  m = sum s / (N K)

(c = PSEUDO_COUNT) so no prior is exactly 0 or 1 and a prompt seen only a few times leans on the whole dataset. With `history` on,
the run's own earlier rewards for prompt i (h_i successes out of n_i, all from EARLIER steps, so independent of
the current reward and leave-one-out safe) are added: p_i = (s_i + h_i + c m) / (K + n_i + c).

The table also keeps each sample's reward total (`rewards`: A*-PO's V*, spo's initial counts read them) and the
samples' prompt and generated token counts (the run's reference cost). It is cached as JSON under a key of model,
dataset config, rendered prompts, reward config and sampling settings, so later runs (and later epochs) reuse it. `compute_prior(cfg, samples)` (`basis-lite prior --preset ...`)
builds the reference policy and precomputes it; the trainer calls `load_or_compute_prior` with its own policy.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..engines.base import SamplingParams
from ..errors import ConfigError
from ..safeio import atomic_write_text, read_json

log = logging.getLogger("basis_lite")

PSEUDO_COUNT = 4.0  # chosen with bench/value_mse.py (its x:*_pc rows compare pseudo-counts; bench/results/value_mse.md)


def prior_key(cfg, prompts: list[str], k: int, per_prompt: bool = False) -> str:
    """The cache key; tables sampled from per-prompt streams get keys of their own."""
    fields = {
        "model": cfg.model.name, "dtype": cfg.model.dtype, "4bit": cfg.model.load_in_4bit,
        "data": {k2: v for k2, v in vars(cfg.data).items()}, "prompts": hashlib.sha256(
            "\x00".join(prompts).encode()).hexdigest(),
        "gen": {"t": cfg.generation.temperature, "p": cfg.generation.top_p, "k": cfg.generation.top_k,
                "max": cfg.generation.max_new_tokens},
        "reward": vars(cfg.reward), "K": k, "seed": cfg.train.seed, "v": 2,
    }
    if per_prompt:
        fields["rng"] = "per_prompt"
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def prior_cache_path(cache_root: Path, key: str) -> Path:
    return Path(cache_root) / "priors" / f"{key}.json"


def compute_prior_counts(engine, model, examples, prompts: list[str], scorer, params: SamplingParams, k: int,
                         batch_size: int = 64, progress: bool = True, data_cfg=None,
                         seeds: list[int] | None = None) -> dict:
    """{"counts": successes out of k reference samples per example id, "rewards": the k reward totals per id,
    "prompt_tokens", "generated_tokens": what the samples processed} (the adapter is disabled while sampling);
    `data_cfg` names the data columns passed to user reward functions; `seeds`, one per prompt, sample each prompt
    from its own stream."""
    from ..rewards.scorer import example_columns

    counts: dict[str, int] = {}
    rewards: dict[str, list[float]] = {}
    prompt_tokens = generated_tokens = 0
    per = max(1, batch_size // k)
    p = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                       max_new_tokens=params.max_new_tokens, n=k)
    ctx = model.disable_adapter() if hasattr(model, "disable_adapter") else _null()
    with ctx, tqdm(total=len(prompts), desc=f"prior (K={k})", disable=not progress, unit="prompt") as bar:
        for i in range(0, len(prompts), per):
            chunk = prompts[i:i + per]
            if seeds is not None:
                p.seeds = seeds[i:i + per]
            rolls = engine.generate(chunk, p, with_features=False)
            exs = [ex for ex in examples[i:i + per] for _ in range(k)]
            cols = example_columns(examples[i:i + per], data_cfg, repeat=k) if data_cfg is not None else None
            rb = scorer([ex.prompt for ex in exs], [r.text for r in rolls], [ex.answer for ex in exs], columns=cols,
                        completion_ids=[r.completion_ids for r in rolls])
            for j, ex in enumerate(examples[i:i + per]):
                counts[ex.id] = int(round(sum(rb.correct[j * k:(j + 1) * k])))
                rewards[ex.id] = [float(x) for x in rb.total[j * k:(j + 1) * k]]
            prompt_tokens += sum(len(r.prompt_ids) for r in rolls)
            generated_tokens += sum(len(r.completion_ids) for r in rolls)
            bar.update(len(chunk))
    return {"counts": counts, "rewards": rewards, "prompt_tokens": prompt_tokens, "generated_tokens": generated_tokens}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def load_or_compute_prior(cfg, cache_root: Path, engine, model, examples, prompts, scorer, params, k,
                          progress=True) -> dict:
    """{"k": K, "counts": {id: successes}, "rewards": {id: [K reward totals]}, "mean": m, "prompt_tokens": n,
    "generated_tokens": n, "key": key, "seconds": s, "cached": bool}.

    A cache file that does not parse or does not cover these prompts is named in a warning, moved aside
    (`<key>.json.corrupt-<time>`) and computed again; the new file is written atomically (temp + fsync + rename).
    """
    key = prior_key(cfg, prompts, k)
    path = prior_cache_path(cache_root, key)
    table = _cached_table(path, key, [ex.id for ex in examples], k)
    if table is not None:
        table["cached"] = True
        return table
    t0 = time.time()
    drawn = compute_prior_counts(engine, model, examples, prompts, scorer, params, k, progress=progress,
                                 data_cfg=cfg.data)
    counts = drawn["counts"]
    mean = sum(counts.values()) / max(1, k * len(counts))
    table = {"k": k, **drawn, "mean": mean, "key": key, "seconds": time.time() - t0}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(table))
    table["cached"] = False
    return table


def _cached_table(path: Path, key: str, ids: list[str], k: int) -> dict | None:
    """The cached table at `path`, or None: none there, or a damaged one, which is named in a warning and moved
    aside (`<key>.json.corrupt-<time>`) so the caller computes the prior again."""
    if not path.exists():
        return None
    table, why = _read_table(path, key, ids, k)
    if table is None:
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(path, aside)
        log.warning("prior cache file %s is damaged (%s); moved it to %s and computing the prior again", path,
                    why, aside.name)
    return table


def _read_table(path: Path, key: str, ids: list[str], k: int) -> tuple[dict | None, str]:
    """(the cached table, "") when `path` holds a complete prior for these ids, else (None, why not)."""
    try:
        table = read_json(path)
    except ValueError as e:
        return None, str(e)
    if not isinstance(table, dict) or table.get("key") != key or table.get("k") != k:
        return None, "not the prior of this key"
    counts, rewards = table.get("counts"), table.get("rewards")
    if not isinstance(counts, dict) or any(not isinstance(counts.get(i), int) or not 0 <= counts[i] <= k
                                           for i in ids):
        return None, "counts missing or out of range"
    if not isinstance(rewards, dict) or any(
            not isinstance(rewards.get(i), list) or len(rewards[i]) != k
            or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in rewards[i]) for i in ids):
        return None, "rewards missing or not K finite numbers per prompt"
    if not all(isinstance(table.get(f), int) and table[f] >= 0 for f in ("prompt_tokens", "generated_tokens")):
        return None, "no token counts"
    if not isinstance(table.get("mean"), (int, float)):
        return None, "no mean"
    return table, ""


def load_or_compute_seeded_prior(cfg, cache_root: Path, engine, model, examples, prompts, scorer, params, k,
                                 ranks, progress=True) -> dict:
    """`load_or_compute_prior` with training prompt i sampled from the stream (train.seed, "prior", i), the prompts
    split over the data-parallel `ranks` (basis_lite.rl.distributed) and the counts gathered.

    Rank 0 alone reads and writes the cache (a damaged file is moved aside and recomputed, the new one written
    atomically); the others receive its counts, so ranks need no shared disk.
    """
    from ..engines.seeded import stream_seed

    key = prior_key(cfg, prompts, k, per_prompt=True)
    path = prior_cache_path(cache_root, key)
    table = _cached_table(path, key, [ex.id for ex in examples], k) if ranks.is_main else None
    t0 = time.time()
    n = len(examples)
    if ranks.broadcast_floats([1.0 if table is not None else 0.0])[0]:
        sent = [0.0] * (n * (k + 1) + 2)  # counts, rewards (k per prompt), prompt and generated tokens
        if table is not None:
            sent = ([float(table["counts"].get(ex.id, 0)) for ex in examples]
                    + [float(x) for ex in examples for x in table["rewards"][ex.id]]
                    + [float(table["prompt_tokens"]), float(table["generated_tokens"])])
        got = ranks.broadcast_floats(sent)
        counts_list, flat, tokens = got[:n], got[n:n * (k + 1)], got[n * (k + 1):]
        rewards_list = [flat[i * k:(i + 1) * k] for i in range(n)]
        cached = True
    else:
        lo, hi = ranks.bounds(n)
        seeds = [stream_seed(cfg.train.seed, "prior", i) for i in range(lo, hi)]
        mine = compute_prior_counts(engine, model, examples[lo:hi], prompts[lo:hi], scorer, params, k,
                                    progress=progress, data_cfg=cfg.data, seeds=seeds)
        counts_list = ranks.gather_ragged([float(mine["counts"][ex.id]) for ex in examples[lo:hi]], n)
        columns = [ranks.gather_ragged([mine["rewards"][ex.id][j] for ex in examples[lo:hi]], n) for j in range(k)]
        rewards_list = [[columns[j][i] for j in range(k)] for i in range(n)]
        tokens = ranks.sum([float(mine["prompt_tokens"]), float(mine["generated_tokens"])])
        cached = False
    counts = {ex.id: int(round(c)) for ex, c in zip(examples, counts_list)}
    mean = sum(counts.values()) / max(1, k * len(counts))
    table = {"k": k, "counts": counts, "rewards": {ex.id: r for ex, r in zip(examples, rewards_list)}, "mean": mean,
             "prompt_tokens": int(round(tokens[0])), "generated_tokens": int(round(tokens[1])), "key": key,
             "seconds": 0.0 if cached else time.time() - t0}
    if not cached and ranks.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(table))
    table["cached"] = cached
    return table


def compute_prior(cfg, samples: int = 0, progress: bool = True) -> dict:
    """Load the reference policy of `cfg` and compute (or reuse from the cache) its prior over the training prompts.

    K = `samples`, else `estimator.prior_samples`, else 8. Returns the `load_or_compute_prior` table plus "prompts"
    (how many training prompts it covers).
    """
    from ..data import format_prompt, load_examples
    from ..engines.base import params_from_config
    from ..model.loading import cache_root
    from ..rewards.scorer import RewardScorer, column_names
    from ..runtime import build_policy, seed_everything, setup_device

    if samples < 0:
        raise ConfigError(f"--samples: expected K >= 0, got {samples}")
    k = samples or cfg.estimator.prior_samples or 8
    examples = load_examples(cfg.data, "train")  # a bad dataset fails before the model loads
    device, dtype = setup_device(cfg)
    seed_everything(cfg.train.seed)
    model, tok, engine = build_policy(cfg, device, dtype)
    prompts = [format_prompt(tok, ex.prompt, cfg.data) for ex in examples]
    with RewardScorer(cfg.reward, column_names(examples, cfg.data)) as scorer:
        table = load_or_compute_prior(cfg, cache_root(cfg.model.cache_dir), engine, model, examples, prompts,
                                      scorer, params_from_config(cfg.generation), k, progress=progress)
    return {**table, "prompts": len(examples)}


def prior_values(ids: list[str], table: dict | None, history: dict | None = None,
                 default_mean: float = 0.5) -> torch.Tensor | None:
    """Smoothed prior per id from the reference counts and (optionally) this run's history {id: [succ, n]}."""
    if table is None and not history:
        return None
    k = table["k"] if table else 0
    m = table["mean"] if table else default_mean
    m = min(max(m, 0.02), 0.98)
    vals = []
    for i in ids:
        s = table["counts"].get(i, 0) if table else 0
        kk = k if (table and i in table["counts"]) else 0
        h, n = (history or {}).get(i, (0, 0))
        vals.append((s + h + PSEUDO_COUNT * m) / (kk + n + PSEUDO_COUNT))
    return torch.tensor(vals, dtype=torch.float32)
