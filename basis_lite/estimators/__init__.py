"""Advantage estimators, registered by name behind one interface. Imports no torch.

Every estimator is a function with one signature,

    fn(rewards: Tensor [B, G], ctx: EstimatorContext) -> (advantages [B, G], baselines [B, G])

(B prompts x G rollouts each), registered with an ``EstimatorSpec`` that says how many rollouts per prompt it needs,
which side information it can use (prompt features, an offline prior, the per-prompt history) and which options it
takes. The trainer looks the spec up by ``estimator.name`` and calls ``spec.compute(rewards, ctx)``; it never
branches on the name. The specs are this torch-free table (config validation reads it); each function sits in a
torch module (simple.py, basis_mix.py, poise.py) under ``@estimator("name")`` (base.py), which binds it to its
spec. Those modules are imported on the first ``compute`` (``EstimatorSpec.function``).

Registered here:

- ``basis`` (G >= 1, made for G = 1): BASIS, each prompt's baseline from the OTHER prompts of the batch, optionally
  helped by an offline prior and the similarity of the prompts' hidden states; b_i never uses r_i (the baseline in
  basis.py, registered in basis_mix.py). With
  ``mix: true`` it mixes the leave-one-out mean, that pooling, an online prompt probe as prior and a per-prompt
  value tracker as prior, weighted by their errors on earlier batches (basis_mix.py).
- ``reinforce_pp`` (G >= 1): whitening over the whole batch; its baseline, the batch mean, includes r_i.
- ``grpo`` (G >= 2): (r - group mean) / group std; the group mean includes r_i.
- ``dr_grpo`` (G >= 2): r - group mean; the group mean includes r_i.
- ``rloo`` (G >= 2): r - mean of the other G - 1 rollouts of the prompt; b_i never uses r_i.
- ``basis_probe`` (G >= 1): BASIS whose prior is an online probe on the prompts' hidden states, refit on earlier
  steps' rewards (replay buffer); b_i never uses r_i (poise.py).
- ``poise`` (G >= 2): each rollout's baseline is an online probe's prediction from its sibling rollouts' internal
  states (trajectory features), refit on earlier steps; b_ig never uses r_ig or rollout g's features (poise.py).
- ``astar`` (G >= 1): A*-PO, the baseline V*(x) = beta log mean_k exp(r_k / beta) over the K reference samples of
  the prompt (drawn before training), trained with its own least-squares loss (``train.loss: astar``; astar.py).
- ``spo`` (G >= 1): SPO, the baseline is the prompt's tracked success rate (a Beta tracker whose old evidence decays
  with the policy's drift since the prompt's last visit), advantages whitened over the batch, prompts sampled by
  their uncertainty (spo.py).

``explained_variance`` lives in ``basis_lite.estimators.base`` (torch); ``basis_lite.estimators.explained_variance``
imports it on first access.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError, brief
from . import basis_options, probe_options, reference_options

__all__ = ["EstimatorContext", "EstimatorSpec", "register", "unregister", "get_estimator", "estimator_names"]


@dataclass
class EstimatorContext:
    """What an estimator may use besides the rewards; typed loosely so that this module needs no torch.

    prompt_ids: the ids of the B prompts (row order of the rewards).
    prior: [B] prior success probabilities (the offline prior, with the run's history folded in by
        ``rl.priors.prior_values``), or None.
    features: [B, D] prompt features (the policy's hidden state of each prompt), or None.
    history: {prompt id: [successes, trials]} from earlier steps, read-only; never holds the current rewards.
    trajectory_features: [B, G, D'] per-rollout trajectory features (engines/trajectory.py), or None.
    replay: a ``probe.ReplayBuffer`` of earlier steps' rollouts (never the current batch), read-only, or None.
    options: the estimator's options, checked by ``EstimatorSpec.validate_options``.
    state: the estimator's own state across steps (``EstimatorSpec.state``), or None.
    normalize: divide the advantages by their batch std (+eps) after the estimator ran (see ``EstimatorSpec``).
    """

    prompt_ids: list
    prior: Any = None
    features: Any = None
    history: dict | None = None
    trajectory_features: Any = None
    replay: Any = None
    options: dict = field(default_factory=dict)
    normalize: bool = False
    state: Any = None


@dataclass(frozen=True)
class EstimatorSpec:
    """One registered estimator: its name, what it needs and uses, and where its function is.

    fn: the function, or None: the one bound to ``name`` by ``@estimator`` in the package's torch modules.
    check_options: options -> options, raising ConfigError that names ``estimator.options.<key>`` (torch-free);
        None means the estimator takes no options.
    whitened: the advantages come out already divided by the batch std, so ``ctx.normalize`` leaves them as they are.
    normalize_auto: ``estimator.normalize: auto`` divides this estimator's advantages by their batch std
        (``normalizes``).
    uses_trajectory: the engine must capture trajectory features (``ctx.trajectory_features``); engines compute them
        only for such estimators.
    replay_capacity: options -> rollouts the trainer keeps in a replay buffer of earlier steps (``ctx.replay``,
        saved in checkpoints); None (or a function returning None) means the estimator keeps no buffer. Torch-free.
    state: options -> an object the trainer keeps across steps (or None), passed as
        ``ctx.state``: after the baselines the trainer calls its ``observe(step, prompt_ids, rewards)``, saves its
        ``state_dict()`` in checkpoints and restores it with ``load_state_dict``; ``metrics()``, if it has one,
        adds fields to the step's metrics line; ``accept``, if not None, is the prompt sampler's
        (``PromptSampler.accept``); ``set_reference(table)``, if it has one, receives the reference samples (below);
        ``tracks_drift`` True makes the trainer measure the policy's drift on the responses it keeps (see spo.py).
        None: the estimator keeps no state.
    uses_reference: the estimator reads the K reference samples per training prompt (``estimator.prior_samples``,
        the prior table of rl/priors.py, cached): the trainer loads them and hands the table to the state's
        ``set_reference``; ``min_reference`` is the K it needs at least (0: it runs without).
    loss: the policy loss that ``train.loss: auto`` picks for this estimator ('' = ppo_clip).
    picks_prompts: options -> whether the state's ``accept`` chooses the training prompts (then
        ``data.value_sampling``, which chooses them too, is refused); None = never. Torch-free.
    """

    name: str
    min_rollouts: int
    uses_features: bool = False
    uses_prior: bool = False
    uses_history: bool = False
    description: str = ""
    fn: Callable | None = None
    check_options: Callable[[dict], dict] | None = None
    whitened: bool = False
    normalize_auto: bool = False
    uses_trajectory: bool = False
    replay_capacity: Callable[[dict], int | None] | None = None
    state: Callable[[dict], Any] | None = None
    uses_reference: bool = False
    min_reference: int = 0
    loss: str = ""
    picks_prompts: Callable[[dict], bool] | None = None

    def normalizes(self, setting: str | bool) -> bool:
        """``estimator.normalize`` resolved for this estimator: always, never, or auto (``normalize_auto``);
        a bool is taken as always / never."""
        if setting == "auto":
            return self.normalize_auto
        return setting in (True, "always")

    def make_state(self, options: dict) -> Any:
        """The estimator's state for a run with these options (None: it keeps none)."""
        return self.state(options) if self.state is not None else None
    def validate_options(self, options: dict | None) -> dict:
        """The options checked (a copy); ConfigError naming the bad key and what is accepted."""
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise ConfigError(f"estimator.options: expected a mapping, got {brief(options)}")
        if self.check_options is None:
            if options:
                takes = [n for n, spec in _REGISTRY.items() if spec.check_options is not None]
                raise ConfigError(f"estimator.options: {self.name} takes no options; got "
                                  f"{sorted(str(k) for k in options)}. Remove estimator.options (estimators that "
                                  f"take options: {', '.join(takes) or 'none'})")
            return {}
        return self.check_options(options)

    def with_prior(self, est) -> bool:
        """Whether the baselines read a prior (``ctx.prior``), for the config section ``est``: the estimator takes
        one, the run has one (``prior_samples`` > 0: the offline table; ``history``: this run's earlier rewards),
        and the options leave it on (``use_prior``). Decided here only: config checks, trainer setup and baselines
        read it."""
        return bool(self.uses_prior and (est.prior_samples > 0 or est.history)
                    and (est.options or {}).get("use_prior", True))

    def function(self) -> Callable:
        """The estimator function: ``fn``, or the one ``@estimator(name)`` bound (its modules imported now)."""
        if self.fn is not None:
            return self.fn
        from . import astar, basis_mix, poise, simple, spo  # noqa: F401  (torch, only now: their @estimator lines bind the functions)
        from .base import bound_function

        fn = bound_function(self.name)
        if fn is None:
            raise ValueError(f"estimator {self.name!r} is registered but no function is bound to it; put "
                             f"@estimator({self.name!r}) above it and import its module first")
        return fn

    def compute(self, rewards, ctx: EstimatorContext) -> tuple:
        """(advantages [B, G], baselines [B, G]) for rewards [B, G] (B prompts x G rollouts).

        Checks the rewards' shape, ``ctx.prompt_ids`` and the options, runs the estimator, then, with
        ``ctx.normalize``, divides the advantages by their batch std (+eps) unless the estimator already whitens
        them; the baselines are returned unscaled. That std uses every reward: it rescales the batch, it does not
        shift any advantage.
        """
        from .base import normalize_advantages, rewards_2d  # torch, only now

        r = rewards_2d(rewards, f"estimator {self.name!r}")
        if ctx.prompt_ids is not None and len(ctx.prompt_ids) != r.shape[0]:
            raise ValueError(f"estimator {self.name!r}: {len(ctx.prompt_ids)} prompt ids for rewards of shape "
                             f"{tuple(r.shape)} (one id per row)")
        self.validate_options(ctx.options)
        adv, base = self.function()(r, ctx)
        if ctx.normalize and not self.whitened:
            adv = normalize_advantages(adv)
        return adv, base


_REGISTRY: dict[str, EstimatorSpec] = {}


def register(spec: EstimatorSpec) -> EstimatorSpec:
    """Add an estimator under ``spec.name``; a name can be registered once."""
    if not isinstance(spec, EstimatorSpec):
        raise TypeError(f"register() takes an EstimatorSpec, got {type(spec).__name__}")
    if not spec.name or spec.name in _REGISTRY:
        raise ValueError(f"estimator name {spec.name!r} is empty or already registered")
    if spec.fn is not None and not callable(spec.fn):
        raise ValueError(f"estimator {spec.name!r}: fn must be the function or None (bound by @estimator), got "
                         f"{spec.fn!r}")
    if not isinstance(spec.min_rollouts, int) or spec.min_rollouts < 1:
        raise ValueError(f"estimator {spec.name!r}: min_rollouts must be an integer >= 1, got {spec.min_rollouts!r}")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove an estimator (for tests that register a throwaway one); a function bound by ``@estimator`` stays
    bound: the decorator runs once, when its module is imported."""
    _REGISTRY.pop(name, None)


def get_estimator(name: str) -> EstimatorSpec:
    """The spec registered under ``name``; ConfigError naming the bad name and the registered ones."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigError(f"estimator.name: {name!r} is not a registered estimator; choose one of "
                          f"{', '.join(_REGISTRY)}") from None


def estimator_names() -> tuple:
    """The registered names, in registration order."""
    return tuple(_REGISTRY)


def __getattr__(name: str):
    if name == "explained_variance":
        from .base import explained_variance

        return explained_variance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _basis_state(options: dict):
    """BASIS's state across steps (the mix's weights, value tracker and probe; None without mix). Its module needs
    torch, so it is imported only when a run starts."""
    from .basis_mix import make_state

    return make_state(options)


def _astar_state(options: dict):
    """A*-PO's state (V* per prompt from the reference samples); its module needs torch: imported when a run starts."""
    from .astar import AStarState

    return AStarState(options)


def _spo_state(options: dict):
    """SPO's state (the per-prompt tracker); its module needs torch: imported when a run starts."""
    from .spo import SPOState

    return SPOState(options)


register(EstimatorSpec(
    "basis", min_rollouts=1, uses_features=True, uses_prior=True, uses_history=True,
    description="BASIS: each prompt's baseline from the other prompts of the batch (kernel-weighted by prompt "
                "similarity, shrunk toward a calibrated prior); b_i never uses r_i",
    check_options=basis_options.validate_options, replay_capacity=probe_options.mix_replay_capacity,
    state=_basis_state, normalize_auto=True))
register(EstimatorSpec(
    "reinforce_pp", min_rollouts=1,
    description="REINFORCE++: whitening over the whole batch; the baseline (batch mean) includes r_i", whitened=True))
register(EstimatorSpec(
    "grpo", min_rollouts=2,
    description="GRPO: (r - group mean) / group std; the group mean includes r_i"))
register(EstimatorSpec(
    "dr_grpo", min_rollouts=2,
    description="Dr. GRPO: r - group mean (no std division); the group mean includes r_i"))
register(EstimatorSpec(
    "rloo", min_rollouts=2,
    description="RLOO: r - mean of the other G - 1 rollouts of the prompt; b_i never uses r_i"))
register(EstimatorSpec(
    "basis_probe", min_rollouts=1, uses_features=True, uses_history=True,
    description="BASIS with an online prompt probe as its prior (ridge on the prompts' hidden states, refit on "
                "earlier steps); b_i never uses r_i", check_options=probe_options.validate_basis_probe,
    replay_capacity=probe_options.replay_capacity_probe))
register(EstimatorSpec(
    "poise", min_rollouts=2, uses_features=True, uses_trajectory=True,
    description="POISE: each rollout's baseline is an online probe's prediction from the OTHER rollouts of its "
                "prompt (their hidden states and token entropies), refit on earlier steps; b_i never uses r_i",
    check_options=probe_options.validate_poise,
    replay_capacity=probe_options.replay_capacity_poise))
register(EstimatorSpec(
    "astar", min_rollouts=1, uses_reference=True, min_reference=1, loss="astar",
    description="A*-PO: baseline V*(x) = beta log mean_k exp(r_k / beta) over K reference samples drawn before "
                "training (estimator.prior_samples); its own least-squares loss; b_i never uses r_i",
    check_options=reference_options.validate_astar, state=_astar_state,
    picks_prompts=reference_options.astar_picks_prompts))
register(EstimatorSpec(
    "spo", min_rollouts=1, uses_reference=True, whitened=True,
    description="SPO: baseline = the prompt's tracked success rate (Beta counts decayed by the policy's drift since "
                "its last visit), advantages whitened over the batch (whose mean includes r_i), prompts sampled by "
                "uncertainty", check_options=reference_options.validate_spo, state=_spo_state,
    picks_prompts=reference_options.spo_picks_prompts))
