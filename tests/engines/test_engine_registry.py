"""The engine table (basis_lite/engines/__init__.py): which engine a run builds, the config's choices and checks read
from it, no code outside engines/ comparing an engine's name, and the CONTRIBUTING.md recipe "Add a rollout engine"
followed with a throwaway engine built on the tiny model by `runtime.make_engine`."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from basis_lite import engines
from basis_lite.config import FIELDS, ConfigError, load_config
from basis_lite.config.fields import choices_of, help_text
from basis_lite.engines import EngineSpec, engine, get_engine, select_engine
from basis_lite.engines.base import Engine, Rollout, SamplingParams, stop_token_ids
from basis_lite.engines.hf import HFEngine
from basis_lite.model.loading import load_policy
from basis_lite.rl.update import mismatch_correction_on
from basis_lite.runtime import make_engine

PKG = Path(__file__).resolve().parents[2] / "basis_lite"
PROMPTS = ["<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    cfg = load_config("smoke")
    model, tok = load_policy(cfg, torch.device("cpu"), torch.float32)
    return cfg, model, tok


@pytest.mark.parametrize("overrides,backend,device,want", [
    ([], "hf", "cpu", "fast_cpu"),
    (["generation.fast_cpu=off"], "hf", "cpu", "hf"),
    ([], "hf", "cuda", "hf"),
    (["generation.engine=vllm"], "hf", "cpu", "vllm"),
    (["generation.engine=vllm"], "unsloth", "cuda", "unsloth_vllm"),
    (["generation.engine=vllm", "model.fast_inference=false"], "unsloth", "cuda", "vllm"),
])
def test_select_engine_by_value_backend_and_device(overrides, backend, device, want):
    assert select_engine(load_config("smoke", overrides), backend, device).name == want


def test_make_engine_builds_the_selected_engine(policy):
    cfg, model, tok = policy
    eng = make_engine(cfg, model, tok)
    assert isinstance(eng, HFEngine) and eng.fast_decoder() is not None  # fast_cpu: the fast path on
    off = make_engine(load_config("smoke", ["generation.fast_cpu=off"]), model, tok)
    assert isinstance(off, HFEngine) and off.fast_decoder() is None
    with pytest.raises(Exception, match="cannot inject"):  # an engine without eapo refuses the prior adapter
        get_engine("vllm").build(cfg, model, tok, max_prompt_tokens=16, with_prior=True)


def test_config_reads_the_engine_table():
    f = FIELDS["generation.engine"]
    assert choices_of(f) == engines.engine_choices() == ("hf", "vllm")
    assert all(f"{n} ({get_engine(n).summary})" in help_text(f) for n in choices_of(f))
    assert "generation.engine vllm" in help_text(FIELDS["train.mismatch_correction"])
    with pytest.raises(ConfigError, match="generation.engine: 'fast_cpu' is not accepted; choose one of hf, vllm"):
        load_config("smoke", ["generation.engine=fast_cpu"])  # an engine chosen by `when` is no value of its own
    with pytest.raises(ConfigError, match="runs on generation.engine=hf only, not 'vllm'"):
        load_config("smoke", ["generation.engine=vllm", "eapo.prior_adapter=some/adapter"])
    assert mismatch_correction_on(load_config("smoke", ["generation.engine=vllm"]))
    assert not mismatch_correction_on(load_config("smoke"))


def test_register_refuses_an_engine_that_contradicts_its_value():
    with pytest.raises(ValueError, match="mismatch_correction differ from 'hf'"):
        engines.register(EngineSpec("hf_odd", choice="hf", when=lambda c, b, d: False, mismatch_correction=True,
                                    eapo=True, shares_model=True))
    with pytest.raises(ValueError, match="needs `when`"):
        engines.register(EngineSpec("hf_odd", choice="hf"))
    with pytest.raises(ValueError, match="memory 'disk'"):
        engines.register(EngineSpec("odd", memory="disk"))
    with pytest.raises(ValueError, match="already registered"):
        engines.register(EngineSpec("hf"))
    assert "hf_odd" not in engines.engine_names() and "odd" not in engines.engine_names()


def test_config_checks_read_capabilities_of_a_registered_engine():
    engines.register(EngineSpec("gpu_only", summary="a GPU-only engine", needs_gpu=True, behaviour_logprobs=False))
    try:
        with pytest.raises(ConfigError, match="gpu_only needs a CUDA GPU, and device is cpu.*one of hf, vllm"):
            load_config("smoke", ["device=cpu", "generation.engine=gpu_only"])
        with pytest.raises(ConfigError, match="train.mismatch_correction: always needs the engine's log-probs"):
            load_config("smoke", ["device=auto", "generation.engine=gpu_only", "train.mismatch_correction=always"])
        with pytest.raises(ConfigError, match="runs on generation.engine=hf only, not 'gpu_only'"):
            load_config("smoke", ["device=auto", "generation.engine=gpu_only", "eapo.prior_adapter=x"])
        assert load_config("smoke", ["device=auto", "generation.engine=gpu_only"]).generation.engine == "gpu_only"
    finally:
        engines.unregister("gpu_only")
    assert "gpu_only" not in engines.engine_choices()


def _compares_engine_name(node: ast.AST) -> bool:
    """`x.generation.engine` (or `g.engine`) on either side of a comparison."""
    if not isinstance(node, ast.Compare):
        return False
    return any(isinstance(n, ast.Attribute) and n.attr == "engine" for n in (node.left, *node.comparators))


def test_no_code_outside_engines_compares_an_engine_name():
    found = []
    for path in PKG.rglob("*.py"):
        if path.parent.name == "engines":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _compares_engine_name(node):
                found.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert found == []
    assert _compares_engine_name(ast.parse("cfg.generation.engine != 'hf'").body[0].value)  # the check can fail


# ---------------------------------------------------------------------------------------------------------------
# CONTRIBUTING.md, "Add a rollout engine": the engine module, its @engine factory, one registration


class GreedyEngine:
    """A throwaway engine for the recipe: greedy decoding by one full forward per token (no KV cache), with the
    sampled tokens' log-probs; it generates with the training model itself."""

    name = "greedy_test"
    trajectory_seconds = 0.0  # it computes no trajectory features

    def __init__(self, model, tok, max_prompt_tokens: int):
        self.model, self.tok, self.max_prompt_tokens = model, tok, max_prompt_tokens
        self.stop_ids = stop_token_ids(tok, model)

    def sync(self, model=None) -> None:
        return None

    def generate(self, prompts, params: SamplingParams, with_features: bool = True,
                 with_trajectory: bool = False) -> list[Rollout]:
        assert params.temperature == 0, "greedy only"
        out = []
        for prompt in prompts:
            ids = self.tok(prompt, add_special_tokens=False).input_ids[-self.max_prompt_tokens:]
            comp, lps = [], []
            with torch.no_grad():
                for _ in range(params.max_new_tokens):
                    logits = self.model(input_ids=torch.tensor([ids + comp])).logits[0, -1].float()
                    tok_id = int(logits.argmax())
                    comp.append(tok_id)
                    lps.append(float(torch.log_softmax(logits, -1)[tok_id]))
                    if tok_id in self.stop_ids:
                        break
            out += [Rollout(prompt=prompt, prompt_ids=list(ids), completion_ids=comp,
                            text=self.tok.decode(comp, skip_special_tokens=True),
                            finished=comp[-1] in self.stop_ids, logprobs=lps)] * params.n
        return out


@engine("greedy_test")
def build_greedy_test(cfg, model, tok, *, max_prompt_tokens: int, backend: str = "hf", with_prior: bool = False):
    return GreedyEngine(model, tok, max_prompt_tokens)


@pytest.fixture
def greedy_engine():
    engines.register(EngineSpec("greedy_test", summary="greedy decoding, for a test",
                                description="greedy_test (one forward per token)", shares_model=True))
    yield
    engines.unregister("greedy_test")


def test_recipe_add_an_engine_builds_it_through_make_engine(policy, greedy_engine):
    _, model, tok = policy
    cfg = load_config("smoke", ["generation.engine=greedy_test", "generation.max_new_tokens=6"])
    assert "greedy_test (greedy decoding, for a test)" in help_text(FIELDS["generation.engine"])
    assert not mismatch_correction_on(cfg)
    eng = make_engine(cfg, model, tok)
    assert isinstance(eng, GreedyEngine) and isinstance(eng, Engine)  # the protocol's members, all there
    assert eng.max_prompt_tokens == 128 - 6  # prompt_budget(cfg)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    got = eng.generate(PROMPTS, params)
    want = HFEngine(model, tok, fast_cpu="off").generate(PROMPTS, params, with_features=False)
    assert [r.completion_ids for r in got] == [r.completion_ids for r in want]  # as the HF engine's greedy output
    assert all(len(r.logprobs) == len(r.completion_ids) for r in got)
    assert select_engine(cfg, "hf", "cpu").name == "greedy_test"
