"""Record real training trajectories for the online-probe value benchmark (``bench/value_mse.py --trajectories``).

It trains the preset (default ``cpu-smollm2-arith``, the default run: BASIS, 32 prompts x 1 rollout, 20 steps) with
the trainer's own step functions and records, with every feature a probe may read (the prompt's hidden state and
each rollout's trajectory feature, engines/trajectory.py):

- every training step s: the batch's prompts, rewards and features, plus ``--train-siblings`` extra rollouts of
  each of its prompts from the same policy (not trained on: they give a 2-rollout estimator's buffer its sibling
  targets, as a POISE run's own buffer would have them);
- at each of ``--record-steps`` t (before step t's update, so from the policy that sampled step t's batch): a fixed
  set of ``--probe-prompts`` training prompts (a uniform sample of the train split, seeded by ``data.seed``, so its
  mix of problem kinds is the training batches' mix) with ``--samples`` K rollouts each, the Monte-Carlo truth of
  their values. (Not the first P of the split: the built-in tasks draw their splits round-robin over the levels, so
  the head of the train split over-represents small levels that the rest of it barely holds.)

Extra samples are drawn with the torch RNG saved and restored around them, and trajectory capture changes no
sampled token (tests/engines/test_trajectory.py), so the training run itself is the run the preset makes without recording.
An estimator at step t may use the training steps s < t (its replay buffer) and one or two of the K samples of each
probe prompt at step t (the current batch); the rest are the truth. Stored in
``bench/results/record_trajectories/trajectories_<family>.npz`` (rewards float32, features float16, a JSON ``meta``
with the machine record), rewritten after every step: an interrupted recording keeps
what it finished (it is not resumed; rerun it from the start).

    python bench/record_trajectories.py                                   # the default run, P=128, K=8, 5 steps
    python bench/record_trajectories.py --preset smoke --steps 3 --record-steps 2 3 --probe-prompts 8 --samples 4 \\
        --out runs/traj_smoke.npz --set reward.functions=[tests.reward_fns:char_sum_reward] --set reward.timeout_s=0
        # plumbing check on the tiny random model, under a minute

Cost on 2 CPU cores (default settings, estimated from the default run's step times): the default run (about 13 min)
+ one extra rollout per training prompt per step (about 6 min) + 5 x 128 x 8 probe rollouts (16 generate() calls of
64 sequences, about 8 min per recorded step): about an hour. The recording is about 7 MB.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.paths import results_dir  # noqa: E402
from bench.lib.provenance import machine_record, with_load_after  # noqa: E402


def probe_examples(train_examples: list, n: int, seed: int) -> list:
    """The fixed probe prompts: n distinct ones of the train split drawn uniformly over its entries (seeded, so a
    revisited question is as likely as the training draw makes it), in the split's order."""
    rng = random.Random(f"probe-prompts/{seed}")
    if len({ex.id for ex in train_examples}) == len(train_examples):
        pick = rng.sample(range(len(train_examples)), min(n, len(train_examples)))
    else:
        seen, pick = set(), []
        for i in rng.sample(range(len(train_examples)), len(train_examples)):
            if len(pick) < n and train_examples[i].id not in seen:
                seen.add(train_examples[i].id)
                pick.append(i)
    return [train_examples[i] for i in sorted(pick)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-smollm2-arith")
    ap.add_argument("--steps", type=int, default=None, help="train.steps (default: the preset's)")
    ap.add_argument("--record-steps", type=int, nargs="+", default=[3, 6, 10, 14, 18])
    ap.add_argument("--probe-prompts", type=int, default=128, help="P: fixed training prompts recorded at each step")
    ap.add_argument("--samples", type=int, default=8, help="K: rollouts per probe prompt (>= 4)")
    ap.add_argument("--train-siblings", type=int, default=1, help="extra rollouts per training prompt (not trained)")
    ap.add_argument("--runs", default=None, help="run folder (default runs/record-trajectories-<preset>)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--out", default="", help="default bench/results/record_trajectories/trajectories_<dataset>.npz")
    a = ap.parse_args(argv)
    if a.samples < 4:
        ap.error("--samples must be >= 4 (two for a 2-rollout estimator, the rest for the truth)")

    import shutil

    import torch

    from basis_lite import trainer
    from basis_lite.config import load_config, to_dict
    from basis_lite.data import format_prompt, load_examples
    from basis_lite.engines.base import params_from_config
    from basis_lite.engines.trajectory import STATS
    from basis_lite.rl.step import Step
    from basis_lite.runs import checkpoint as ckpt

    overrides = list(a.set) + ([f"train.steps={a.steps}"] if a.steps else []) + ["train.save_every=100000"]
    cfg = load_config(a.preset, overrides)
    steps = cfg.train.steps
    record = sorted({t for t in a.record_steps if 1 <= t <= steps})
    run_dir = Path(a.runs) if a.runs else ROOT / "runs" / f"record-trajectories-{Path(a.preset).stem}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    out = Path(a.out) if a.out else results_dir("record_trajectories") / f"trajectories_{cfg.data.dataset}.npz"
    out.parent.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    run_dir.mkdir(parents=True)  # trainer.setup writes into a folder train() has claimed
    run = trainer.setup(cfg, run_dir, resume=False, progress=False)
    G = cfg.estimator.rollouts_per_prompt
    probe_ex = probe_examples(load_examples(cfg.data, "train"), a.probe_prompts, cfg.data.seed)
    probe_prompts = [format_prompt(run.tok, ex.question, cfg.data) for ex in probe_ex]
    gen = params_from_config(cfg.generation, n=G)
    extra = params_from_config(cfg.generation, n=a.train_siblings) if a.train_siblings else None
    probe_params = params_from_config(cfg.generation, n=a.samples)
    B, P, K = cfg.train.batch_size, len(probe_ex), a.samples
    arrays: dict[str, np.ndarray] = {}
    meta = {"kind": "trajectories", "preset": a.preset, "config": to_dict(cfg), "family": cfg.data.dataset,
            "steps": steps, "record_steps": record, "batch_size": B, "rollouts_per_prompt": G,
            "train_siblings": a.train_siblings, "probe_prompts": P, "samples": K,
            "probe_selection": "uniform sample of the train split",
            "probe_ids": [ex.id for ex in probe_ex], "probe_questions": [ex.question for ex in probe_ex],
            "probe_answers": [ex.answer for ex in probe_ex], "train_ids": [], "stats": list(STATS),
            "feature_layer": getattr(run.engine, "feature_layer", None),
            "trajectory_tokens": getattr(run.engine, "trajectory_tokens", None),
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_record(), "seconds": {},
            "metrics": []}

    def generate(prompts, params):
        return run.engine.generate(prompts, params, with_features=True, with_trajectory=True)

    def stack(rolls, n_prompts, n):
        pf = torch.stack([rolls[i * n].feature for i in range(n_prompts)]).numpy().astype(np.float16)
        tr = torch.stack([r.trajectory for r in rolls]).view(n_prompts, n, -1).numpy().astype(np.float16)
        return pf, tr

    def save():
        tmp = out.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, meta=np.array(json.dumps(meta, default=str)), **arrays)
        os.replace(tmp, out)

    def put(name, value, index, shape, dtype):
        if name not in arrays:
            arrays[name] = np.zeros(shape, dtype=dtype)
        arrays[name][index] = value

    try:
        for step in range(1, steps + 1):
            batch = next(run.sampler)
            prompts = [run.prompt_of[ex.id] for ex in batch]
            t0 = time.time()
            run.engine.sync(run.model)
            rollouts = generate(prompts, gen)
            gen_s = time.time() - t0
            rewards, scored = trainer.score(run, batch, rollouts)
            # extra rollouts and probe samples: drawn with the RNG restored afterwards (the run stays the same)
            rng = ckpt.rng_state()
            t1 = time.time()
            sib_r = sib_tr = None
            if extra is not None:
                sib = generate(prompts, extra)
                sr = run.scorer([r.prompt for r in sib], [r.text for r in sib],
                                [ex.answer for ex in batch for _ in range(a.train_siblings)])
                sib_r = np.array(sr.total, dtype=np.float32).reshape(B, a.train_siblings)
                sib_tr = stack(sib, B, a.train_siblings)[1]
            if step in record:
                t2 = time.time()
                pr = generate(probe_prompts, probe_params)
                ps = run.scorer([r.prompt for r in pr], [r.text for r in pr],
                                [ex.answer for ex in probe_ex for _ in range(K)])
                ti = record.index(step)
                pf, tr = stack(pr, P, K)
                put("probe_rewards", np.array(ps.total, dtype=np.float32).reshape(P, K), ti, (len(record), P, K),
                    np.float32)
                put("probe_prompt_features", pf, ti, (len(record), P, pf.shape[1]), np.float16)
                put("probe_trajectory", tr, ti, (len(record), P, K, tr.shape[-1]), np.float16)
                meta["seconds"][f"probe_step{step}"] = round(time.time() - t2, 1)
                print(f"step {step}: {P} probe prompts x {K}, mean reward {np.mean(ps.total):.3f}, "
                      f"{time.time() - t2:.0f} s", flush=True)
            ckpt.set_rng_state(rng)
            extra_s = time.time() - t1
            pf, tr = stack(rollouts, B, G)
            r_all = rewards.numpy().astype(np.float32)
            if sib_r is not None:
                r_all = np.concatenate([r_all, sib_r], 1)
                tr = np.concatenate([tr, sib_tr], 1)
            n_all = r_all.shape[1]
            put("train_rewards", r_all, step - 1, (steps, B, n_all), np.float32)
            put("train_prompt_features", pf, step - 1, (steps, B, pf.shape[1]), np.float16)
            put("train_trajectory", tr, step - 1, (steps, B, n_all, tr.shape[-1]), np.float16)
            meta["train_ids"].append([ex.id for ex in batch])
            rec_step = Step.of_rank(step, batch, batch, rollouts, rewards, scored, uses_features=run.uses_features,
                                  uses_trajectory=run.uses_trajectory, generation_s=gen_s,
                                  reward_warnings=run.scorer.warning_count).gathered(run.ranks)
            rec_step.adv, rec_step.base = trainer.baselines(run, rec_step)
            stats, ok = trainer.update(run, rec_step)
            rec = rec_step.metrics(run, stats, ok)
            rec["extra_s"] = extra_s
            run.metrics.step(rec)
            run.step = step
            meta["metrics"].append(rec)
            meta["seconds"]["total"] = round(time.time() - t_start, 1)
            meta["machine"] = with_load_after(meta["machine"])
            save()
            print(f"step {step}: reward {rec['reward_mean']:.3f}, gen {gen_s:.0f} s, extra {extra_s:.0f} s, "
                  f"train {rec['training_s']:.0f} s", flush=True)
    finally:
        run.metrics.close()
        run.scorer.close()
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
