"""What a measurement records while it runs: resident memory, timed wrappers around the calls of a step, the
forwards of a causal LM inside generate(), and the phases of the fast CPU engine's decoder."""
from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from pathlib import Path

from bench.lib.flops import Shape, causal_pairs, fast_generation_flops, forward_flops

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb(pid: int | str = "self") -> float:
    """The resident memory of process `pid` (this one by default) now (MB, /proc/<pid>/statm; 0 where there is none,
    or once that process is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def peak_rss_mb() -> dict:
    """This process's peak resident memory: VmHWM from /proc/self/status and ru_maxrss (both MB), and the larger."""
    out = {"ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                out["vmhwm_mb"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    out["peak_rss_mb"] = round(max(out.values()), 1)
    return out


class RssSampler:
    """Peak resident memory (MB) of this process while a `with sampler.part():` block runs, sampled every 20 ms."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self._peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, rss_mb())

    @contextlib.contextmanager
    def part(self):
        self._peak = rss_mb()
        box = {}
        try:
            yield box
        finally:
            box["rss_peak_mb"] = max(self._peak, rss_mb())

    def close(self):
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def patched(obj, name, wrapper_factory):
    """`obj.name` replaced by wrapper_factory(the original) while the block runs, restored after (even on an error)."""
    orig = getattr(obj, name)
    setattr(obj, name, wrapper_factory(orig))
    try:
        yield
    finally:
        setattr(obj, name, orig)


def timer(acc: dict, key: str):
    """A wrapper factory for `patched`: adds the wrapped call's seconds to acc[key]."""
    def factory(orig):
        def f(*a, **kw):
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                acc[key] += time.perf_counter() - t0
        return f
    return factory


class ForwardRecorder:
    """Times every forward of a causal LM (pre/post hooks) and records its shapes: prefill vs decode accounting."""

    def __init__(self, module):
        self.calls: list[dict] = []
        self._h = [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                   module.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, _m, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        am = kwargs.get("attention_mask")
        pkv = kwargs.get("past_key_values")
        past = 0
        if pkv is not None and hasattr(pkv, "get_seq_length"):
            past = int(pkv.get_seq_length())
        b, t = ids.shape
        ctx = int(am.shape[-1]) if am is not None else past + t
        keep = kwargs.get("logits_to_keep", 0)
        head_rows = b * (int(keep) if isinstance(keep, int) and keep > 0 else t)
        real = int(am[:, -t:].sum()) if am is not None else b * t
        self.calls.append({"t0": time.perf_counter(), "rows": b, "new": t, "past": past, "ctx": ctx,
                           "head_rows": head_rows, "real": real})

    def _post(self, _m, _args, _kwargs, _out):
        self.calls[-1]["t1"] = time.perf_counter()

    def remove(self):
        for h in self._h:
            h.remove()

    def summary(self, shape: Shape, lora: int) -> dict:
        """Seconds, positions, real tokens, FLOPs of the prefill calls (empty cache) and of the decode calls."""
        out = {k: {"seconds": 0.0, "positions": 0, "real": 0, "flops": 0.0, "calls": 0} for k in ("prefill", "decode")}
        for c in self.calls:
            kind = "prefill" if c["past"] == 0 else "decode"
            o = out[kind]
            o["calls"] += 1
            o["seconds"] += c["t1"] - c["t0"]
            o["positions"] += c["rows"] * c["new"]
            o["real"] += c["real"]
            # query j of the new positions (0-based) sees past + j + 1 keys
            pairs = c["rows"] * (c["new"] * c["past"] + causal_pairs(c["new"]))
            o["flops"] += forward_flops(shape, c["rows"] * c["new"], pairs, c["head_rows"], lora)
        return out


class FastRecorder:
    """Times the phases of the fast CPU engine's FastDecoder (engines/fast_cpu.py) and records what each generate
    call computed, by wrapping, on the decoder instance, `refresh` (the adapter merged into / fused beside the
    weights), `_forward` (the decoder layers), `_logits` (the lm_head, counted with the forward before it) and
    `generate`, and the module's `_common_prefix` (the shared prefix P). In a generate call the forwards are: the
    prefix at batch 1 when P > 0, then the prompt suffixes, then one per decode step."""

    def __init__(self, decoder):
        import basis_lite.engines.fast_cpu as fmod

        self.dec, self.fmod = decoder, fmod
        self.gens: list[dict] = []
        self.refresh_s = 0.0
        self.rebuilds = 0
        self._orig = {n: getattr(decoder, n) for n in ("refresh", "_forward", "_logits", "generate")}
        self._orig_prefix = fmod._common_prefix
        dec = decoder

        def refresh(*a, **kw):
            t0 = time.perf_counter()
            rebuilt = self._orig["refresh"](*a, **kw)
            self.refresh_s += time.perf_counter() - t0
            self.rebuilds += int(bool(rebuilt))
            return rebuilt

        def generate(rows, *a, **kw):
            g = {"prompt_lens": [len(r) for r in rows], "prefix": 0, "calls": [], "seconds": 0.0, "refresh_s": 0.0}
            self.gens.append(g)
            r0 = self.refresh_s
            t0 = time.perf_counter()
            out = self._orig["generate"](rows, *a, **kw)
            g["seconds"] = time.perf_counter() - t0
            g["refresh_s"] = self.refresh_s - r0
            g["completion_lens"] = [len(t) for t in out[0]]
            return out

        def common_prefix(*a, **kw):
            n = self._orig_prefix(*a, **kw)
            if self.gens:
                self.gens[-1]["prefix"] = n
            return n

        def forward(ids, pos, cache, slot0, mask, *a, **kw):
            g = self.gens[-1]
            kind = "decode" if any(c["kind"] == "prompt" for c in g["calls"]) else \
                ("prefix" if g["prefix"] and not g["calls"] else "prompt")
            t0 = time.perf_counter()
            out = self._orig["_forward"](ids, pos, cache, slot0, mask, *a, **kw)
            g["calls"].append({"kind": kind, "rows": int(ids.shape[0]), "new": int(ids.shape[1]), "slot0": int(slot0),
                               "seconds": time.perf_counter() - t0})
            return out

        def logits(h):
            t0 = time.perf_counter()
            out = self._orig["_logits"](h)
            self.gens[-1]["calls"][-1]["seconds"] += time.perf_counter() - t0
            self.gens[-1]["calls"][-1]["head_rows"] = int(h.shape[0])
            return out

        dec.refresh, dec._forward, dec._logits, dec.generate = refresh, forward, logits, generate
        fmod._common_prefix = common_prefix

    def remove(self):
        for n in self._orig:
            delattr(self.dec, n)  # the instance attributes go; the class's methods show through again
        self.fmod._common_prefix = self._orig_prefix

    def weight_bytes(self) -> int:
        """Bytes of the decoder's dense weight copies (every linear of every layer and the head) in its compute
        dtype: what one forward reads at least, whatever its batch (LoRA factors beside 16-bit copies and the KV
        cache not counted)."""
        groups = [g for e in self.dec.layers for g in e["groups"]] + [self.dec.head]
        return sum(g.shape[0] * g.shape[1] for g in groups) * self.dec.dtype.itemsize

    def summary(self, shape: Shape, lora: int, merge_flops: float) -> dict:
        """Per phase: seconds, calls, positions computed, useful tokens and FLOPs (`fast_generation_flops` over each
        generate call's rows, prefix and completions); `checked`: the recorded forwards have the shapes it assumes."""
        out = {k: {"seconds": 0.0, "calls": 0, "positions": 0, "tokens": 0, "flops": 0.0}
               for k in ("prefix", "prompt", "decode")}
        inside, checked = 0.0, True
        for g in self.gens:
            f = fast_generation_flops(shape, g["prompt_lens"], g["prefix"], g["completion_lens"], lora)
            for k in out:
                calls = [c for c in g["calls"] if c["kind"] == k]
                out[k]["seconds"] += sum(c["seconds"] for c in calls)
                out[k]["calls"] += len(calls)
                out[k]["positions"] += f[f"{k}_positions"]
                out[k]["flops"] += f[f"{k}_flops"]
                checked &= sum(c["rows"] * c["new"] for c in calls) == f[f"{k}_positions"]
            checked &= len([c for c in g["calls"] if c["kind"] == "decode"]) == f["decode_calls"]
            out["prefix"]["tokens"] += g["prefix"]
            out["prompt"]["tokens"] += f["prompt_tokens"] - g["prefix"] * len(g["prompt_lens"])
            out["decode"]["tokens"] += f["decode_positions"]
            inside += g["seconds"] - g["refresh_s"] - sum(c["seconds"] for c in g["calls"])
        return {**out, "weights": {"seconds": self.refresh_s, "rebuilds": self.rebuilds,
                                   "flops": merge_flops * self.rebuilds},
                "sampling": {"seconds": inside}, "generate_s": sum(g["seconds"] for g in self.gens),
                "generate_calls": len(self.gens), "checked": bool(checked), "weight_bytes": self.weight_bytes(),
                "prefix_lens": [g["prefix"] for g in self.gens]}
