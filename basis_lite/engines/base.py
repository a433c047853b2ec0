"""The protocol every rollout engine satisfies (`Engine`), and what it returns (`Rollout`).

    engine.sync(model)                                   push the current adapter (a no-op where the engine IS the model)
    engine.generate(prompts, params) -> list[Rollout]    n samples per prompt, prompt-major order
    engine.trajectory_seconds                            time spent on trajectory features, summed over generate()

A Rollout carries token ids, the engine's log-prob of every completion token under the policy being trained (at the
sampling temperature: the behaviour log-probs the update compares with its own), and, where the engine can give it
for free, a prompt feature vector for BASIS similarity pooling. With EAPO experience injection (HF engine,
`params.inject`), some tokens were sampled from a prior adapter instead: their positions and the prior's log-probs
are recorded too.
With ``with_trajectory=True`` it also carries a trajectory feature (engines/trajectory.py: a middle-layer state
of the completion and token-entropy statistics) for value probes such as POISE; engines compute it only when
asked.
Implementations: `engines.hf.HFEngine` (the training model's generate) and `engines.vllm` (Unsloth's in-process
vLLM, or plain vLLM with the adapter sent as a LoRARequest).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    n: int = 1  # samples per prompt
    inject: bool = False  # EAPO: let the engine sample critical tokens from the prior adapter (training rollouts only)
    seeds: list[int] | None = None  # one per prompt: sample it from its own stream (engines/seeded.py); None: global RNG


@dataclass
class Rollout:
    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int]  # includes the stop token when the model stopped by itself
    text: str  # decoded completion without special tokens
    finished: bool  # stopped at EOS (False: cut at max_new_tokens)
    feature: torch.Tensor | None = field(default=None, repr=False)  # [D] prompt feature (BASIS similarity)
    # log pi(token) of each completion token under the engine's copy of the policy being trained, at the sampling
    # temperature (1 when greedy), before top-k/top-p on the HF engine; NaN where the engine gave none; None when
    # the engine returned no log-probs at all
    logprobs: list[float] | None = field(default=None, repr=False)
    trajectory: torch.Tensor | None = field(default=None, repr=False)  # [H + N_STATS] (engines/trajectory.py)
    injected: list[int] = field(default_factory=list)  # EAPO: completion positions whose token the prior sampled
    prior_logprobs: list[float] = field(default_factory=list)  # EAPO: the prior's log-prob there (aligned to injected)
    # False when the model's logits or prompt features held NaN or inf while this rollout was generated (an adapter
    # blown up by an update): its tokens were then sampled from zeros in place of those logits, and mean nothing
    finite: bool = True

    def behaviour_logprobs(self) -> list[float] | None:
        """The log-prob of each token under the distribution it was actually sampled from: the policy's, and the
        prior's at injected positions."""
        if self.logprobs is None:
            return None
        out = list(self.logprobs)
        for pos, lp in zip(self.injected, self.prior_logprobs):
            out[pos] = lp
        return out


@runtime_checkable
class Engine(Protocol):
    name: str
    trajectory_seconds: float  # time spent on trajectory features, summed over generate() calls; the trainer zeroes
    # it before a step's rollouts to read that step's share

    def sync(self, model=None) -> None:
        """Make the next generate() use the model's current adapter weights."""

    def generate(self, prompts: list[str], params: SamplingParams, with_features: bool = True,
                 with_trajectory: bool = False) -> list[Rollout]:
        """params.n completions per prompt, prompt-major; Rollout.feature set when with_features and available,
        Rollout.trajectory when with_trajectory (callers pass it only when they need it)."""


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows] True where a row of logits [rows, V] holds NaN or +inf, or nothing finite: what a diverged model
    gives (a token masked to -inf by a logits processor is not counted)."""
    return torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | ~torch.isfinite(logits).any(-1)


def params_from_config(gen_cfg, n: int = 1, greedy: bool = False, max_new_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0 if greedy else gen_cfg.temperature, top_p=gen_cfg.top_p,
                          top_k=gen_cfg.top_k, max_new_tokens=max_new_tokens or gen_cfg.max_new_tokens, n=n)


def stop_token_ids(tok, model=None) -> set[int]:
    """Token ids that end a completion: the tokenizer's eos plus the generation config's eos_token_id(s).

    Every engine stops on the same set, so HF and vLLM rollouts end at the same token.
    """
    ids: set[int] = set()
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    gen_cfg = getattr(model, "generation_config", None) if model is not None else None
    eos = getattr(gen_cfg, "eos_token_id", None)
    for e in (eos if isinstance(eos, (list, tuple)) else [eos]):
        if e is not None:
            ids.add(int(e))
    return ids
