#!/usr/bin/env python
"""basis-lite: single-rollout RL from verifiable rewards with BASIS baselines.

    basis-lite train   [--preset NAME_OR_PATH] [--config TRL_GRPO.yaml] [--set key=value ...] [--output DIR]
                       [--resume RUN_DIR]
    torchrun --nproc_per_node N -m basis_lite train ...    the same on N data-parallel ranks (README)
    basis-lite eval    RUN_DIR_OR_ADAPTER [--dataset NAME_OR_FILE] [--samples K] [--limit N] [--base] [--set ...]
                       [--out FILE] [--show-misses N]
    basis-lite export  RUN_DIR_OR_ADAPTER --out DIR [--merged] [--dtype auto|bfloat16|float16|float32]
                       [--gguf f16|q8_0] [--tolerance T] [--merge-into trained|original]
    basis-lite prior   [--preset ...] [--set ...]       precompute the BASIS reference prior (cached)
    basis-lite plan    [--preset ...] [--gpu-memory GiB] [--gpus N] [--all]   memory estimate by part
    basis-lite plot    RUN_DIR [--out DIR]              PNG charts of a run's metrics
    basis-lite presets                                   list the presets
    basis-lite config  [--preset ...] [--set ...]       print the resolved config: every key, its value and meaning
    basis-lite --version

Also runs as `python -m basis_lite ...` or, from a source checkout, `python cli.py ...`. Bad input exits with
code 2 and one message naming the problem.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

EXIT_USAGE = 2


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None,
                   help="preset name (see `basis-lite presets`) or path to a YAML file; default cpu-smollm2-arith")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=10 --set estimator.name=reinforce_pp "
                        "(values are parsed as YAML; repeatable)")
    p.add_argument("--config", dest="trl_config", default=None, metavar="GRPO_YAML",
                   help="a `trl grpo --config` YAML file, read with TRL's meaning on top of the preset (--set "
                        "applies last); keys basis-lite cannot map are refused, with the nearest basis-lite key")


def version_text() -> str:
    """'basis-lite X (python Y; torch Z, transformers W)': versions from the installed metadata, nothing imported."""
    import importlib.metadata as md
    import platform
    import re

    def ver(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    own = ver("basis-lite")
    if own is None:  # a source checkout that is not installed: the version pyproject.toml declares
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        own = f"{m.group(1)} (source checkout, not installed)" if m else "unknown"
    deps = ", ".join(f"{d} {ver(d) or 'not installed'}" for d in ("torch", "transformers", "peft"))
    return f"basis-lite {own} (python {platform.python_version()}; {deps})"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="basis-lite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    ap.add_argument("--version", action=_VersionAction)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a LoRA adapter with RL (default: SmolLM2-135M on arithmetic, CPU)")
    _add_config_args(p)
    p.add_argument("--output", default=None, help="run folder (default runs/<preset>-<time>)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue a run from its latest complete checkpoint (config is taken from the run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (metrics still go to metrics.jsonl)")

    p = sub.add_parser("eval", help="greedy pass@1 and sampled pass@k of a run or adapter on a held-out split")
    p.add_argument("target", help="a run folder (uses its adapter/) or an adapter folder")
    p.add_argument("--dataset", default=None, help="dataset name or file (default: the run's own dataset)")
    p.add_argument("--samples", type=int, default=0, help="K samples per prompt for sampled pass@1 and pass@K")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N held-out problems")
    p.add_argument("--base", action="store_true", help="evaluate the base model (adapter disabled) instead")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=None, help="JSON file for the results (default RUN_DIR/eval.json); the "
                   "per-problem samples go beside it (eval_samples.jsonl)")
    p.add_argument("--show-misses", type=int, default=0, metavar="N",
                   help="print up to N problems the greedy answer got wrong (question, gold, extracted, completion)")

    p = sub.add_parser("export", help="save the adapter alone, a merged 16-bit model or a GGUF (checks itself)")
    p.add_argument("run_dir", help="a run folder (or an adapter folder)")
    p.add_argument("--out", required=True, help="destination folder (must not exist or be empty)")
    p.add_argument("--merged", action="store_true",
                   help="merge into a full-precision copy of the base and save 16-bit safetensors")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="merged weights dtype (auto: bfloat16, float16 where the base config says so)")
    p.add_argument("--gguf", default=None, choices=["f16", "q8_0"],
                   help="write a GGUF for llama.cpp / Ollama / LM Studio with llama.cpp's converter (fetched once)")
    p.add_argument("--tolerance", type=float, default=None, help="max logit difference allowed in the self-check")
    p.add_argument("--merge-into", default="trained", choices=["trained", "original"],
                   help="run over a 4-bit base: merge into the dequantised NF4 weights the adapter was trained "
                        "against (trained, the default) or into the original full-precision weights (original: "
                        "prints the measured gap to the trained model)")

    p = sub.add_parser("prior", help="precompute the BASIS prior (K reference rollouts per training prompt)")
    _add_config_args(p)
    p.add_argument("--samples", type=int, default=None, help="K (default estimator.prior_samples, or 8 if 0)")

    p = sub.add_parser("plan", help="estimate GPU memory by part for a preset, and warn when it will not fit")
    _add_config_args(p)
    p.add_argument("--gpu-memory", type=float, default=None, help="card memory in GiB, as nvidia-smi reports it (default: the preset's)")
    p.add_argument("--all", action="store_true", help="print the plan for every preset")
    p.add_argument("--gpus", type=int, default=1,
                   help="data-parallel GPUs (torchrun --nproc_per_node N): memory per card and the global batch")

    p = sub.add_parser("plot", help="write PNG charts of a run's metrics.jsonl")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="folder for the PNGs (default RUN_DIR/plots)")

    sub.add_parser("presets", help="list the presets, one line each")

    p = sub.add_parser("config", help="print the resolved config: every key, its value, its meaning and accepted "
                                      "values (a preset file: save it and pass it to --preset)")
    _add_config_args(p)
    return ap


# ----------------------------------------------------------------------------------------------------------------
# the commands: each calls typed library functions and prints; imports stay inside, so that `presets`, `plan` and
# `plot` never import torch


def cmd_train(args) -> int:
    from .config import load_config
    from .errors import ConfigError
    from .rl.distributed import env_rank, exit_finished_rank, launched
    from .runs.saved import resume_config
    from .trainer import train

    signal.signal(signal.SIGTERM, _sigterm)  # stop like Ctrl-C: the reward worker closes, the lock is released
    if args.resume:
        given = [opt for opt, v in (("--config", args.trl_config), ("--preset", args.preset),
                                    ("--output", args.output)) if v is not None]
        if given:
            raise ConfigError(f"{' and '.join(given)} cannot change a resumed run: it keeps its config and its "
                              f"folder (the one --resume names); drop {' and '.join(given)}, or start a new run")
        cfg = resume_config(args.resume, args.overrides)
        summary = train(cfg, Path(args.resume), resume=True, progress=not args.no_progress)
    else:
        cfg = load_config(args.preset, args.overrides, trl_config=args.trl_config)
        summary = train(cfg, args.output, progress=not args.no_progress)
    if env_rank() == 0:  # under torchrun rank 0 prints the result
        _print_result(cfg, summary)
    if launched():  # every rank has closed its process group in train()
        exit_finished_rank(0)
    return 0


def _print_result(cfg, summary: dict) -> None:
    before, after = summary.get("eval_before") or {}, summary.get("eval_after")
    print()
    if not after:
        print(f"no held-out accuracy: the eval split is empty (data.eval_size={cfg.data.eval_size})")
        after = {}
    else:
        print(f"held-out accuracy (greedy, n={after['n']}): before {before.get('accuracy', float('nan')):.3f} -> "
              f"after {after['accuracy']:.3f}")
    for lvl, v in after.get("by_level", {}).items():
        b = (before.get("by_level") or {}).get(lvl, {}).get("accuracy", float("nan"))
        print(f"  level {lvl}: {b:.3f} -> {v['accuracy']:.3f} (n={v['n']})")
    print(f"adapter saved to {summary['adapter']}  ({summary['seconds'] / 60:.1f} min; metrics in "
          f"{summary['run_dir']}/metrics.jsonl)")


def _sigterm(signum, frame):
    from .errors import Interrupted

    raise Interrupted("SIGTERM")


def cmd_presets(args) -> int:
    from .config import list_presets, preset_summary

    names = list_presets()
    width = max(len(n) for n in names)
    for n in names:
        print(f"{n:<{width}}  {preset_summary(n)}")
    return 0


def cmd_config(args) -> int:
    from .config import describe_config, load_config

    cfg = load_config(args.preset, args.overrides, trl_config=args.trl_config)
    head = f"# basis-lite config: preset {cfg.preset or args.preset}"
    if args.trl_config:
        head += f" with the TRL config {args.trl_config}"
    if args.overrides:
        head += " with --set " + " --set ".join(args.overrides)
    print(head + "\n# Every key with its meaning, [accepted values] and (default) where it differs. Save this and "
                 "run it with\n# `basis-lite train --preset FILE.yaml`.\n")
    print(describe_config(cfg), end="")
    return 0


def cmd_prior(args) -> int:
    from .config import load_config
    from .rl.priors import compute_prior

    table = compute_prior(load_config(args.preset, args.overrides, trl_config=args.trl_config), args.samples or 0)
    state = "reused cached" if table["cached"] else f"computed in {table['seconds']:.0f}s"
    print(f"prior K={table['k']} over {table['prompts']} prompts {state}: mean success {table['mean']:.3f} "
          f"(key {table['key']})")
    return 0


def cmd_eval(args) -> int:
    from .errors import ConfigError
    from .runs.saved import evaluate_run, format_eval_table, format_misses

    if args.show_misses < 0:
        raise ConfigError(f"--show-misses: expected N >= 0, got {args.show_misses}")
    result = evaluate_run(args.target, dataset=args.dataset, samples=args.samples, limit=args.limit, base=args.base,
                          overrides=args.overrides, out=args.out)
    print(format_eval_table(result))
    if args.show_misses:
        print(format_misses(result["records"], args.show_misses))
    print(f"results written to {result['out']} (per problem: {result['samples_file']})")
    return 0


def cmd_export(args) -> int:
    from .export.hf import export_run

    report = export_run(args.run_dir, args.out, merged=args.merged, dtype=args.dtype, tolerance=args.tolerance,
                        gguf=args.gguf, merge_into=args.merge_into)
    out = report["out"]
    if report["kind"] == "adapter":
        print(f"adapter written to {out} (load: PeftModel.from_pretrained(base, {out!r}); see README.md)")
        return 0
    if report["kind"] == "gguf":
        c = report["check"]
        print(f"self-check: reloaded {report['file']} with transformers vs the merged float32 model: max |logit diff| "
              f"{c['max_abs_diff']:.4g} (tolerance {c['tolerance']:.4g}, max |logit| {c['max_abs_logit']:.4g}); "
              f"same argmax at {100 * c['argmax_agreement']:.1f}% of {c['positions']} positions; same tokens on "
              f"{c['tokenization_texts']} texts (tokenizer {c['tokenizer_model']}, pre {c['tokenizer_pre']})")
        extra = " with an Ollama Modelfile" if report["modelfile"] else ""
        print(f"{report['gguf_type']} GGUF written to {out}/{report['file']} ({report['size_mb']:.1f} MB){extra}")
        return 0
    c = report["check"]
    print(f"self-check: reloaded {c['saved_dtype']} model vs {c['reference']}: max |logit diff| "
          f"{c['max_abs_diff']:.4g} (tolerance {c['tolerance']:.4g}, max |logit| {c['max_abs_logit']:.4g}); vs the "
          f"same weights in memory {c['roundtrip_max_abs_diff']:.3g}")
    gap = c.get("gap_to_trained")
    if gap:
        print(f"merged into the ORIGINAL full-precision weights: the run trained over NF4 weights, and this model "
              f"differs from the trained one (NF4 base + adapter) by up to {gap['max_abs_diff']:.4g} logits (same "
              f"argmax at {100 * gap['argmax_agreement']:.1f}% of {c['positions']} positions); the default "
              f"--merge-into trained exports the trained model")
    print(f"merged {report['dtype']} model written to {out} ({report['size_mb']:.1f} MB)")
    print(f"self-check passed: max |logit diff| {c['max_abs_diff']:.3g} <= tolerance {c['tolerance']:.3g} "
          f"over {c['positions']} positions of {c['prompts']} prompts (max |logit| {c['max_abs_logit']:.3g}; "
          f"fp32 merge error {c['merge_max_abs_diff']:.3g}; adapter effect {c['adapter_effect']:.3g})")
    return 0


def cmd_plan(args) -> int:
    from .config import list_presets
    from .plan import PLAN_FOOTER, plan_for

    names = list_presets() if args.all else [args.preset or None]
    blocks = [plan_for(name, args.overrides, args.gpu_memory, gpus=args.gpus, trl_config=args.trl_config)
              for name in names]
    print("\n\n".join([*blocks, PLAN_FOOTER]), flush=True)
    return 0


def cmd_plot(args) -> int:
    from .plot import plot_run

    plots = plot_run(args.run_dir, args.out)
    if plots.skipped:
        print(f"skipped {plots.skipped} line(s) of {plots.metrics} that did not parse")
    for p in plots.paths:
        print(p)
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "export": cmd_export, "prior": cmd_prior, "plan": cmd_plan,
            "plot": cmd_plot, "presets": cmd_presets, "config": cmd_config}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("transformers", "httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not args.verbose else logging.DEBUG)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from .errors import USER_ERRORS
    from .safeio import disk_full_error, is_disk_full

    if args.command != "train" and all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        print(f"error: `{args.command}` runs in one process; only `train` runs under torchrun (every rank would "
              "repeat it)", file=sys.stderr)
        return EXIT_USAGE
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        sig = getattr(e, "signal_name", "SIGINT")
        print(str(e) if str(e) else f"stopped by {sig}", file=sys.stderr)
        return 143 if sig == "SIGTERM" else 130
    except (OSError, RuntimeError) as e:
        target = _write_target(args, e)
        if is_disk_full(e, target):  # a write the code did not expect to fail: one message, exit 2
            print(f"error: {disk_full_error(args.command, target, e)}", file=sys.stderr)
            return EXIT_USAGE
        raise


def _write_target(args, e: BaseException) -> Path:
    """Where a failed write went: the file the error names, else the command's output (the run folder, --out),
    else the working directory."""
    for _ in range(8):
        if e is None:
            break
        if getattr(e, "filename", None):
            return Path(e.filename)
        e = e.__cause__ or e.__context__
    for key in ("out", "output", "resume", "run_dir", "target"):
        value = getattr(args, key, None)
        if value:
            return Path(value)
    return Path.cwd()


if __name__ == "__main__":
    sys.exit(main())
