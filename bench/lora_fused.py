#!/usr/bin/env python
"""The fused LoRA branch (basis_lite/model/lora.py) against peft's own forward, on the update's forward + backward.

    python bench/lora_fused.py                        # the default preset's model and dtype, 8 rounds
    python bench/lora_fused.py --dtype float32 --rounds 6 --no-write

One process, one model: the built-in SmolLM2 as `load_policy` builds it (every adapted linear a FusedLoraLinear),
lora_B set to small random values so every gradient path carries numbers. One "step" is what the update runs for
a default batch: the shared prefix at batch 1 (losses.policy.SharedPrefix), then micro-batches of
`train.micro_batch_size` rows through `sequence_logprobs` and backward, then the prefix's backward. The rows are
synthetic but shaped like the default job's: a 27-token shared prefix, prompt suffixes of 12-23 tokens and
completions of 15-47 tokens (32 rows, seeded), sorted by length as `micro_batches` sorts them.

The two arms are the same modules with their class switched between rounds: `fused` (FusedLoraLinear) and `peft`
(peft's lora.Linear forward, lora_A casting inside `CastInputLinear` as the code before the fused branch ran it).
Rounds alternate the arm order; each arm's best and median over the rounds are reported, and their ratio. Before
timing, the log-probs and every LoRA gradient of one micro-batch are compared bit for bit between the arms.

Writes bench/results/lora_fused/lora_fused-<dtype>.json and .md (--out to change) with the machine's flags. Run it
alone on the machine: a second torch job on the same cores changes every figure.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.lib.paths import results_dir, shown  # noqa: E402
from bench.lib.provenance import flags_line, machine_record, with_load_after  # noqa: E402
from bench.lib.report import markdown_table, write_json  # noqa: E402

PREFIX = 27


def synthetic_rows(n: int = 32, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt suffix, completion) token lengths of `n` rows, sorted by total length."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = [(int(torch.randint(12, 24, (1,), generator=g)), int(torch.randint(15, 48, (1,), generator=g)))
            for _ in range(n)]
    return sorted(rows, key=sum)


def micro_batch_tensors(rows, mb: int, vocab: int, seed: int = 1):
    """[(input_ids, attention_mask, completion_mask)] per micro-batch, every row starting with one shared prefix."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(100, vocab, (1, PREFIX), generator=g)
    out = []
    for i in range(0, len(rows), mb):
        chunk = rows[i:i + mb]
        width = PREFIX + max(s + c for s, c in chunk)
        ids = torch.randint(100, vocab, (len(chunk), width), generator=g)
        ids[:, :PREFIX] = prefix
        attn = torch.zeros(len(chunk), width, dtype=torch.long)
        comp = torch.zeros_like(attn)
        for j, (s, c) in enumerate(chunk):
            attn[j, :PREFIX + s + c] = 1
            comp[j, PREFIX + s:PREFIX + s + c] = 1
        out.append((ids, attn, comp))
    return prefix, out


def set_arm(model, arm: str) -> None:
    """Switch every adapted linear between the fused branch and peft's forward (with the 16-bit input cast)."""
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    from basis_lite.model.lora import FusedLoraLinear, keep_lora_inputs_16bit

    for m in model.modules():
        if type(m) in (FusedLoraLinear, PeftLoraLinear) and hasattr(m, "base_layer"):
            m.__class__ = FusedLoraLinear if arm == "fused" else PeftLoraLinear
    if arm == "peft":
        keep_lora_inputs_16bit(model)


def step(model, prefix_ids, batches, chunk: int) -> float:
    """The update's forward + backward over every micro-batch; seconds."""
    from basis_lite.losses.policy import SharedPrefix, sequence_logprobs
    from basis_lite.model.loading import training_attention

    t0 = time.perf_counter()
    with training_attention(model):
        prefix = SharedPrefix.compute(model, prefix_ids)
        n = sum(int(c.sum()) for _, _, c in batches)
        for ids, attn, comp in batches:
            out = sequence_logprobs(model, ids, attn, comp, chunk_size=chunk, prefix=prefix)
            ((out.logprobs * out.mask).sum() / n).backward()
        prefix.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def same_numbers(model, batch, chunk: int) -> bool:
    """Log-probs and LoRA gradients of one micro-batch, bit for bit the same in both arms."""
    import torch

    from basis_lite.losses.policy import sequence_logprobs
    from basis_lite.model.loading import training_attention

    got = {}
    for arm in ("peft", "fused"):
        set_arm(model, arm)
        model.zero_grad(set_to_none=True)
        with training_attention(model):
            out = sequence_logprobs(model, *batch, chunk_size=chunk)
        out.logprobs.sum().backward()
        got[arm] = (out.logprobs.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    (lp0, g0), (lp1, g1) = got["peft"], got["fused"]
    return torch.equal(lp0, lp1) and len(g0) == len(g1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default=None, help="model.dtype (default: the preset's, resolved on this CPU)")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds per arm (arms alternate)")
    ap.add_argument("--out", default=None, help="output folder (default bench/results/lora_fused)")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args(argv)

    import torch

    from basis_lite.config import load_config
    from basis_lite.model.dtypes import resolve_dtype
    from basis_lite.model.loading import load_policy

    machine = machine_record()
    cfg = load_config(None, [f"model.dtype={args.dtype}"] if args.dtype else [])
    dtype = resolve_dtype(cfg.model.dtype, torch.device("cpu"))
    torch.manual_seed(0)
    model, _ = load_policy(cfg, torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.01)
    model.train()
    vocab = model.get_input_embeddings().weight.shape[0]
    rows = synthetic_rows()
    prefix, batches = micro_batch_tensors(rows, cfg.train.micro_batch_size, vocab)
    chunk = cfg.train.logprob_chunk_size
    identical = same_numbers(model, batches[-1], chunk)
    times: dict[str, list[float]] = {"fused": [], "peft": []}
    for arm in ("fused", "peft"):  # warm-up, untimed
        set_arm(model, arm)
        step(model, prefix, batches, chunk)
    for r in range(args.rounds):
        for arm in (("fused", "peft") if r % 2 == 0 else ("peft", "fused")):
            set_arm(model, arm)
            times[arm].append(step(model, prefix, batches, chunk))
    machine = with_load_after(machine)
    dname = str(dtype).replace("torch.", "")
    result = {"dtype": dname, "rounds": args.rounds, "rows": rows, "micro_batch_size": cfg.train.micro_batch_size,
              "identical": identical, "seconds": times,
              "best": {a: min(v) for a, v in times.items()}, "median": {a: statistics.median(v) for a, v in times.items()},
              "machine": machine, "command": "python bench/lora_fused.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    result["fused_over_peft"] = {k: result[k]["fused"] / result[k]["peft"] for k in ("best", "median")}
    table = markdown_table(
        ["arm", "best s", "median s", "fused / peft (best)", "fused / peft (median)"],
        [[a, f"{result['best'][a]:.3f}", f"{result['median'][a]:.3f}",
          f"{result['fused_over_peft']['best']:.3f}" if a == "fused" else "-",
          f"{result['fused_over_peft']['median']:.3f}" if a == "fused" else "-"] for a in ("peft", "fused")])
    md = (f"# Fused LoRA branch against peft's forward: the update's forward + backward ({dname})\n\n"
          f"Generated by `{result['command']}` (the docstring of bench/lora_fused.py says what a step is).\n\n"
          f"Machine: {flags_line(machine)}; torch {machine.get('torch')}, {machine.get('torch_threads')} threads; "
          f"load average {machine.get('loadavg_before')} -> {machine.get('loadavg_after')}; commit "
          f"{machine.get('git_commit', '')[:12]}{' (dirty)' if machine.get('git_dirty') else ''}.\n\n"
          f"{len(rows)} rows in micro-batches of {cfg.train.micro_batch_size}, {args.rounds} rounds per arm, "
          f"alternating. Log-probs and LoRA gradients bit for bit the same in both arms: "
          f"{'yes' if identical else 'NO'}.\n\n{table}\n")
    print(md)
    if not args.no_write:
        out = Path(args.out) if args.out else results_dir("lora_fused")
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / f"lora_fused-{dname}.json", result)
        (out / f"lora_fused-{dname}.md").write_text(md)
        print(f"wrote {shown(out / f'lora_fused-{dname}.md')}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
