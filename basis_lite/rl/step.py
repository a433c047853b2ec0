"""One training step's record: built once per step, the same way for one process or N ranks, and read by the
baselines, the update, the metrics line and the checkpoint.

    step = Step.of_rank(...)        this rank's rollouts, rewards, features, timings
    step = step.gathered(ranks)     the global batch's per-prompt quantities (one all-gather; one process: the same
                                    code, the null `Ranks` returns its input)
    step.adv, step.base = ...       the estimator's output over the global batch (trainer.baselines)
    step.metrics(run, stats, ok)    the metrics.jsonl line, rank fields included under torchrun

What travels in the gather: one float64 vector per rank holding its rewards, correctness and format flags,
completion lengths, prompt features and trajectory features, after a head of [feature size, generation seconds,
reward-warning count, trajectory feature size, prompt tokens, rollouts with non-finite model outputs]. The rollouts
themselves (token ids, behaviour log-probs) stay on their rank: each rank trains on its own rows (`adv_mine`).

The step's cost in tokens (`costs`), independent of the machine and summed over the ranks: prompt tokens processed
by generation (each rollout's prompt), tokens generated, tokens trained (forward and backward, every pass) and
tokens through forward-only passes (reference log-probs, an estimator's drift measurement).
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from ..errors import TrainingAborted
from ..estimators.base import explained_variance
from ..model.loading import peak_memory_mb
from ..runs.metrics import loo_reference_ev
from .distributed import Ranks
from .update import OPTIONAL_STEP_METRICS

if TYPE_CHECKING:
    from .state import RunState

_HEAD = 7  # feature size, generation seconds, reward warnings, trajectory feature size, prompt tokens, non-finite,
# cut off at the budget
COSTS = ("prompt_tokens", "generated_tokens", "trained_tokens", "forward_only_tokens")  # per step, and cum_* in total


TIMES = ("generation_s", "training_s", "forward_s", "logprob_s", "backward_s", "optimizer_s")


def fresh_totals() -> dict:
    """A run's totals at its start: the step costs (COSTS), the reference samples' tokens (generated and prompt,
    drawn once before training) and the seconds of each part of the steps (TIMES)."""
    return {**{k: 0 for k in (*COSTS, "reference_tokens", "reference_prompt_tokens")}, **{k: 0.0 for k in TIMES}}


@dataclasses.dataclass
class Step:
    """The data of step `n`. Before `gathered`: this rank's share; after it: the global batch, in global order,
    except `mine` and `rollouts`, which stay this rank's."""

    n: int
    batch: list  # the global batch's examples (the same on every rank)
    mine: list  # this rank's share of `batch`
    rollouts: list  # this rank's rollouts, G per example of `mine`, with the engine's behaviour log-probs
    rewards: torch.Tensor  # [B, G] float32
    features: torch.Tensor | None  # [B, D] prompt features (the first rollout of each prompt), or None
    trajectory: torch.Tensor | None  # [B, G, D'] per-rollout trajectory features (engines/trajectory.py), or None
    correct: list  # B * G
    format: list  # B * G
    completion_lens: list  # B * G token counts
    reward_warnings: int  # summed over the ranks
    generation_s: float  # the slowest rank's
    started: float = 0.0  # time.time() when the step began
    wait_s: float = 0.0  # waiting for the slowest rank before the gather
    gather_s: float = 0.0  # the all-gather itself
    gather_bytes: int = 0  # what the all-gather delivers to each rank
    reward_metrics: dict = dataclasses.field(default_factory=dict)  # log_metric calls of this rank's reward functions
    # the rollout guard's measurements (rl/guard.py); None while its check is deferred into the update
    guard_metrics: dict | None = dataclasses.field(default_factory=dict)
    adv: torch.Tensor | None = None  # [B, G] advantages and baselines of the global batch (trainer.baselines)
    base: torch.Tensor | None = None
    training_s: float = 0.0
    prompt_tokens: int = 0  # prompt tokens of the rollouts (summed over the ranks once gathered)
    logprob_s: float = 0.0  # forward-only log-prob passes outside the update (an estimator's drift measurement)
    forward_only_tokens: int = 0  # their tokens, summed over the ranks
    nonfinite: int = 0  # rollouts whose logits or features were NaN or inf (a diverged adapter), over the ranks
    clipped: int = 0  # rollouts cut off at generation.max_new_tokens (they did not stop by themselves), over the ranks

    @classmethod
    def of_rank(cls, n: int, batch: list, mine: list, rollouts: list, rewards: torch.Tensor, scored, *,
                uses_features: bool, uses_trajectory: bool, generation_s: float, reward_warnings: int,
                started: float = 0.0) -> Step:
        """This rank's record: `rewards` [b, G] and `scored` (the scorer's breakdown) of its rollouts; prompt and
        trajectory features are read from the rollouts when the estimator uses them."""
        b, G = rewards.shape
        features = trajectory = None
        if uses_features and rollouts and rollouts[0].feature is not None:
            features = torch.stack([rollouts[i * G].feature for i in range(b)])
        if uses_trajectory and rollouts and rollouts[0].trajectory is not None:
            trajectory = torch.stack([r.trajectory.float().cpu() for r in rollouts]).view(b, G, -1)
        nonfinite = sum(not r.finite or any(t is not None and not bool(torch.isfinite(t).all())
                                            for t in (r.feature, r.trajectory)) for r in rollouts)
        return cls(n, batch, mine, rollouts, rewards, features, trajectory, [float(x) for x in scored.correct],
                   [float(x) for x in scored.format], [len(r.completion_ids) for r in rollouts], int(reward_warnings),
                   float(generation_s), started=started, reward_metrics=dict(getattr(scored, "metrics", {})),
                   prompt_tokens=sum(len(r.prompt_ids) for r in rollouts), nonfinite=nonfinite,
                   clipped=sum(not r.finished for r in rollouts))

    def gathered(self, ranks: Ranks) -> Step:
        """The step over the global batch: every rank's rewards, flags, lengths and features, in rank order (so
        every rank computes the same baselines), the slowest rank's generation time, the warnings summed."""
        b, G = self.rewards.shape
        d = 0 if self.features is None else self.features.shape[1]
        dt = 0 if self.trajectory is None else self.trajectory.shape[2]
        head = torch.tensor([float(d), self.generation_s, float(self.reward_warnings), float(dt),
                             float(self.prompt_tokens), float(self.nonfinite), float(self.clipped)],
                            dtype=torch.float64)
        parts = [head, self.rewards.reshape(-1).double().cpu(), torch.tensor(self.correct, dtype=torch.float64),
                 torch.tensor(self.format, dtype=torch.float64),
                 torch.tensor(self.completion_lens, dtype=torch.float64)]
        if self.features is not None:
            parts.append(self.features.reshape(-1).double().cpu())
        if self.trajectory is not None:
            parts.append(self.trajectory.reshape(-1).double())
        t0 = time.time()
        ranks.barrier()  # waits for the slowest rank, so gather_s below is the transfer alone
        t1 = time.time()
        rows = ranks.gather_rows(torch.cat(parts)[None, :])  # [world, L]
        t2 = time.time()
        heads = rows[:, :_HEAD]
        for col, what in ((0, "prompt feature"), (3, "trajectory feature")):
            if bool((heads[:, col] != heads[0, col]).any()):
                raise TrainingAborted(f"ranks disagree on the {what} size ({heads[:, col].tolist()}); every rank must "
                                      "run the same engine and model")
        n = b * G
        cols = [_HEAD + i * n for i in range(5)]
        features = trajectory = None
        if d:
            features = rows[:, cols[4]:cols[4] + b * d].reshape(-1, d).float()
        if dt:
            start = cols[4] + b * d
            trajectory = rows[:, start:start + n * dt].reshape(-1, G, dt).float()
        return dataclasses.replace(
            self, rewards=rows[:, cols[0]:cols[1]].reshape(-1, G).float(), features=features, trajectory=trajectory,
            correct=rows[:, cols[1]:cols[2]].reshape(-1).tolist(),
            format=rows[:, cols[2]:cols[3]].reshape(-1).tolist(),
            completion_lens=[int(x) for x in rows[:, cols[3]:cols[4]].reshape(-1).tolist()],
            reward_warnings=int(heads[:, 2].sum()), generation_s=float(heads[:, 1].max()), wait_s=t1 - t0,
            gather_s=t2 - t1, gather_bytes=rows.numel() * rows.element_size(), prompt_tokens=int(heads[:, 4].sum()),
            nonfinite=int(heads[:, 5].sum()), clipped=int(heads[:, 6].sum()))

    def adv_mine(self, ranks: Ranks) -> torch.Tensor:
        """This rank's rows of the advantages, flattened (the order of `rollouts`)."""
        return ranks.shard(self.adv).reshape(-1)

    def costs(self, stats: dict) -> dict:
        """The step's cost in tokens (COSTS), over the global batch; `stats` from the update (summed over ranks)."""
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": sum(self.completion_lens),
                "trained_tokens": int(round(stats.get("trained_tokens", 0.0))),
                "forward_only_tokens": int(round(stats.get("forward_only_tokens", 0.0))) + self.forward_only_tokens}

    def metrics(self, run: RunState, stats: dict, ok: bool) -> dict:
        """The metrics.jsonl line of the step, over the global batch; peak memory is read here, once per step (the
        largest rank's peak since its process started: the kernel's high-water mark is never reset); the step's
        token costs and the run's totals so far (`run.totals`, cum_*); the update's time split into the forward with
        the graph, forward-only log-prob passes, backward and optimizer (this rank's); under torchrun also the rank
        count and the gather and all-reduce timings."""
        ranks = run.ranks
        r_flat = self.rewards.view(-1)
        comp_tokens = sum(self.completion_lens)
        rec = {
            "step": self.n, "reward_mean": r_flat.mean().item(), "accuracy": sum(self.correct) / len(self.correct),
            "format_rate": sum(self.format) / len(self.format), "baseline_mean": self.base.mean().item(),
            "advantage_std": self.adv.std().item() if self.adv.numel() > 1 else 0.0,
            "explained_variance": explained_variance(self.rewards, self.base),
            "explained_variance_loo_ref": loo_reference_ev(r_flat.numel()), "kl": stats["kl"],
            "entropy": stats["entropy"], "completion_len": comp_tokens / len(self.completion_lens),
            "clipped_fraction": self.clipped / len(self.completion_lens),
            "loss": stats["loss"], "grad_norm": stats["grad_norm"], "clip_fraction": stats["clip_fraction"],
            "lr": run.optimizer.param_groups[0]["lr"], "generation_s": self.generation_s,
            "training_s": self.training_s, "forward_s": stats.get("forward_s", 0.0),
            "logprob_s": stats.get("logprob_s", 0.0) + self.logprob_s, "backward_s": stats.get("backward_s", 0.0),
            "optimizer_s": stats.get("optimizer_s", 0.0), **self.costs(stats),
            **{f"cum_{k}": run.totals[k] for k in (*COSTS, "reference_tokens")},
            "tokens_per_s": comp_tokens / max(1e-9, self.generation_s + self.training_s),
            "peak_memory_mb": ranks.max([peak_memory_mb(run.device)])[0],
            "reward_warnings": self.reward_warnings, "skipped": not ok, "nonfinite_rollouts": self.nonfinite,
            "trained_sequences": stats.get("trained_sequences"), "update_norm": stats["update_norm"],
            "zero_update": stats["update_norm"] == 0.0,
            **{k: stats[k] for k in OPTIONAL_STEP_METRICS if k in stats},
            **({"trajectory_feature_s": run.engine.trajectory_seconds} if run.uses_trajectory
               else {}),
            **({"replay_rows": run.replay.rows} if run.replay is not None else {}),
            **(run.est_state.metrics() if hasattr(run.est_state, "metrics") else {}),
            **({"value_sampling_skipped": run.sampler.skipped} if run.value_tracker is not None else {}),
            **{f"reward/{k}": v for k, v in self.reward_metrics.items()},  # this rank's (rank 0's under torchrun)
            **(self.guard_metrics or {}),
        }
        if ranks.active:
            rec.update({"ranks": ranks.world, "gather_wait_s": self.wait_s, "gather_s": self.gather_s,
                        "gather_bytes": self.gather_bytes, "allreduce_s": ranks.last_allreduce_s,
                        "allreduce_bytes": ranks.last_allreduce_bytes, "step_s": time.time() - self.started})
        return rec
