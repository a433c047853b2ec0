"""bench/cpu_step.py's results: the rows it measures, the runs it keeps side by side in cpu_step.json, and the
tables of cpu_step.md (engines side by side, step summary, the gap to the roofline, where the peak memory comes
from). Pure: no model, no timing; tests/bench/test_cpu_step.py checks it on hand-made rows."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from bench.lib.matmul_peak import PEAK_DTYPES
from bench.lib.report import fmt, markdown_table

ENGINES = ("fast", "hf", "vllm")  # the --engine names, in the order runs and tables list them
ROOFLINE_TARGET = 1.5  # issue #23: the whole step within 1.5x of its roofline time


@dataclass
class Row:
    variant: str  # e.g. "bfloat16, gc on"
    engine: str  # fast | hf | vllm
    dtype: str
    gc: str  # on | off | - (the part does not depend on checkpointing)
    part: str
    seconds: float
    tokens: int | None = None  # useful tokens
    positions: int | None = None  # positions computed (padding, finished rows included)
    flops: float | None = None
    peak_gflops: float | None = None  # measured peak of the dtype the model runs in
    rss_peak_mb: float | None = None
    bytes: float | None = None  # bytes the part must read from memory at least (decode: its weights, every forward)
    bandwidth_gbs: float | None = None  # measured read bandwidth of the machine
    all_seconds: list = field(default_factory=list)
    note: str = ""

    @property
    def tokens_per_s(self) -> float | None:
        return None if not self.tokens or self.seconds <= 0 else self.tokens / self.seconds

    @property
    def gflops_per_s(self) -> float | None:
        return None if self.flops is None or self.seconds <= 0 else self.flops / self.seconds / 1e9

    @property
    def peak_ratio(self) -> float | None:
        g = self.gflops_per_s
        return None if g is None or not self.peak_gflops else g / self.peak_gflops

    @property
    def roofline_s(self) -> float | None:
        """The time the measured matmul peak would take for this part's model FLOPs."""
        return None if self.flops is None or not self.peak_gflops else self.flops / (self.peak_gflops * 1e9)

    @property
    def x_roofline(self) -> float | None:
        """Seconds over roofline seconds (1.0 = at the matmul peak; = 1 / peak_ratio)."""
        rs = self.roofline_s
        return None if not rs else self.seconds / rs

    @property
    def bandwidth_s(self) -> float | None:
        """The time reading this part's bytes once at the measured read bandwidth would take."""
        return None if not self.bytes or not self.bandwidth_gbs else self.bytes / (self.bandwidth_gbs * 1e9)

    @property
    def x_bandwidth(self) -> float | None:
        """Seconds over bandwidth seconds (1.0 = every byte read at the machine's measured bandwidth)."""
        bs = self.bandwidth_s
        return None if not bs else self.seconds / bs

    @property
    def x_bound(self) -> float | None:
        """Seconds over the larger of the roofline and bandwidth seconds: the part's own bound, whichever of
        compute and memory traffic it is (None where neither is counted)."""
        bound = max(self.roofline_s or 0.0, self.bandwidth_s or 0.0)
        return None if not bound else self.seconds / bound

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, gflops_per_s=self.gflops_per_s, peak_ratio=self.peak_ratio,
                 roofline_s=self.roofline_s, x_roofline=self.x_roofline, bandwidth_s=self.bandwidth_s,
                 x_bandwidth=self.x_bandwidth, x_bound=self.x_bound)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Row":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


TABLE_COLUMNS = ("variant", "engine", "part", "s", "tokens", "tok/s", "GFLOP", "GFLOP/s", "% peak", "x roofline",
                 "GB read", "x bandwidth", "x bound", "RSS MB", "note")


def row_cells(r: Row) -> list[str]:
    return [r.variant, r.engine, r.part, fmt(r.seconds, ".2f"), fmt(r.tokens, "d"), fmt(r.tokens_per_s, ".1f"),
            fmt(None if r.flops is None else r.flops / 1e9, ".1f"), fmt(r.gflops_per_s, ".2f"),
            fmt(None if r.peak_ratio is None else 100 * r.peak_ratio, ".1f"), fmt(r.x_roofline, ".2f"),
            fmt(None if r.bytes is None else r.bytes / 1e9, ".1f"), fmt(r.x_bandwidth, ".2f"), fmt(r.x_bound, ".2f"),
            fmt(r.rss_peak_mb, ".0f"), r.note]


def run_key(run: dict) -> tuple:
    return run["engine"], run["dtype"], tuple(run.get("overrides") or ()), caps_tag(run.get("kernel_caps"))


def override_tag(overrides) -> str:
    """The label suffix of a run made with --set overrides (so rows of different batches are not confused)."""
    return f" [{', '.join(overrides)}]" if overrides else ""


def caps_tag(caps) -> str:
    """The label suffix of a run with capped kernels, e.g. " [kernels<=AVX2]" (the same CPU, not another one)."""
    if not caps:
        return ""
    return f" [kernels<={'/'.join(sorted({v.upper() for v in caps.values()}))}]"


def merge_runs(old: dict | None, new_runs: list[dict]) -> dict:
    """The results document with each new run replacing an old one of the same (engine, dtype, overrides), sorted."""
    keep = [r for r in (old or {}).get("runs", []) if isinstance(r, dict) and "engine" in r]
    new_keys = {run_key(r) for r in new_runs}
    runs = [r for r in keep if run_key(r) not in new_keys] + list(new_runs)
    # the preset's batch first, then overrides; HF before vLLM; float32 before bfloat16
    runs.sort(key=lambda r: (len(r.get("overrides") or ()), tuple(r.get("overrides") or ()),
                             caps_tag(r.get("kernel_caps")), _engine_rank(r["engine"]), r["dtype"] != "float32"))
    return {"runs": runs}


def _engine_rank(name: str) -> int:
    return ENGINES.index(name) if name in ENGINES else len(ENGINES)


def rows_of(doc: dict) -> list[Row]:
    return [Row.from_dict(d) for run in doc["runs"] for d in run["rows"]]


def engine_comparison(doc: dict) -> list[list[str]]:
    """Generation side by side: per (dtype, overrides), each engine's generation total, tokens/s and start-up."""
    groups: dict = {}
    for run in doc["runs"]:
        parts = {d["part"]: Row.from_dict(d) for d in run["rows"]
                 if d["part"] in ("gen total", "startup", "startup (HF model)")}
        if "gen total" in parts:
            key = (run["dtype"], override_tag(run.get("overrides")) + caps_tag(run.get("kernel_caps")))
            groups.setdefault(key, {})[run["engine"]] = parts
    out = []
    for (dtype, tag), by_eng in groups.items():
        hf = by_eng.get("hf", {}).get("gen total")
        for eng in sorted(by_eng, key=_engine_rank):
            g = by_eng[eng]["gen total"]
            st = [by_eng[eng][k].seconds for k in ("startup (HF model)", "startup") if k in by_eng[eng]]
            rel = "-" if hf is None or eng == "hf" else f"{hf.seconds / g.seconds:.2f}x"
            out.append([dtype + tag, eng, fmt(g.seconds, ".2f"), fmt(g.tokens, "d"), fmt(g.tokens_per_s, ".1f"),
                        fmt(sum(st) if st else None, ".1f"), rel])
    return out


COMPARISON_COLUMNS = ("dtype", "engine", "gen s", "sampled tokens", "tok/s", "start-up s (model + engine)",
                      "speed vs HF")
SUMMARY_COLUMNS = ("variant", "engine", "gen s", "train s", "step s", "train GFLOP/s", "train % peak",
                   "train peak RSS MB", "step GFLOP", "step roofline s", "step x roofline")


def step_summary(doc: dict) -> list[list[str]]:
    """One line per (variant, engine): generation, update and step seconds, the update's throughput and memory."""
    rows = rows_of(doc)
    out = []
    for r in rows:
        if r.part != "train total":
            continue
        gen = next((x for x in rows if x.part == "gen total" and x.engine == r.engine and x.dtype == r.dtype
                    and x.variant == r.variant.replace(f", gc {r.gc}", "")), None)
        step = next((x for x in rows if x.part == "step total" and x.engine == r.engine and x.variant == r.variant),
                    None)
        out.append([r.variant, r.engine, fmt(None if gen is None else gen.seconds, ".1f"), fmt(r.seconds, ".1f"),
                    fmt(None if step is None else step.seconds, ".1f"), fmt(r.gflops_per_s, ".2f"),
                    fmt(None if r.peak_ratio is None else 100 * r.peak_ratio, ".1f"), fmt(r.rss_peak_mb, ".0f"),
                    fmt(None if step is None or step.flops is None else step.flops / 1e9, ".0f"),
                    fmt(None if step is None else step.roofline_s, ".1f"),
                    fmt(None if step is None else step.x_roofline, ".2f")])
    return out


GAP_COLUMNS = ("variant", "engine", "part", "s", "% of step", "GFLOP/s", "x roofline", "s over roofline",
               "% of step gap")
# rows that are not a part of the step's time (totals, start-up, vLLM's extra calls and its split of one call)
_NOT_STEP_PARTS = {"startup", "startup (HF model)", "gen total", "train total", "step total", "gen vLLM, no adapter"}


def step_parts(doc: dict) -> list[tuple[Row, list[Row]]]:
    """(step total row, the rows whose seconds and FLOPs add up to it) per (run, gc setting)."""
    out = []
    for run in doc["runs"]:
        rows = [Row.from_dict(d) for d in run["rows"]]
        for step in (r for r in rows if r.part == "step total"):
            parts = [r for r in rows if r.part not in _NOT_STEP_PARTS and r.gc in ("-", step.gc)
                     and not (run["engine"] == "vllm" and r.part in ("gen prefill", "gen decode"))]
            out.append((step, parts))
    return out


def gap_rows(doc: dict) -> list[list[str]]:
    """Each part's seconds over its roofline seconds (all of its seconds when it has no FLOPs): where the step's
    distance from its roofline sits."""
    out = []
    for step, parts in step_parts(doc):
        gap = step.seconds - (step.roofline_s or 0.0)
        for r in parts:
            over = r.seconds - (r.roofline_s or 0.0)
            out.append([step.variant, step.engine, r.part, fmt(r.seconds, ".2f"),
                        fmt(100 * r.seconds / step.seconds if step.seconds else None, ".1f"),
                        fmt(r.gflops_per_s, ".1f"), fmt(r.x_roofline, ".2f"), fmt(over, ".2f"),
                        fmt(100 * over / gap if gap > 0 else None, ".1f")])
        out.append([step.variant, step.engine, "**step total**", fmt(step.seconds, ".2f"), "100.0",
                    fmt(step.gflops_per_s, ".1f"), fmt(step.x_roofline, ".2f"), fmt(gap, ".2f"), "100.0"])
    return out


def target_lines(doc: dict, target: float = ROOFLINE_TARGET) -> list[str]:
    """One line per step measured: its x roofline against the target and the part furthest above its roofline."""
    out = []
    for step, parts in step_parts(doc):
        if step.x_roofline is None:
            continue
        worst = max(parts, key=lambda r: r.seconds - (r.roofline_s or 0.0), default=None)
        gap = step.seconds - step.roofline_s
        verdict = "met" if step.x_roofline <= target else "not met"
        line = (f"- {step.variant}, {step.engine}: {step.seconds:.2f} s against {step.roofline_s:.2f} s of roofline, "
                f"**{step.x_roofline:.2f}x** (target {target}x: {verdict})")
        if worst is not None and gap > 0:
            over = worst.seconds - (worst.roofline_s or 0.0)
            line += (f"; the largest gap is {worst.part}: {over:.2f} s of the {gap:.2f} s over the roofline "
                     f"({100 * over / gap:.0f}%" + (f", at {worst.x_roofline:.1f}x its own roofline)"
                                                   if worst.x_roofline else ", no FLOPs counted)"))
        out.append(line)
    return out


MEMORY_COLUMNS = ("variant", "engine", "component", "MB", "how")


def memory_rows(doc: dict) -> list[list[str]]:
    """Where each run's peak resident memory comes from (`memory` of a run; see `memory_breakdown`)."""
    out = []
    for run in doc["runs"]:
        for comp in run.get("memory") or []:
            out.append([run["dtype"] + override_tag(run.get("overrides")) + caps_tag(run.get("kernel_caps")),
                        run.get("engine", "-"), comp["component"], fmt(comp.get("mb"), ".0f"), comp.get("how", "")])
    return out


def memory_breakdown(baseline_mb: float, weights_mb: float, lora_mb: float, optimizer_mb: float,
                     activations_mb: float, head_rows: int, vocab: int, kv_cache_mb: float, startup_peak: float,
                     gen_peak: float, train_peak: float) -> list[dict]:
    """The components of the peak RSS: measured ones, sizes from the tensors, and what is left (allocator).

    The update's peak holds the process baseline (interpreter, torch, transformers, peft), the frozen weights, the
    LoRA weights with their gradients and AdamW's two moments, the activations the largest micro-batch saves for
    its backward, and the log-prob head's working set: about three live float32 [rows, V] tensors of one chunk
    (logits, their exponentials, their gradient). What the sum leaves of the measured peak is the allocator's
    (freed buffers kept for reuse, fragmentation, oneDNN scratch)."""
    head_mb = 3 * head_rows * vocab * 4 / 2**20
    known = baseline_mb + weights_mb + 2 * lora_mb + optimizer_mb + activations_mb + head_mb
    rows = [
        {"component": "process baseline", "mb": baseline_mb, "how": "RSS after importing torch, transformers, peft"},
        {"component": "frozen weights", "mb": weights_mb, "how": "sum of the base parameters' bytes"},
        {"component": "LoRA weights + gradients", "mb": 2 * lora_mb, "how": "trainable bytes x 2 (fp32)"},
        {"component": "AdamW moments", "mb": optimizer_mb, "how": "optimizer state bytes after the update"},
        {"component": "activations saved for backward", "mb": activations_mb,
         "how": "largest micro-batch: unique storages saved by autograd, parameters excluded"},
        {"component": "log-prob head working set", "mb": head_mb,
         "how": f"~3 fp32 [{head_rows}, {vocab}] tensors of one chunk (logits, exp, gradient)"},
        {"component": "allocator and other (update)", "mb": max(0.0, train_peak - known),
         "how": "measured update peak minus the rows above"},
        {"component": "KV cache (generation)", "mb": kv_cache_mb,
         "how": "2 x layers x kv_heads x head_dim x rows x (prompt + new tokens) x dtype bytes"},
        {"component": "peak: startup", "mb": startup_peak, "how": "measured (RSS sampled every 20 ms)"},
        {"component": "peak: generation", "mb": gen_peak, "how": "measured"},
        {"component": "peak: update", "mb": train_peak, "how": "measured"},
    ]
    return rows


def _loadavgs(m: dict) -> str:
    """'before / after' of a run's machine record (runs recorded before bench/lib/provenance.py's record name them
    loadavg_start / loadavg_end)."""
    return f"{m.get('loadavg_before', m.get('loadavg_start'))} / {m.get('loadavg_after', m.get('loadavg_end'))}"


def render_markdown(doc: dict) -> str:
    runs = doc["runs"]
    # the header describes the machine as it is: the latest run without capped kernels, if there is one
    latest = max([r for r in runs if not r.get("kernel_caps")] or runs, key=lambda r: r.get("created", ""))
    m = latest["machine"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["cpu_flags"].items())
    lines = ["# One RL step on the CPU, by part (bench/cpu_step.py)", "",
             f"- CPU: {m['cpu_model']}, {m['cores']} cores; flags: {flags}",
             f"- torch {m['torch']} (CPU capability {m['torch_cpu_capability']}), {m['torch_threads']} threads; "
             f"transformers {m.get('transformers', '?')}; Python {m.get('python', '?')}",
             f"- git commit {m['git_commit']}" + (" plus uncommitted changes" if m.get("git_dirty") else ""),
             "- FLOP formulas: bench/lib/flops.py; timing method and definitions: the docstring of bench/cpu_step.py. "
             "Times are the best of the repeats; other jobs shared the cores (load averages below), so absolute "
             "times carry that noise.",
             "", "## Runs", ""]
    lines.append(markdown_table(
        ("engine", "dtype", "overrides", "kernels", "gc", "created", "load avg start / end", "OMP_WAIT_POLICY",
         "peak GFLOP/s", "command"),
        [[r["engine"], r["dtype"], ", ".join(r.get("overrides") or []) or "-",
          caps_tag(r.get("kernel_caps")).strip(" []") or "as the CPU allows", ",".join(r["gc"]), r["created"],
          _loadavgs(r["machine"]),
          r["machine"].get("omp_wait_policy") or "(unset)", fmt(r["peak"]["best"].get(r["dtype"]), ".1f"),
          f"`{r['command']}`"] for r in runs]))
    b = latest["batch"]
    lines += ["", f"Batch of the latest run: {b['prompts']} prompts x {b['rollouts_per_prompt']} rollout(s), "
              f"max_new_tokens {b['max_new_tokens']}, temperature {b['temperature']}, micro-batch "
              f"{b['micro_batch_size']}, LoRA r={b['lora_r']} ({b['lora_params']} params).", ""]
    capped = {caps_tag(r.get("kernel_caps")): r for r in runs if r.get("kernel_caps")}
    for tag, r in capped.items():
        lines += [f"Runs marked{tag} ran on the SAME CPU with torch's kernels capped by environment variables "
                  f"({', '.join(f'`{k}={v}`' for k, v in r['kernel_caps'].items())}): an emulation of a CPU "
                  "without AVX-512, not a measurement of a real AVX2-only machine (its clock, caches and memory "
                  "bandwidth are this one's). Their peak is measured under the same caps.", ""]
    auto = {r["machine"].get("auto_dtype") for r in runs if not r.get("kernel_caps")} - {None}
    if auto:
        lines += [f"`model.dtype: auto` picks {', '.join(sorted(auto))} on this machine "
                  "(basis_lite.model.dtypes: the CPU flags and the cached whole-step check).", ""]
    for tag in [""] + list(capped):
        gemms = []
        for dt in PEAK_DTYPES:  # each dtype's GEMMs from the latest run of that dtype with these caps
            of = [r for r in runs if caps_tag(r.get("kernel_caps")) == tag and r["dtype"] == dt]
            if of:
                last = max(of, key=lambda r: r.get("created", ""))
                gemms += [g for g in last["peak"]["gemms"] if g["dtype"] == dt]
        if not gemms:
            continue
        lines += [f"## Matmul peak{tag} (latest run of each dtype{' with these caps' if tag else ''})", ""]
        lines.append(markdown_table(("dtype", "M x K x N", "layout", "GFLOP/s", "note"),
                                    [[g["dtype"], "x".join(map(str, g["shape"])), g["layout"],
                                      fmt(g.get("gflops"), ".1f"), g.get("note", "")] for g in gemms]))
        lines.append("")
        bw = [r["peak"]["bandwidth"] for r in runs if caps_tag(r.get("kernel_caps")) == tag
              and r.get("peak", {}).get("bandwidth")]
        if bw:
            lines += [f"Memory bandwidth{tag}: {bw[-1]['read_gbs']:.1f} GB/s read, {bw[-1]['copy_gbs']:.1f} GB/s "
                      f"copied (read + written), a {bw[-1]['mib']} MiB float32 buffer, {bw[-1]['threads']} threads "
                      "(bench/lib/matmul_peak.py: measure_bandwidth). A part's \"x bandwidth\" is its seconds over "
                      "the time reading its \"GB read\" once at the read rate would take: decode reads every "
                      "weight copy once per forward. \"x bound\" sets the seconds against the larger of the two "
                      "times: a decode of many rows is bound by its FLOPs, one of few rows by its bytes.", ""]
    lines += ["`a@b`: contiguous [K, N] right operand; `a@w.T`: an [N, K] weight as nn.Linear stores it (torch's "
              "matmul: MKL in float32, oneDNN in bf16); `onednn`: that weight packed by oneDNN, its inner product "
              "(what the fast engine runs in float32). The peak of a dtype is its best row.", "",
              "## Step summary", "", markdown_table(SUMMARY_COLUMNS, step_summary(doc)), ""]
    tl = target_lines(doc)
    if tl:
        lines += [f"## Against the roofline target ({ROOFLINE_TARGET}x)", "",
                  "x roofline = the step's seconds over (its counted FLOPs / the measured GEMM peak of its dtype). "
                  "\"s over roofline\" is a part's seconds minus the time its FLOPs would take at that peak (all "
                  "of its seconds when no FLOPs are counted); the parts' gaps add up to the step's.", "", *tl, "",
                  markdown_table(GAP_COLUMNS, gap_rows(doc)), ""]
    cmp_rows = engine_comparison(doc)
    if len({r[1] for r in cmp_rows}) > 1:
        lines += ["## Generation, engines side by side (same prompts, max_new_tokens, temperature)", "",
                  markdown_table(COMPARISON_COLUMNS, cmp_rows), ""]
    mem = memory_rows(doc)
    if mem:
        lines += ["## Where the peak memory comes from", "",
                  "Per run, in the child process that measured it (`memory_breakdown` in bench/cpu_step_report.py says "
                  "how each line is obtained). Whole-job peaks (eval, first-run conversion): bench/job_memory.py.",
                  "", markdown_table(MEMORY_COLUMNS, mem), ""]
    lines += ["## Every part", "", markdown_table(TABLE_COLUMNS, [row_cells(r) for r in rows_of(doc)]), ""]
    return "\n".join(lines)
