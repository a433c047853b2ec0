"""The arms of a learning comparison, one table: what each arm trains at the preset's B rollouts per step (B =
train.batch_size), read by bench/compare.py (the comparison harness) and bench/learning.py (its earlier runs).

An arm is an estimator, its rollouts per prompt G and how many prompts it draws per step: B/G (the same rollouts
per step as every other arm, "equal rollouts") or, for the wide arms, B (G times the rollouts per step), plus any
further settings (normalization, options, reference samples). External arms train with another library on the same
model, data, reward and schedule (bench/vs_trl.py's worker). `check_estimators` says which arms the installed
basis_lite cannot run (an estimator it does not register).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from basis_lite.config import ConfigError

GROUP = 8  # the GRPO arms' rollouts per prompt
ASTAR_K = 8  # A*-PO's reference samples per training prompt (its paper's and TRL's A2PO's default)


@dataclass(frozen=True)
class Arm:
    name: str
    estimator: str  # estimator.name; for an external arm, what it runs in words
    description: str
    group: int = 1  # rollouts per prompt
    wide: bool = False  # B prompts x group rollouts (group x the rollouts per step) instead of B/group prompts
    settings: tuple[str, ...] = ()  # more overrides, applied after the estimator's
    prior_samples: int | None = 0  # estimator.prior_samples; None = the caller's K (learning.py --prior-samples)
    # "trl": TRL's GRPOTrainer with `group` generations per prompt; "trl_a2po": TRL's A2POTrainer with
    # `prior_samples` reference samples per prompt (bench/vs_trl.py's workers)
    external: str = ""
    # trl_a2po only: the model's logits divided by generation.temperature and TRL run at temperature 1, so its loss
    # scores the policy it samples from (TRL's A2POTrainer samples at its temperature, scores raw logits)
    tempered: bool = False
    color: str | None = None


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("basis", "basis", "BASIS as shipped (advantages / batch std), 1 rollout/prompt, no prior", color="tab:blue"),
    Arm("basis_raw", "basis", "BASIS with its advantages not divided by the batch std (estimator.normalize=never)",
        settings=("estimator.normalize=never",), color="darkgoldenrod"),
    Arm("basis_prior", "basis", "BASIS, 1 rollout/prompt, offline prior (cold, counted in the clock)",
        prior_samples=None, color="tab:green"),
    Arm("basis_probe", "basis_probe", "BASIS with the online prompt probe as its prior, 1 rollout/prompt",
        color="tab:cyan"),
    Arm("basis_mix", "basis", "BASIS mix (LOO mean, pooling, probe prior, value tracker; weights from earlier "
        "batches)", settings=("estimator.options={mix: true}",), color="navy"),
    Arm("basis_value", "basis", "BASIS, prompts selected by tracked value (data.value_sampling=1)",
        settings=("data.value_sampling=1.0",), color="teal"),
    Arm("reinforce_pp", "reinforce_pp", "REINFORCE++, 1 rollout/prompt", color="tab:orange"),
    Arm("grpo8", "grpo", f"GRPO, {GROUP} rollouts/prompt", group=GROUP, color="tab:red"),
    Arm("grpo8_wide", "grpo", f"GRPO, {GROUP} rollouts/prompt, all the prompts ({GROUP}x the rollouts per step)",
        group=GROUP, wide=True, color="darkred"),
    Arm("rloo2", "rloo", "RLOO, 2 rollouts/prompt, half the prompts", group=2, color="tab:gray"),
    Arm("rloo2_norm", "rloo", "RLOO, 2 rollouts/prompt, advantages / batch std (estimator.normalize=always)",
        group=2, settings=("estimator.normalize=always",), color="dimgray"),
    Arm("poise", "poise", "POISE, 2 rollouts/prompt, half the prompts", group=2, color="tab:purple"),
    Arm("poise_wide", "poise", "POISE, 2 rollouts/prompt, all the prompts (2x the rollouts per step)", group=2,
        wide=True, color="tab:pink"),
    Arm("spo", "spo", "SPO: per-prompt value tracker alone, with its prompt prioritization, 1 rollout/prompt",
        color="tab:olive"),
    Arm("astar", "astar", f"A*-PO: offline V* from {ASTAR_K} reference samples per prompt (counted in its cost), "
        "its least-squares loss, 1 rollout/prompt", prior_samples=ASTAR_K, color="tab:brown"),
    Arm("trl8", "TRL GRPOTrainer", f"TRL GRPOTrainer, {GROUP} generations/prompt (same model, data, reward, "
        "schedule)", group=GROUP, external="trl", color="black"),
    Arm("trl_a2po", "TRL A2POTrainer", f"TRL's A*-PO trainer (trl.experimental.a2po): V* from {ASTAR_K} reference "
        "samples per prompt (counted in its cost), its least-squares loss, 1 completion/prompt (same model, data, "
        "reward, schedule)", prior_samples=ASTAR_K, external="trl_a2po", color="sienna"),
    Arm("trl_a2po_tempered", "TRL A2POTrainer, tempered logits", "TRL's A2POTrainer as trl_a2po, its model's "
        "logits divided by the sampling temperature and TRL at temperature 1: the same sampling, its loss scoring "
        "the tempered policy it samples from", prior_samples=ASTAR_K, external="trl_a2po", tempered=True,
        color="peru"),
    # EAPO (bench/learning.py only: hard_eapo reads eapo_prior's adapter)
    Arm("eapo_prior", "basis", "BASIS on the preset's levels: the EAPO prior adapter", color="tab:olive"),
    Arm("hard", "basis", "BASIS on the hard levels, no injection", color="tab:brown"),
    Arm("hard_eapo", "basis", "BASIS on the hard levels, EAPO injection from the prior adapter", color="tab:cyan"),
)}
EAPO_ARMS = ("eapo_prior", "hard", "hard_eapo")


def prompts_per_step(arm: Arm, batch_size: int) -> int:
    """The arm's prompts per step at B = `batch_size` rollouts per step; ConfigError when B/G is not whole."""
    if arm.wide or arm.group == 1:
        return batch_size
    if batch_size % arm.group:
        raise ConfigError(f"arm {arm.name}: train.batch_size={batch_size} is not a multiple of {arm.group}; every "
                          f"arm spends the same rollouts per step, so {arm.name} needs B/{arm.group} prompts x "
                          f"{arm.group}; pass --set train.batch_size=<a multiple of {arm.group}>")
    return batch_size // arm.group


def arm_overrides(name: str, batch_size: int, prior_samples: int = 4, hard_levels: list[int] | None = None,
                  eapo_prior: str = "") -> list[str]:
    """The estimator settings of arm `name` at B = `batch_size` (applied after any --set: they win). `prior_samples`
    is basis_prior's K, `hard_levels` and `eapo_prior` the EAPO arms' levels and prior adapter."""
    arm = ARMS.get(name)
    if arm is None:
        raise ConfigError(f"--arms: unknown arm {name!r}; choose from {', '.join(ARMS)}")
    k = prior_samples if arm.prior_samples is None else arm.prior_samples
    if arm.external:  # the other library reads B rollouts per step from train.batch_size and groups them itself
        prompts_per_step(arm, batch_size)
        return list(arm.settings)
    out = [f"estimator.name={arm.estimator}", f"estimator.rollouts_per_prompt={arm.group}",
           f"estimator.prior_samples={k}", f"train.batch_size={prompts_per_step(arm, batch_size)}"]
    if name in ("hard", "hard_eapo"):
        out.append(f"data.levels={hard_levels}")
    if name == "hard_eapo":
        out.append(f"eapo.prior_adapter={eapo_prior}")
    return out + list(arm.settings)


def check_estimators(names, known) -> None:
    """ConfigError naming every arm of `names` whose estimator is not among `known` (the installed basis_lite's
    registered estimators), with what is registered."""
    missing = [n for n in names if not ARMS[n].external and ARMS[n].estimator not in known]
    if missing:
        raise ConfigError(
            "the installed basis_lite does not register the estimator of arm(s) "
            + ", ".join(f"{n} (estimator.name={ARMS[n].estimator})" for n in missing)
            + f"; it registers {', '.join(known)}. Install a basis_lite that has them, or leave these arms out")


def use_cold_cache(cfg, folder) -> None:
    """Give a run its own cache folder (cfg.model.cache_dir), so the reference samples it draws before training are
    always computed (their cost counted) and never read from an earlier run's cache; the built-in model already
    converted into the shared cache is linked in, not converted again."""
    from basis_lite.model.loading import resolve_model_path

    pc = Path(folder)
    pc.mkdir(parents=True, exist_ok=True)
    if cfg.model.name.startswith("builtin:"):
        src = Path(resolve_model_path(cfg.model.name, cfg.model.cache_dir)).resolve()  # converts once, shared
        link = pc / src.name
        if not link.exists():
            if link.is_symlink():
                link.unlink()
            link.symlink_to(src, target_is_directory=True)
    cfg.model.cache_dir = str(pc)
