"""Rollouts from the training model's own batched `generate()` (any device, any backend).

The engine IS the training model, so `sync` has nothing to push. Generation runs in eval mode under no_grad, which
keeps the KV cache on even when gradient checkpointing is enabled for training (transformers only applies
checkpointing, and turns the cache off, in train mode).

Prompt features for BASIS similarity pooling come from the prefill that generate() runs anyway: a forward hook on
a middle decoder layer captures its output for the prompt tokens (left padded, so the last positions are the real
last tokens) and keeps the mean of the last `feature_tokens` positions. No extra model call.

Behaviour log-probs come from the same generate() call: a logits processor (run before the temperature and
top-k/top-p warpers) sees each step's float32 logits and keeps log softmax(logits / T) of the sampled token, the
quantity the trainer's chunked log-prob computes (T = 1 when greedy). It equals a separate forward pass to fp32
rounding: KV-cached decoding multiplies matrices of other shapes than one forward over the whole sequence.

With `params.inject` and an EAPO prior adapter (engines/eapo.py), sampling runs `eapo.generate_with_injection`
instead of generate(): the same rollouts, with the prior's tokens at critical decision points. That loop samples
from torch's global RNG, also when `params.seeds` asks for per-prompt streams.

Trajectory features (``with_trajectory=True``, for value probes) come from the same generate() call:
``engines.trajectory.TrajectoryCapture`` hooks the feature layer at every decoding step and reads each step's
scores through a logits processor that returns them unchanged. Without it neither is installed.

On the CPU (`fast_cpu="auto"`, config `generation.fast_cpu`), rollouts and eval take `engines.fast_cpu.FastDecoder`
instead of generate(): weights built from the live adapter at each call (merged over a float32 base, the adapter
in float32 beside a bf16 one; the base is never written), a KV cache allocated once per call, finished rows
dropped, the shared prompt prefix prefilled once. It returns the same
Rollout fields (log-probs at the sampling temperature, prompt features, per-prompt seeds). It falls back to
generate() for trajectory features, EAPO injection, and models or adapters it does not support
(`fast_cpu_fallback` says why).
"""
from __future__ import annotations

import dataclasses

import torch
from transformers import LogitsProcessorList

from ..model.loading import decoder_layers, inference_mode
from . import engine
from .base import Rollout, SamplingParams, nonfinite_rows, stop_token_ids
from .seeded import row_seeds, seeded_logits_processor
from .trajectory import TrajectoryCapture


class SampledLogprobs:
    """A generate() logits processor that records log softmax(logits / T) of each sampled token, per row.

    Call k sees the token sampled at step k-1 as input_ids[:, -1] and looks it up in the previous step's
    log-probs; `finish(sequences)` looks up the last step's. Scores pass through unchanged, except a row holding
    NaN or +inf (a diverged adapter, `nonfinite_rows`): it is marked in `bad` and replaced by zeros, so that
    sampling finishes (torch's multinomial refuses such a row) and the caller can skip what it produced.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature if temperature > 0 else 1.0
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []
        self.bad: torch.Tensor | None = None  # [rows] a row had non-finite logits at some step

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        z = scores.float()
        if self.temperature != 1.0:
            z = z / self.temperature
        self.prev = z - torch.logsumexp(z, dim=-1, keepdim=True)
        bad = nonfinite_rows(scores)
        self.bad = bad if self.bad is None else self.bad | bad
        if bool(bad.any()):
            scores = torch.where(bad[:, None], torch.zeros_like(scores), scores)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[rows, generated steps] log-probs of the generated tokens."""
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, sequences[:, -1:]).squeeze(-1))
            self.prev = None
        return torch.stack(self.steps, dim=1).cpu() if self.steps else torch.zeros(sequences.shape[0], 0)


class HFEngine:
    name = "hf"

    def __init__(self, model, tokenizer, batch_size: int = 64, max_prompt_tokens: int = 448,
                 feature_layer: int | None = None, feature_tokens: int = 4, eapo=None, trajectory_tokens: int = 4,
                 fast_cpu: str = "auto"):
        self.model, self.tok = model, tokenizer
        self.batch_size = batch_size
        self.max_prompt_tokens = max_prompt_tokens
        layers = decoder_layers(model)
        self.feature_layer = len(layers) // 2 if feature_layer is None else feature_layer
        self.feature_tokens = feature_tokens
        self.trajectory_tokens = trajectory_tokens
        self.trajectory_seconds = 0.0  # time spent in the trajectory capture, summed over generate() calls
        self._layers = layers
        self.stop_ids = sorted(stop_token_ids(tokenizer, model))
        self.eapo = eapo  # EapoConfig with a prior adapter loaded on the model, or None
        if fast_cpu not in ("auto", "off"):
            raise ValueError(f"fast_cpu={fast_cpu!r}; accepted: auto, off")
        self.fast_cpu = fast_cpu
        self._fast = None  # engines.fast_cpu.FastDecoder, built at the first rollout that can use it
        self.fast_cpu_fallback: str | None = None if fast_cpu == "auto" else "generation.fast_cpu=off"

    def fast_decoder(self):
        """The FastDecoder for this model, or None (reason in `fast_cpu_fallback`)."""
        if self._fast is None and self.fast_cpu == "auto" and self.fast_cpu_fallback is None:
            from .fast_cpu import FastDecoder, why_not

            self.fast_cpu_fallback = why_not(self.model)
            if self.fast_cpu_fallback is None:
                self._fast = FastDecoder(self.model)
        return self._fast

    def sync(self, model=None) -> None:  # the engine shares the training model: nothing to push
        return None

    def _encode(self, prompts: list[str]):
        # left padding for batched generation; over-long prompts lose their START (the question and the
        # generation prompt at the end are kept)
        self.tok.padding_side = "left"
        self.tok.truncation_side = "left"
        return self.tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False,
                        truncation=True, max_length=self.max_prompt_tokens)

    def generate(self, prompts: list[str], params: SamplingParams, with_features: bool = True,
                 with_trajectory: bool = False) -> list[Rollout]:
        """n = params.n samples per prompt, prompt-major; generate() is called on chunks of batch_size sequences."""
        per_call = max(1, self.batch_size // max(1, params.n))
        out: list[Rollout] = []
        try:
            for start in range(0, len(prompts), per_call):
                chunk = params if params.seeds is None else dataclasses.replace(
                    params, seeds=params.seeds[start:start + per_call])
                out.extend(self._generate_chunk(prompts[start:start + per_call], chunk, with_features,
                                                  with_trajectory))
        finally:
            if self._fast is not None:  # its weight copies live during rollouts only
                self._fast.release()
        return out

    def _generate_chunk(self, prompts: list[str], params: SamplingParams, with_features: bool,
                        with_trajectory: bool = False) -> list[Rollout]:
        model, tok = self.model, self.tok
        device = next(model.parameters()).device
        enc = self._encode(prompts)
        input_ids = enc.input_ids.to(device)
        attn = enc.attention_mask.to(device)
        captured: list[torch.Tensor] = []

        def hook(_module, _inp, output):
            if not captured:  # the first call is the prefill over the whole prompt
                h = output[0] if isinstance(output, tuple) else output
                captured.append(h[:, -self.feature_tokens:, :].float().mean(dim=1).cpu())

        greedy = params.temperature <= 0
        if params.inject and self.eapo is not None and not greedy:
            return self._generate_injected(prompts, input_ids, attn, params, with_features)
        if not with_trajectory and self.fast_decoder() is not None:  # trajectory features: generate() below
            return self._generate_fast(prompts, input_ids, attn, params, with_features)
        # logits processors, in this order: the recorders see the model's logits (they return them unchanged),
        # then the per-prompt sampler (it returns a one-hot row) when seeds are given
        record = SampledLogprobs(params.temperature)
        processors: list = [record]
        capture = None
        if with_trajectory:
            capture = TrajectoryCapture(input_ids.shape[1], params.max_new_tokens, self.stop_ids, params.temperature,
                                        self.trajectory_tokens)
            processors.append(capture)
        gen_kwargs = dict(max_new_tokens=params.max_new_tokens, do_sample=not greedy, pad_token_id=tok.pad_token_id,
                          eos_token_id=self.stop_ids, use_cache=True, num_return_sequences=params.n)
        if not greedy:
            # top_k=0 disables top-k explicitly: None would fall back to the model's generation_config (often
            # top_k=50), sampling from a truncated distribution the loss does not know about
            gen_kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
            if params.seeds is not None:  # per-prompt streams: the processor picks the token, multinomial keeps it
                processors.extend(seeded_logits_processor(params.seeds, params.n, params.temperature, params.top_p,
                                                          params.top_k))
        else:
            gen_kwargs.update(temperature=None, top_p=None, top_k=None)
        gen_kwargs["logits_processor"] = LogitsProcessorList(processors)
        handle = self._layers[self.feature_layer].register_forward_hook(hook) if with_features else None
        if capture is not None:
            capture.attach(self._layers[self.feature_layer])
        try:
            with inference_mode(model):
                seqs = model.generate(input_ids=input_ids, attention_mask=attn, **gen_kwargs)
        finally:
            if handle is not None:
                handle.remove()
            if capture is not None:
                capture.detach()
        # generate() expands the batch to P*n rows BEFORE the prefill, so the hook saw one row per sequence
        feats = captured[0] if captured else None
        lps = record.finish(seqs)
        prompt_len = input_ids.shape[1]
        rollouts = []
        for row in range(seqs.shape[0]):
            p = row // params.n
            p_ids = input_ids[p][attn[p].bool()].tolist()
            comp = seqs[row, prompt_len:].tolist()
            stop = next((i for i, t in enumerate(comp) if t in self.stop_ids), None)
            finished = stop is not None
            if finished:  # keep the stop token: the trainer scores the decision to stop too
                comp = comp[: stop + 1]
            text = tok.decode(comp, skip_special_tokens=True)
            feat = None if feats is None else feats[row]
            finite = not (record.bad is not None and bool(record.bad[row])) and (
                feat is None or bool(torch.isfinite(feat).all()))
            rollouts.append(Rollout(prompt=prompts[p], prompt_ids=p_ids, completion_ids=comp, text=text,
                                    finished=finished, feature=feat, logprobs=lps[row, :len(comp)].tolist(),
                                    finite=finite))
        if capture is not None:
            import time

            t0 = time.perf_counter()
            capture.finish(seqs)
            trajs = capture.features([r.completion_ids for r in rollouts], [r.finished for r in rollouts], tok)
            for r, t in zip(rollouts, trajs):
                r.trajectory = t
            self.trajectory_seconds += capture.seconds + time.perf_counter() - t0
        return rollouts

    def _generate_fast(self, prompts, input_ids, attn, params: SamplingParams, with_features: bool):
        """Rollouts from the FastDecoder (engines/fast_cpu.py), rows laid out as generate() lays them out."""
        p_ids = [input_ids[p][attn[p].bool()].tolist() for p in range(len(prompts))]
        rows = [ids for ids in p_ids for _ in range(params.n)]
        gens = None
        if params.seeds is not None and params.temperature > 0:
            gens = [torch.Generator().manual_seed(s) for s in row_seeds(params.seeds, params.n)]
        with inference_mode(self.model):
            toks, lps, feats, finite = self._fast.generate(
                rows, params.max_new_tokens, self.stop_ids, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, generators=gens, feature_layer=self.feature_layer if with_features else None,
                feature_tokens=self.feature_tokens)
        stops = set(self.stop_ids)
        return [Rollout(prompt=prompts[row // params.n], prompt_ids=rows[row], completion_ids=comp,
                        text=self.tok.decode(comp, skip_special_tokens=True),
                        finished=bool(comp) and comp[-1] in stops, feature=None if feats is None else feats[row],
                        logprobs=lps[row], finite=finite[row]) for row, comp in enumerate(toks)]

    def _generate_injected(self, prompts, input_ids, attn, params: SamplingParams, with_features: bool):
        """EAPO rollouts: the prior adapter samples the tokens at critical decision points (engines/eapo.py)."""
        from .eapo import generate_with_injection

        e = self.eapo
        with inference_mode(self.model):
            res = generate_with_injection(
                self.model, input_ids, attn, params, stop_ids=self.stop_ids, pad_id=self.tok.pad_token_id,
                threshold=e.entropy_threshold, rate=e.injection_rate,
                feature_layer=self._layers[self.feature_layer] if with_features else None,
                feature_tokens=self.feature_tokens)
        rollouts = []
        for row, comp in enumerate(res["tokens"]):
            p = row // params.n
            finished = bool(comp) and comp[-1] in self.stop_ids
            rollouts.append(Rollout(
                prompt=prompts[p], prompt_ids=input_ids[p][attn[p].bool()].tolist(), completion_ids=comp,
                text=self.tok.decode(comp, skip_special_tokens=True), finished=finished,
                feature=None if res["features"] is None else res["features"][row], logprobs=res["policy_lp"][row],
                injected=res["injected"][row], prior_logprobs=res["prior_lp"][row]))
        return rollouts


@engine("hf", "fast_cpu")
def build_engine(cfg, model, tok, *, max_prompt_tokens: int, backend: str = "hf", with_prior: bool = False):
    """The `hf` and `fast_cpu` engines (engines/__init__.py): the fast CPU path is on with generation.fast_cpu auto
    (it needs the model on the CPU); with `with_prior`, EAPO injects the prior adapter loaded on the model."""
    return HFEngine(model, tok, batch_size=cfg.generation.batch_size, max_prompt_tokens=max_prompt_tokens,
                    eapo=cfg.eapo if with_prior else None, fast_cpu=cfg.generation.fast_cpu)
