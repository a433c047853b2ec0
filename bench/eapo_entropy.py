#!/usr/bin/env python
"""Where the default EAPO entropy threshold comes from: the policy's next-token entropy over sampled completions.

    python bench/eapo_entropy.py                                   # default preset, levels 1-3 and 4-5
    python bench/eapo_entropy.py --preset smoke --prompts 8 --no-write --set model.dtype=float32   # plumbing

For each level set, the first `--prompts` training prompts of the preset (its sampler order, train.seed) get one
completion each from the HF engine at the preset's generation.temperature, with the base model (a fresh LoRA
adapter is zero); one forward over the completions then gives the entropy of every position's next-token
distribution at that temperature (`losses.sequence_logprobs(with_entropy=True)`, nats). Reported: quantiles of the
per-token entropy, the share of tokens and of completions above candidate thresholds. The share of tokens at or
above `eapo.entropy_threshold` is the share of critical decision points; times `eapo.injection_rate` it is the
expected share of injected tokens.

Writes bench/results/eapo_entropy/eapo_entropy.{json,md} (unless --no-write). Minutes on 2 cores for the default
(model load, two generations of 32 prompts).
"""
from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.paths import results_dir  # noqa: E402
from bench.lib.provenance import flags_line, machine_record, with_load_after  # noqa: E402
from bench.lib.report import markdown_table, write_json  # noqa: E402

QUANTILES = (0.5, 0.75, 0.8, 0.9, 0.95, 0.99)
THRESHOLDS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)


def measure(preset: str, levels: list[int], n_prompts: int, extra: list[str]) -> dict:
    import torch

    from basis_lite.config import load_config
    from basis_lite.data import PromptSampler, format_prompt, load_examples
    from basis_lite.engines.base import params_from_config
    from basis_lite.losses.policy import sequence_logprobs
    from basis_lite.rl.update import pack_sequences
    from basis_lite.runtime import build_policy, seed_everything, setup_device

    cfg = load_config(preset, [*extra, f"data.levels={levels}", f"train.batch_size={n_prompts}"])
    device, dtype = setup_device(cfg)
    seed_everything(cfg.train.seed)
    model, tok, engine = build_policy(cfg, device, dtype)
    batch = next(PromptSampler(load_examples(cfg.data, "train"), n_prompts, seed=cfg.train.seed))
    prompts = [format_prompt(tok, ex.question, cfg.data) for ex in batch]
    rolls = engine.generate(prompts, params_from_config(cfg.generation), with_features=False)
    ents = []
    per_completion_max = []
    for s in range(0, len(rolls), 8):
        chunk = rolls[s:s + 8]
        ids, attn, cmask = pack_sequences(chunk, cfg.model.max_seq_length, tok.pad_token_id)
        with torch.no_grad():
            out = sequence_logprobs(model, ids.to(device), attn.to(device), cmask.to(device),
                                    temperature=cfg.generation.temperature or 1.0, with_entropy=True)
        for i in range(len(chunk)):
            e = out.entropy[i][out.mask[i]].float().cpu()
            ents.append(e)
            per_completion_max.append(float(e.max()) if e.numel() else 0.0)
    flat = torch.cat(ents)
    return {
        "levels": levels, "prompts": len(prompts), "tokens": int(flat.numel()),
        "temperature": cfg.generation.temperature, "model": cfg.model.name,
        "quantiles": {str(q): float(torch.quantile(flat, q)) for q in QUANTILES},
        "token_share_at_or_above": {str(t): float((flat >= t).float().mean()) for t in THRESHOLDS},
        "completion_share_with_one": {str(t): sum(m >= t for m in per_completion_max) / len(per_completion_max)
                                      for t in THRESHOLDS},
        "mean": float(flat.mean()),
    }


def write_md(report: dict, path: Path) -> None:
    lines = ["# Policy next-token entropy on sampled completions (where the EAPO threshold comes from)", "",
             f"Preset `{report['preset']}`, base model (adapter at zero), one completion per prompt at the preset's "
             "temperature; entropy of each position's next-token distribution at that temperature, in nats.", ""]
    for r in report["runs"]:
        lines += [f"## levels {r['levels']} ({r['prompts']} prompts, {r['tokens']} tokens, T={r['temperature']})", "",
                  markdown_table(["quantile", *r["quantiles"]],
                                 [["entropy", *(f"{v:.3f}" for v in r["quantiles"].values())]]), "",
                  markdown_table(["threshold", *r["token_share_at_or_above"]],
                                 [["share of tokens >= threshold",
                                   *(f"{v:.3f}" for v in r["token_share_at_or_above"].values())],
                                  ["share of completions with one",
                                   *(f"{v:.3f}" for v in r["completion_share_with_one"].values())]]), ""]
    m = report["machine"]
    lines += [f"Machine: {flags_line(m)}; commit {m.get('git_commit', '?')}; load average before / after "
              f"{m.get('loadavg_before')} / {m.get('loadavg_after')}. Command: `{report['command']}`. Generated "
              f"{report['created']} by bench/eapo_entropy.py.", ""]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu-smollm2-arith")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--levels", default="1,2,3;4,5", help="level sets separated by ';' (default 1,2,3;4,5)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=str(results_dir("eapo_entropy")), help="default bench/results/eapo_entropy")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    machine = machine_record()
    runs = [measure(args.preset, [int(x) for x in ls.split(",")], args.prompts, args.set)
            for ls in args.levels.split(";") if ls.strip()]
    report = {"benchmark": "policy next-token entropy on sampled completions", "preset": args.preset,
              "set": args.set, "runs": runs, "machine": with_load_after(machine),
              "command": "python bench/eapo_entropy.py " + " ".join(argv),
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    for r in runs:
        print(f"levels {r['levels']}: {r['tokens']} tokens, quantiles " +
              ", ".join(f"{q}: {v:.3f}" for q, v in r["quantiles"].items()) + "; share >= threshold " +
              ", ".join(f"{t}: {v:.3f}" for t, v in r["token_share_at_or_above"].items()))
    if not args.no_write:
        out = Path(args.out)
        write_json(out / "eapo_entropy.json", report, indent=2)
        write_md(report, out / "eapo_entropy.md")
        print(f"wrote {out / 'eapo_entropy.json'}, {out / 'eapo_entropy.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
