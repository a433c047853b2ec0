"""Per-prompt sampling streams: a prompt's completions depend on (seed, stream, prompt index) only, never on the
batch it was generated in, the chunking of generate() calls or the number of data-parallel ranks.

    seeds = [stream_seed(seed, f"rollout/{step}", i) for i in global_prompt_indices]
    params = SamplingParams(..., seeds=seeds)          # the engines sample each prompt from its own stream

The HF engine samples with `SeededSampler`, a logits processor that applies temperature, top-k and top-p as
transformers' own warpers do, then draws the token by the Gumbel-max trick with one torch.Generator per sequence
(seeded from the prompt's seed and the sample's index). It returns a one-hot score row, so generate()'s own
multinomial draw can only pick that token. The result is an exact sample from the same distribution the loss
assumes (logits / T, top-k, top-p), taken from a stream that belongs to the sequence. The vLLM engine passes the seed
per request instead.
"""
from __future__ import annotations

import hashlib

import torch

SEED_BITS = 63


def stream_seed(seed: int, stream: str, index: int) -> int:
    """A 63-bit seed for item `index` of `stream` under the run's `seed` (blake2b of the three)."""
    digest = hashlib.blake2b(f"{int(seed)}/{stream}/{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << SEED_BITS) - 1)


def row_seeds(prompt_seeds: list[int], n: int) -> list[int]:
    """One seed per generated sequence, prompt-major (n samples per prompt), as generate() lays out its rows."""
    return [stream_seed(s, "sample", j) for s in prompt_seeds for j in range(n)]


def logit_warpers(temperature: float, top_p: float, top_k: int) -> list:
    """transformers' warpers for the sampling settings, in generate()'s order: temperature, top-k, top-p (each only
    when it changes something)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p))
    return out


class SeededSampler:
    """A transformers logits processor that samples each row from its own torch.Generator (Gumbel-max).

    Called with [rows, vocab] scores at every decoding step; row r draws its k-th uniform vector on the k-th step,
    whatever the other rows do. Returns scores that are 0 at the sampled token and -inf elsewhere.
    """

    def __init__(self, seeds: list[int], temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0):
        self.seeds = list(seeds)
        self.warpers = logit_warpers(temperature, top_p, top_k)
        self.generators: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows, vocab = scores.shape
        if rows != len(self.seeds):
            raise RuntimeError(f"SeededSampler: {rows} sequences but {len(self.seeds)} seeds")
        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        warped = scores.float()
        for w in self.warpers:
            warped = w(input_ids, warped)
        u = torch.stack([torch.rand(vocab, generator=g, device=scores.device) for g in self.generators])
        gumbel = -torch.log(-torch.log(u))  # u = 0 gives -inf: that token cannot win
        choice = (warped + gumbel).argmax(dim=-1, keepdim=True)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, choice, 0.0)


def seeded_logits_processor(prompt_seeds: list[int], n: int, temperature: float, top_p: float, top_k: int):
    """The `logits_processor` argument of generate() for per-prompt streams (n samples per prompt)."""
    from transformers import LogitsProcessorList

    return LogitsProcessorList([SeededSampler(row_seeds(prompt_seeds, n), temperature, top_p, top_k)])
