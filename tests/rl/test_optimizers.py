"""The optimizer table (basis_lite/rl/optimizers.py): the config's choices and help, `auto` decided in one place,
every row bound to a function by @optimizer in rl/update.py, and the plan's optimizer state read from the row."""
from __future__ import annotations

import pytest
import torch

from basis_lite.config import FIELDS, load_config
from basis_lite.config.fields import choices_of, help_text
from basis_lite.plan import estimate_memory
from basis_lite.rl import update
from basis_lite.rl.optimizers import OPTIMIZERS, optimizer_names, resolve_optimizer


def test_config_choices_and_help_come_from_the_table():
    f = FIELDS["train.optimizer"]
    assert choices_of(f) == optimizer_names() == ("auto", "adamw", "adamw8bit")
    assert all(n in help_text(f) for n in optimizer_names())
    assert "bitsandbytes AdamW8bit on CUDA, torch AdamW elsewhere" in help_text(f)


def test_auto_is_decided_once_and_every_row_has_a_function():
    assert resolve_optimizer("auto", "cuda") == "adamw8bit" and resolve_optimizer("auto", "cpu") == "adamw"
    assert resolve_optimizer("adamw8bit", "cpu") == "adamw8bit"
    lin = torch.nn.Linear(3, 2)
    opt = update.make_optimizer(load_config("smoke"), lin, torch.device("cpu"))  # auto on the CPU
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["params"] == list(lin.parameters())
    with pytest.raises(ValueError, match="no row in rl/optimizers.py"):
        update.optimizer("sgd")(lambda params, t: None)


def test_plan_counts_the_rows_state_bytes():
    for name, spec in OPTIMIZERS.items():
        parts = estimate_memory(load_config("gpu-8gb", [f"train.optimizer={name}"]))
        state = next(v for k, v in parts.items() if k == f"optimizer state ({name})")
        lora = next(v for k, v in parts.items() if k.startswith("LoRA r="))  # params + grads, 8 B each
        assert state == pytest.approx(lora / 8 * spec.state_bytes)
    auto = estimate_memory(load_config("gpu-8gb", ["train.optimizer=auto"]))
    assert "optimizer state (adamw8bit)" in auto  # a CUDA preset
