"""A saved run on disk: what a path points at, the run's config (for eval, export and resume), and its evaluation.

    target = resolve_target(path)              a run folder, a checkpoint folder (checkpoints/step-N) or an adapter
    cfg = load_run_config(target, overrides, dataset)
    cfg = resume_config(run_dir, overrides)    the fixed config of a run to continue (`basis-lite train --resume`)
    result = evaluate_run(path, dataset=None, samples=0, limit=0, base=False, overrides=(), out=None)

`resolve_target` takes a run folder (its final `adapter/`, or the newest complete checkpoint when the run has not
finished), a checkpoint folder, or an adapter folder (with `basis_lite_config.yaml` inside, or a `config.yaml` next
to it). The run's own config decides the model, the held-out split and the generation length; `dataset` and
`overrides` change it for one evaluation only.

`evaluate_run` gives greedy pass@1 (and with `samples` = K > 0 sampled pass@1 and pass@K), generating with the
loaded transformers model (generation.engine=hf, model.backend=hf unless `overrides` say otherwise). With
`base=True` it evaluates the same loaded model with the adapter disabled (`model.disable_adapter()`), so a
before/after comparison runs on exactly the same weights, prompts and settings. Results go to RUN_DIR/eval.json
(RUN_DIR/eval_base.json with `base`) unless `out` says otherwise, and one line per problem (prompt, completion,
extracted answer, gold, correct, level) to eval_samples.jsonl beside it (`samples_path_for`); `format_eval_table`
renders the aggregates, `format_misses` the problems missed. Nothing here
prints but the progress bar; importing this module does not import torch.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, load_config, load_config_file, to_dict
from ..engines import engine_choices, get_engine
from ..errors import ConfigError
from ..safeio import atomic_write_text, disk_full_error, is_disk_full

log = logging.getLogger("basis_lite")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_RUN_CONFIG = "basis_lite_config.yaml"
MAX_SAMPLES = 1024  # eval --samples


# ----------------------------------------------------------------------------------------------------------------
# finding the adapter and its config


@dataclass
class Target:
    """What a run/adapter path on the command line points at."""

    path: Path  # as given
    run_dir: Path  # where results go by default (the run folder, or the adapter folder when there is none)
    adapter: Path | None  # peft adapter folder (None: a run folder without any saved adapter yet)
    config_path: Path  # the resolved basis-lite config of the run
    pin_fd: int | None = None  # a shared lock on the checkpoint `adapter` lives in, held while this process reads it


def _is_adapter_dir(p: Path) -> bool:
    return (p / ADAPTER_CONFIG).is_file()


def resolve_target(path: str | Path) -> Target:
    """Resolve a run folder, checkpoint folder or adapter folder; ConfigError when it is none of them, when a
    symlink in it leads out of it, or when the adapter it names is unusable (`checkpoint.adapter_problem`: no
    weights file, tensors that do not load or are not finite). A run whose final adapter/ is unusable falls back to
    its newest checkpoint with a usable adapter, with a warning. Nothing is ever looked for on the hub."""
    from ..safeio import check_run_folder
    from .checkpoint import adapter_problem

    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{p}: no such run folder or adapter folder")
    if not p.is_dir():
        raise ConfigError(f"{p}: expected a run folder (with config.yaml) or an adapter folder (with "
                          f"{ADAPTER_CONFIG}), got a file")
    check_run_folder(p)
    if _is_adapter_dir(p):
        for cand in (p / ADAPTER_RUN_CONFIG, p.parent / "config.yaml"):
            if cand.is_file():
                run_dir = p.parent if (p.parent / "config.yaml").is_file() else p
                if run_dir != p:
                    check_run_folder(run_dir)
                why = adapter_problem(p)
                if why is not None:
                    raise ConfigError(f"{p}: not a usable adapter ({why})")
                return Target(p, run_dir, p, cand)
        raise ConfigError(f"{p}: an adapter folder without {ADAPTER_RUN_CONFIG} inside or config.yaml next to it; "
                          f"basis-lite needs the run's config to know the base model and the data")
    if (p / "config.yaml").is_file():
        adapter = p / "adapter"
        fd = None
        why = adapter_problem(adapter) if adapter.exists() else None
        if why is not None or not _is_adapter_dir(adapter):
            last, fd = _pinned_checkpoint(p)
            if last is not None:
                adapter = last / "adapter"
                if why is not None:
                    log.warning("%s/adapter is not usable (%s); using the newest usable checkpoint %s", p, why,
                                last.name)
                else:
                    log.info("%s has no final adapter/ (unfinished run); using the newest checkpoint %s", p,
                             last.name)
            elif why is not None:
                raise ConfigError(f"{p}/adapter is not usable ({why}) and the run has no intact checkpoint to fall "
                                  f"back to")
            else:
                adapter = None
        return Target(p, p, adapter, p / "config.yaml", fd)
    raise ConfigError(f"{p}: not a basis-lite run folder (no config.yaml) nor an adapter folder (no {ADAPTER_CONFIG})")


def _pinned_checkpoint(run_dir: Path) -> tuple[Path | None, int | None]:
    """(the newest intact checkpoint with a usable adapter, the fd of a shared lock on it): a training process
    still writing the run does not prune a checkpoint while this process reads it. The lock goes with the fd or
    the process."""
    from ..safeio import pin_fd
    from .checkpoint import MANIFEST, adapter_problem, intact_checkpoints

    for _ in range(5):
        last = None
        for cand in intact_checkpoints(run_dir):
            why = adapter_problem(cand / "adapter")
            if why is None:
                last = cand
                break
            log.warning("skipping checkpoint %s: %s", cand, why)
        if last is None:
            return None, None
        fd = pin_fd(last / MANIFEST)
        if fd is not None:
            return last, fd
    raise ConfigError(f"{run_dir}: its checkpoints kept changing while being read; try again")


def load_run_config(target: Target, overrides: Sequence[str] = (), dataset: str | None = None) -> Config:
    """The run's config with `dataset` and `key=value` overrides applied, validated."""
    cfg = load_config_file(target.config_path)
    if dataset is not None or overrides:
        d = to_dict(cfg)
        if dataset is not None:
            d["data"]["dataset"] = str(dataset)
        cfg = load_config(data=d, overrides=list(overrides))
    return cfg


def resume_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The config a run to be resumed was started with; ConfigError when it is not a run, overrides are given, or
    config.yaml was edited since the newest checkpoint saved its copy (a resumed run keeps its config)."""
    from ..safeio import check_run_folder
    from .checkpoint import latest_checkpoint

    cfg_path = Path(run_dir) / "config.yaml"
    check_run_folder(run_dir)
    if not cfg_path.exists():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; is it a basis-lite run folder?")
    if overrides:
        raise ConfigError("--set cannot change a resumed run (its config is fixed); start a new run instead")
    cfg = load_config_file(cfg_path)
    last = latest_checkpoint(Path(run_dir))
    if last is not None:
        saved = load_config_file(last / "config.yaml")
        changed = _diff(to_dict(saved), to_dict(cfg))
        if changed:
            raise ConfigError(f"--resume {run_dir}: config.yaml was changed after the run started ("
                              + "; ".join(changed[:8]) + f"). A resumed run keeps the config it was started with "
                              f"(a copy is in {last / 'config.yaml'}): put config.yaml back, or start a new run "
                              f"with the new settings")
    return cfg


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} -> {vb!r}")
    return out


# ----------------------------------------------------------------------------------------------------------------
# evaluation


def evaluate_run(target: str | Path, dataset: str | None = None, samples: int = 0, limit: int = 0,
                 base: bool = False, overrides: Sequence[str] = (), out: str | Path | None = None) -> dict:
    """Evaluate a run's adapter (or with `base`, its base model) on the held-out split and write the JSON.

    Returns the result as written to the JSON file, plus "out": the file's path.
    """
    from ..data import load_examples
    from ..engines.base import SamplingParams
    from ..rl.evaluate import evaluate
    from ..runtime import build_policy, seed_everything, setup_device

    tgt = resolve_target(target)
    if not 0 <= samples <= MAX_SAMPLES:
        raise ConfigError(f"--samples: expected K in [0, {MAX_SAMPLES}], got {samples}")
    if limit < 0:
        raise ConfigError(f"--limit: expected N >= 0, got {limit}")
    # the run's rollout engine and backend are for training; eval generates with the loaded hf model itself unless
    # an override says otherwise (the base comparison needs it: disable_adapter() only acts on this model)
    cfg = load_run_config(tgt, ["generation.engine=hf", "model.backend=hf", "model.gradient_checkpointing=false",
                                *overrides], dataset)
    if base and not get_engine(cfg.generation.engine).shares_model:
        own = [n for n in engine_choices() if get_engine(n).shares_model]
        raise ConfigError(f"--base needs generation.engine={' or '.join(own)} (the adapter is disabled on the loaded "
                          f"model, which the {cfg.generation.engine} engine does not generate with)")
    if tgt.adapter is None and not base:
        raise ConfigError(f"{tgt.path}: the run has no adapter yet (no adapter/ and no complete checkpoint); "
                          f"pass --base to evaluate the base model")
    out_path = Path(out) if out else tgt.run_dir / ("eval_base.json" if base else "eval.json")
    check_writable(out_path, "--out" if out else "the eval results")  # before minutes of evaluation

    examples = load_examples(cfg.data, "eval")  # a bad dataset fails before the model loads
    if limit:
        examples = examples[:limit]
    if not examples:
        raise ConfigError(f"data: the eval split of {cfg.data.dataset!r} is empty (data.eval_size="
                          f"{cfg.data.eval_size}); nothing to evaluate")

    device, dtype = setup_device(cfg)
    t0 = time.time()
    model, tok, engine = build_policy(cfg, device, dtype, adapter_path=str(tgt.adapter) if tgt.adapter else None)
    seed_everything(cfg.train.seed)
    temperature = cfg.generation.temperature if cfg.generation.temperature > 0 else 1.0
    sampled = SamplingParams(temperature=temperature, top_p=cfg.generation.top_p,
                             max_new_tokens=cfg.train.eval_max_new_tokens, n=samples) if samples else None
    records: list[dict] = []
    with model.disable_adapter() if base else contextlib.nullcontext():
        res = evaluate(engine, tok, examples, cfg.data, max_new_tokens=cfg.train.eval_max_new_tokens,
                       require_boxed=cfg.reward.require_boxed, sampled=sampled, batch_size=cfg.train.eval_batch_size,
                       progress=True, desc="eval (base)" if base else "eval", records=records)
    samples_path = samples_path_for(out_path)
    result = {
        **res,
        "target": str(tgt.path),
        "adapter": None if base or tgt.adapter is None else str(tgt.adapter),
        "base": bool(base),
        "model": cfg.model.name,
        "dataset": cfg.data.dataset,
        "split": "eval",
        "limit": limit,
        "samples": samples,
        "sample_temperature": temperature if samples else None,
        "max_new_tokens": cfg.train.eval_max_new_tokens,
        "seconds": round(time.time() - t0, 2),
    }
    result["samples_file"] = str(samples_path)
    samples_text = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
    for path, text, what in ((out_path, json.dumps(result, indent=2, default=float) + "\n", "the eval results"),
                             (samples_path, samples_text, "the eval samples")):
        try:
            atomic_write_text(path, text)
        except OSError as e:
            if is_disk_full(e, path.parent):
                raise disk_full_error(what, path, e, "free some space and run the eval again") from e
            raise
    del model, engine
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    return {**result, "out": str(out_path), "records": records}


def samples_path_for(out_path: Path) -> Path:
    """The per-problem JSONL written beside an eval JSON: eval.json -> eval_samples.jsonl."""
    return out_path.with_name(f"{out_path.stem}_samples.jsonl")


def printable(text: str) -> str:
    """`text` with every control character but newline and tab shown as an escape (ESC as \\x1b, ...): data and
    model output printed to a terminal cannot set its title, colours or cursor."""
    return "".join(repr(c)[1:-1] if unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text)


def format_misses(records: list[dict], n: int, width: int = 300) -> str:
    """Up to `n` problems the greedy answer got wrong: question, gold, the extracted answer and the completion,
    control characters escaped (`printable`)."""
    misses = [r for r in records if not r["correct"]]
    lines = [f"{len(misses)} of {len(records)} problems missed" + (f"; the first {n}:" if misses and n else "")]
    for r in misses[:n]:
        prompt = r["prompt"]
        question = prompt if isinstance(prompt, str) else next(
            (m["content"] for m in reversed(prompt) if m["role"] == "user"), "")
        completion = r["completion"] if len(r["completion"]) <= width else r["completion"][:width] + "..."
        level = "" if r.get("level") is None else f" (level {r['level']})"
        lines += [f"- {r['id']}{level}: {question.strip()[:width]}",
                  f"  gold {r['gold']!r}, extracted {r['extracted']!r}",
                  "  completion: " + completion.replace("\n", "\n              ")]
    return printable("\n".join(lines))


def check_writable(path: Path, what: str) -> None:
    """ConfigError unless a file can be written at `path`: not an existing folder, its folder creatable and
    writable (a probe file is created and removed there)."""
    if path.is_dir():
        raise ConfigError(f"{what}: {path} is a folder; give a file name such as {path / 'eval.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{what}: cannot write {path} ({type(e).__name__}: {e.strerror or e}); choose a writable "
                          f"place with --out") from None


def _fmt(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3f}"


def format_eval_table(res: dict) -> str:
    """An `evaluate_run` result as a table: overall and per-level greedy pass@1, sampled pass@1 and pass@K
    (overall only), n."""
    what = "base model (adapter disabled)" if res.get("base") else f"adapter {res.get('adapter')}"
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
