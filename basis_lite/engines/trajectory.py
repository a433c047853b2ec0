"""Per-rollout trajectory features for value probes (POISE): what the policy's internal state says about a rollout.

A trajectory feature is one vector per rollout, ``[hidden (H) | stats (len(STATS))]``:

- hidden: the mean, over the last ``tokens`` completion tokens, of a middle decoder layer's hidden state at the
  positions that PRODUCED those tokens (the state whose logits sampled token c_j sits at the position of c_{j-1},
  or at the last prompt token for c_0). These states exist for every sampled token, including the stop token.
- stats (``STATS``, in this order): the mean and the max token entropy of the sampling distribution over the
  completion, the mean entropy and the mean log-probability of the sampled tokens over the answer span (the last
  run of tokens holding a digit: where the answer of a math problem is written; the last token when there is
  none), the mean log-probability of all sampled tokens, log(1 + length) and whether the rollout stopped by itself.

The entropies are those of softmax(logits / T), T the sampling temperature (1 for greedy), the distribution the
loss uses; top-k / top-p truncation is not applied.

Where they come from:

- HF engine: ``TrajectoryCapture`` during ``generate()`` itself: a forward hook on the middle layer keeps each
  decoding step's last-position state in a ring of ``tokens`` slots per row, and a logits processor (a no-op on the
  scores) computes each step's entropy and the log-probability of the token sampled at the step before. Rows that
  have stopped are not written. Nothing is installed unless trajectory features are asked for.
- Other engines (vLLM): ``completion_hidden_states`` runs one no-grad forward of prompt + completion through the
  decoder layers up to the feature layer only (the forward stops there), and ``stats_from_topk`` builds the stats
  from the engine's own top-k log-probabilities (renormalised over the top k at temperature T, so the entropies
  are those of the truncated distribution).
"""
from __future__ import annotations

import math

import torch

from ..estimators.trajectory_layout import N_STATS, STATS, split  # noqa: F401  (the layout, re-exported)
from ..model.loading import middle_layer_states


def answer_span(tokens: list[str]) -> tuple[int, int]:
    """[start, end) of the last run of tokens whose text holds a digit; (L - 1, L) when no token does (L >= 1)."""
    end = None
    for i in range(len(tokens) - 1, -1, -1):
        if any(ch.isdigit() for ch in tokens[i]):
            end = i + 1
            break
    if end is None:
        return max(0, len(tokens) - 1), len(tokens)
    start = end - 1
    while start > 0 and any(ch.isdigit() for ch in tokens[start - 1]):
        start -= 1
    return start, end


def stats_vector(entropy: torch.Tensor, logprob: torch.Tensor, span: tuple[int, int], finished: bool,
                 length: int | None = None) -> torch.Tensor:
    """The STATS of one completion from its per-token entropies and sampled-token log-probs [L] (L >= 0);
    ``length`` (default L) is the completion's token count."""
    n = int(entropy.numel())
    length = n if length is None else length
    if n == 0:
        return torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, math.log1p(length), float(finished)])
    a, b = span
    e, lp = entropy.double(), logprob.double()
    return torch.tensor([float(e.mean()), float(e.max()), float(e[a:b].mean()), float(lp[a:b].mean()),
                         float(lp.mean()), math.log1p(length), float(finished)])


class TrajectoryCapture:
    """Hook + logits processor that collect trajectory features during one HF ``generate()`` call.

    Pass ``capture`` as ``logits_processor=LogitsProcessorList([capture])`` and ``capture.attach(layer)`` before the
    call; ``capture.detach()`` afterwards; then ``capture.features(completions, finished, tok)`` gives one
    trajectory feature per row. Rows are those of generate()'s expanded batch (prompt-major, n per prompt).
    """

    def __init__(self, prompt_len: int, max_new_tokens: int, stop_ids, temperature: float, tokens: int = 4):
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.stop_ids = torch.tensor(sorted(int(s) for s in stop_ids), dtype=torch.long)
        self.temperature = temperature if temperature and temperature > 0 else 1.0
        self.tokens = tokens
        self._h = None  # the feature layer's last-position state of the forward that is being processed
        self.ring = None  # [tokens, N, H]
        self.count = None  # [N] states written per row
        self.done = None  # [N] bool: a stop token was sampled
        self.entropy: list[torch.Tensor] = []  # per step [N]
        self.logprob: list[torch.Tensor] = []  # per step [N], filled one step late
        self._prev_logp = None
        self._handle = None
        self.seconds = 0.0

    # -- the hook ------------------------------------------------------------------------------------------------
    def attach(self, layer) -> None:
        self._handle = layer.register_forward_hook(self._hook)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, _module, _inp, output):
        h = output[0] if isinstance(output, tuple) else output
        self._h = h[:, -1, :].detach()  # prefill: the last prompt position (left padding); decode: the new one

    # -- the logits processor ----------------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import time

        t0 = time.perf_counter()
        n = input_ids.shape[0]
        j = input_ids.shape[1] - self.prompt_len  # this call's scores sample completion token c_j
        dev = scores.device
        if self.ring is None:
            h = self._h
            self.ring = torch.zeros((self.tokens, n, h.shape[-1]), dtype=torch.float32, device=dev)
            self.count = torch.zeros(n, dtype=torch.long, device=dev)
            self.done = torch.zeros(n, dtype=torch.bool, device=dev)
            self.stop_ids = self.stop_ids.to(dev)
        if j >= 1:
            last = input_ids[:, -1]
            self.logprob.append(self._prev_logp.gather(1, last[:, None])[:, 0].float())
            self.done |= torch.isin(last, self.stop_ids)
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        ent = -(logp.exp() * logp).nansum(-1)  # a token with probability 0 adds nothing
        self.entropy.append(ent)  # stays on the device: no sync per step
        self._prev_logp = logp
        if j < self.max_new_tokens:  # masked writes, no host sync: stopped rows keep what they hold
            rows = torch.arange(n, device=dev)
            slot = self.count % self.tokens
            act = ~self.done
            self.ring[slot, rows] = torch.where(act[:, None], self._h.float(), self.ring[slot, rows])
            self.count += act.long()
        self.seconds += time.perf_counter() - t0
        return scores

    def finish(self, sequences: torch.Tensor) -> None:
        """The sampled-token log-prob of the last step (its token is only in generate()'s output)."""
        col = self.prompt_len + len(self.logprob)
        if self._prev_logp is not None and col < sequences.shape[1]:
            tok = sequences[:, col].to(self._prev_logp.device)
            self.logprob.append(self._prev_logp.gather(1, tok[:, None])[:, 0].float())
        self._prev_logp = None

    def features(self, completions: list[list[int]], finished: list[bool], tok) -> list[torch.Tensor]:
        """One trajectory feature [H + N_STATS] (float32, CPU) per row, from the completions as the engine cut them."""
        ent = torch.stack(self.entropy, 1).cpu() if self.entropy else torch.zeros(len(completions), 0)
        lp = torch.stack(self.logprob, 1).cpu() if self.logprob else torch.zeros(len(completions), 0)
        ring, count = self.ring.cpu(), self.count.cpu()
        out = []
        for row, (comp, fin) in enumerate(zip(completions, finished)):
            L = len(comp)
            k = int(min(int(count[row]), self.tokens))
            hidden = ring[:k, row].mean(0) if k else torch.zeros(ring.shape[-1])
            span = answer_span(tok.convert_ids_to_tokens(comp)) if L else (0, 0)
            stats = stats_vector(ent[row, :L], lp[row, :L], span, fin)
            out.append(torch.cat([hidden, stats.float()]))
        return out


def completion_hidden_states(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                             layer_index: int | None = None, tokens: int = 4, batch_size: int = 16) -> torch.Tensor:
    """[N, H] float32: the trajectory's hidden feature from one no-grad forward that stops after the feature layer.

    The same quantity ``TrajectoryCapture`` keeps during HF decoding: the mean of the layer's states at the positions
    that produced the last ``tokens`` completion tokens (positions P-1 .. P+L-2 for a prompt of P tokens and a
    completion of L tokens). Sequences are right-padded, so positions count from 0 as in generate().
    """
    seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    feats = []
    for s, h in middle_layer_states(model, seqs, pad_id, layer_index, batch_size):
        for i, (p, c) in enumerate(zip(prompt_ids[s:s + batch_size], completion_ids[s:s + batch_size])):
            P, L = len(p), len(c)
            if L == 0:
                feats.append(torch.zeros(h.shape[-1]))
                continue
            lo = max(P - 1, P + L - 1 - tokens)
            feats.append(h[i, lo:P + L - 1].mean(0).cpu())
    return torch.stack(feats) if feats else torch.zeros(0, 0)


def stats_from_topk(top_logprobs: list[dict], sampled: list[int], tokens: list[str], finished: bool,
                    temperature: float, length: int | None = None) -> torch.Tensor:
    """STATS of one completion from an engine's per-token top-k log-probs ({token id: log-prob or an object with
    ``.logprob``}: raw logits' log-softmax, or log-probs already at the sampling temperature with T = 1 passed)
    and the sampled token ids.

    At temperature T the top-k log-probs are rescaled to lp / T and renormalised over the top k; the entropy is
    that of this truncated distribution, and the sampled token's log-prob is taken from it (the sampled token is
    always among the entries an engine returns). Entries of -inf (tokens top-k/top-p removed) are left out.
    """
    t = temperature if temperature and temperature > 0 else 1.0
    ents, lps = [], []
    for d, tid in zip(top_logprobs, sampled):
        pairs = [(k, float(getattr(v, "logprob", v))) for k, v in d.items()]
        pairs = [(k, v) for k, v in pairs if math.isfinite(v)] or [(tid, 0.0)]
        ids = [k for k, _ in pairs]
        raw = torch.tensor([v for _, v in pairs], dtype=torch.float64) / t
        logp = torch.log_softmax(raw, 0)
        ents.append(float(-(logp.exp() * logp).sum()))
        lps.append(float(logp[ids.index(tid)]) if tid in ids else float("nan"))
    e, lp = torch.tensor(ents, dtype=torch.float64), torch.tensor(lps, dtype=torch.float64)
    return stats_vector(e, lp, answer_span(tokens) if tokens else (0, 0), finished, length).float()
