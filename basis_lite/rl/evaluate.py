"""Held-out evaluation: greedy pass@1 and sampled pass@k, with a per-difficulty breakdown."""
from __future__ import annotations

import math
from collections import defaultdict

from tqdm.auto import tqdm

from ..data import format_prompt
from ..engines.base import SamplingParams
from ..rewards.answers import correctness, extracted_answer


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate(engine, tokenizer, examples, data_cfg, max_new_tokens: int = 64, require_boxed: bool = True,
             sampled: SamplingParams | None = None, batch_size: int = 64, progress: bool = True, desc: str = "eval",
             records: list | None = None) -> dict:
    """Greedy accuracy (pass@1) on `examples`, up to `max_new_tokens` tokens each; with `sampled` also k =
    sampled.n completions per problem drawn with those sampling parameters: sampled pass@1 and pass@k.

    Returns {"accuracy", "n", "by_level": {level: {"accuracy", "n"}}, ["pass@1_sampled", "pass@k", "k"]};
    "accuracy" is None when `examples` is empty. With a `records` list, one dict per problem is appended to it
    (the greedy answer): id, prompt (as the dataset gives it), prompt_text (as the model saw it), completion,
    extracted (the answer the check read, or None), gold, correct (bool), level (None where unknown).
    """
    prompts = [format_prompt(tokenizer, ex.prompt, data_cfg) for ex in examples]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    correct = []
    bar = tqdm(total=len(prompts), desc=desc, disable=not progress, leave=False)
    for i in range(0, len(prompts), batch_size):
        rolls = engine.generate(prompts[i:i + batch_size], greedy, with_features=False)
        for j, (ex, r) in enumerate(zip(examples[i:i + batch_size], rolls)):
            correct.append(correctness(r.text, ex.answer, require_boxed=require_boxed))
            if records is not None:
                records.append({"id": ex.id, "prompt": ex.prompt, "prompt_text": prompts[i + j],
                                "completion": r.text, "extracted": extracted_answer(r.text, require_boxed),
                                "gold": ex.answer, "correct": bool(correct[-1]), "level": ex.meta.get("level")})
        bar.update(len(rolls))
    bar.close()
    # no examples: no accuracy (None), never a 0.000 that reads like a measured one
    out = {"accuracy": sum(correct) / len(correct) if correct else None, "n": len(correct)}
    groups: dict = defaultdict(list)
    for ex, c in zip(examples, correct):
        if "level" in ex.meta:
            groups[ex.meta["level"]].append(c)
    if groups:
        out["by_level"] = {str(k): {"accuracy": sum(v) / len(v), "n": len(v)} for k, v in sorted(groups.items())}
    if sampled is not None:
        samples = sampled.n
        p1, pk = [], []
        bar = tqdm(total=len(prompts), desc=f"{desc} pass@{samples}", disable=not progress, leave=False)
        per = max(1, batch_size // samples)
        for i in range(0, len(prompts), per):
            rolls = engine.generate(prompts[i:i + per], sampled, with_features=False)
            for j, ex in enumerate(examples[i:i + per]):
                c = sum(correctness(r.text, ex.answer, require_boxed=require_boxed)
                        for r in rolls[j * samples:(j + 1) * samples])
                p1.append(pass_at_k(samples, int(c), 1))
                pk.append(pass_at_k(samples, int(c), samples))
            bar.update(len(examples[i:i + per]))
        bar.close()
        out.update({"k": samples, "pass@1_sampled": sum(p1) / len(p1) if p1 else None,
                    f"pass@{samples}": sum(pk) / len(pk) if pk else None})
    return out
