"""`basis-lite eval`: greedy pass@1 (and sampled pass@1 / pass@K) of a run's adapter, or of its base model.

    basis-lite eval RUN_DIR_OR_ADAPTER [--dataset NAME_OR_FILE] [--samples K] [--limit N] [--base]
                    [--set key=value ...] [--out FILE]

The target is a run folder (its final `adapter/`, or the newest complete checkpoint when the run has not finished),
a checkpoint folder (`checkpoints/step-N`), or an adapter folder (with `basis_lite_config.yaml` inside, or a
`config.yaml` next to it). The run's own config decides the model, the held-out split and the generation length;
`--dataset` and `--set` change it for this evaluation only.

`--base` evaluates the same loaded model with the adapter disabled (`model.disable_adapter()`), so a before/after
comparison runs on exactly the same weights, prompts and settings. Results go to RUN_DIR/eval.json
(RUN_DIR/eval_base.json with --base) unless `--out` says otherwise.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from .config import Config, ConfigError, load_config, load_config_file, to_dict

log = logging.getLogger("basis_lite")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_RUN_CONFIG = "basis_lite_config.yaml"


# ----------------------------------------------------------------------------------------------------------------
# finding the adapter and its config (shared with `basis-lite export`)


@dataclass
class Target:
    """What a run/adapter path on the command line points at."""

    path: Path  # as given
    run_dir: Path  # where results go by default (the run folder, or the adapter folder when there is none)
    adapter: Path | None  # peft adapter folder (None: a run folder without any saved adapter yet)
    config_path: Path  # the resolved basis-lite config of the run


def _is_adapter_dir(p: Path) -> bool:
    return (p / ADAPTER_CONFIG).is_file()


def resolve_target(path: str | Path) -> Target:
    """Resolve a run folder, checkpoint folder or adapter folder; ConfigError when it is none of them."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{p}: no such run folder or adapter folder")
    if not p.is_dir():
        raise ConfigError(f"{p}: expected a run folder (with config.yaml) or an adapter folder (with "
                          f"{ADAPTER_CONFIG}), got a file")
    if _is_adapter_dir(p):
        for cand in (p / ADAPTER_RUN_CONFIG, p.parent / "config.yaml"):
            if cand.is_file():
                run_dir = p.parent if (p.parent / "config.yaml").is_file() else p
                return Target(p, run_dir, p, cand)
        raise ConfigError(f"{p}: an adapter folder without {ADAPTER_RUN_CONFIG} inside or config.yaml next to it; "
                          f"basis-lite needs the run's config to know the base model and the data")
    if (p / "config.yaml").is_file():
        adapter = p / "adapter"
        if not _is_adapter_dir(adapter):
            from .checkpoint import latest_checkpoint

            last = latest_checkpoint(p)
            if last is not None and _is_adapter_dir(last / "adapter"):
                adapter = last / "adapter"
                log.info("%s has no final adapter/ (unfinished run); using the newest checkpoint %s", p, last.name)
            else:
                adapter = None
        return Target(p, p, adapter, p / "config.yaml")
    raise ConfigError(f"{p}: not a basis-lite run folder (no config.yaml) nor an adapter folder (no {ADAPTER_CONFIG})")


def load_run_config(target: Target, overrides: list[str] | None = None, dataset: str | None = None) -> Config:
    """The run's config with `--dataset` and `--set key=value` applied, validated."""
    cfg = load_config_file(target.config_path)
    if dataset is not None or overrides:
        d = to_dict(cfg)
        if dataset is not None:
            d["data"]["dataset"] = str(dataset)
        cfg = load_config(data=d, overrides=overrides or [])
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# the command


def run_eval_command(args) -> int:
    import torch

    from .data import load_examples
    from .evaluate import evaluate
    from .models import load_policy, resolve_device, resolve_dtype
    from .trainer import make_engine, seed_everything

    target = resolve_target(args.target)
    if args.samples < 0:
        raise ConfigError(f"--samples: expected K >= 0, got {args.samples}")
    if args.limit < 0:
        raise ConfigError(f"--limit: expected N >= 0, got {args.limit}")
    # the run's rollout engine setting is for training; eval generates with the loaded model itself unless a
    # --set says otherwise (the base comparison needs it: disable_adapter() only acts on this model)
    overrides = ["generation.engine=hf", "model.gradient_checkpointing=false", *(args.overrides or [])]
    cfg = load_run_config(target, overrides, args.dataset)
    if args.base and cfg.generation.engine != "hf":
        raise ConfigError("--base needs generation.engine=hf (the adapter is disabled on the loaded model, which "
                          "a separate vLLM engine would not see)")
    if target.adapter is None and not args.base:
        raise ConfigError(f"{target.path}: the run has no adapter yet (no adapter/ and no complete checkpoint); "
                          f"pass --base to evaluate the base model")
    out_path = Path(args.out) if args.out else target.run_dir / ("eval_base.json" if args.base else "eval.json")

    examples = load_examples(cfg.data, "eval")  # a bad dataset fails before the model loads
    if args.limit:
        examples = examples[:args.limit]
    if not examples:
        raise ConfigError(f"data: the eval split of {cfg.data.dataset!r} is empty (data.eval_size="
                          f"{cfg.data.eval_size}); nothing to evaluate")

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    t0 = time.time()
    model, tok = load_policy(cfg, device, dtype, adapter_path=str(target.adapter) if target.adapter else None)
    engine = make_engine(cfg, model, tok)
    seed_everything(cfg.train.seed)
    temperature = cfg.generation.temperature if cfg.generation.temperature > 0 else 1.0
    ctx = model.disable_adapter() if args.base else contextlib.nullcontext()
    what = "base model (adapter disabled)" if args.base else f"adapter {target.adapter}"
    with ctx:
        res = evaluate(engine, tok, examples, cfg.data, max_new_tokens=cfg.train.eval_max_new_tokens,
                       require_boxed=cfg.reward.require_boxed, samples=args.samples, temperature=temperature,
                       top_p=cfg.generation.top_p, batch_size=cfg.train.eval_batch_size,
                       progress=True, desc="eval (base)" if args.base else "eval")
    result = {
        **res,
        "target": str(target.path),
        "adapter": None if args.base or target.adapter is None else str(target.adapter),
        "base": bool(args.base),
        "model": cfg.model.name,
        "dataset": cfg.data.dataset,
        "split": "eval",
        "limit": args.limit,
        "samples": args.samples,
        "sample_temperature": temperature if args.samples else None,
        "max_new_tokens": cfg.train.eval_max_new_tokens,
        "seconds": round(time.time() - t0, 2),
    }
    print(format_table(result, what))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=float) + "\n")
    tmp.replace(out_path)
    print(f"results written to {out_path}")
    del model, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 0


def _fmt(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3f}"


def format_table(res: dict, what: str) -> str:
    """Overall and per-level rows: greedy pass@1, sampled pass@1 and pass@K (overall only), n."""
    k = res.get("k")
    head = f"{'':<10} {'greedy pass@1':>14}"
    if k:
        head += f" {'sampled pass@1':>15} {f'pass@{k}':>9}"
    head += f" {'n':>6}"
    lines = [f"eval of {what} on {res['dataset']} ({res['split']} split, greedy, "
             f"{res['max_new_tokens']} new tokens)", head]
    row = f"{'overall':<10} {_fmt(res['accuracy']):>14}"
    if k:
        row += f" {_fmt(res.get('pass@1_sampled')):>15} {_fmt(res.get(f'pass@{k}')):>9}"
    lines.append(row + f" {res['n']:>6}")
    for lvl, v in (res.get("by_level") or {}).items():
        row = f"{'level ' + str(lvl):<10} {_fmt(v['accuracy']):>14}"
        if k:
            row += f" {_fmt(v.get('pass@1_sampled')):>15} {_fmt(v.get(f'pass@{k}')):>9}"
        lines.append(row + f" {v['n']:>6}")
    return "\n".join(lines)
