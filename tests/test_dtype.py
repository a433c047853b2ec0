"""model.dtype: auto on a CPU picks bf16 only with native bf16 flags AND a timing that confirms it; an explicit
bfloat16 on a CPU without native bf16 warns with the measured slowdown. The flags and the timing are replaced here
(the CPU this runs on has whatever flags it has); the last test runs the real timing once."""
from __future__ import annotations

import logging

import pytest
import torch

from basis_lite import models
from basis_lite.models import Bf16Check, resolve_dtype

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_check():
    models.cpu_bf16_check.cache_clear()
    yield
    models.cpu_bf16_check.cache_clear()


def test_auto_without_native_flags_is_float32_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(models, "cpu_bf16_flags", lambda: ())
    monkeypatch.setattr(models, "cpu_bf16_check", lambda: pytest.fail("no timing is needed without the flags"))
    with caplog.at_level(logging.INFO, logger="basis_lite"):
        assert resolve_dtype("auto", CPU) == torch.float32
    assert "float32" in caplog.text and "no native bf16" in caplog.text


@pytest.mark.parametrize("bf16_ms, fp32_ms, want", [(2.0, 4.0, torch.bfloat16), (40.0, 4.0, torch.float32)])
def test_auto_with_flags_follows_the_timing(monkeypatch, caplog, bf16_ms, fp32_ms, want):
    monkeypatch.setattr(models, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    monkeypatch.setattr(models, "cpu_bf16_check", lambda: Bf16Check(("avx512_bf16",), bf16_ms, fp32_ms))
    with caplog.at_level(logging.INFO, logger="basis_lite"):
        assert resolve_dtype("auto", CPU) == want
    assert f"{bf16_ms:.1f} ms in bf16" in caplog.text


def test_explicit_bf16_without_native_support_runs_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(models, "cpu_bf16_check", lambda: Bf16Check((), 52.0, 4.0))
    with caplog.at_level(logging.WARNING, logger="basis_lite"):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert "13.0x" in caplog.text and "auto would pick float32" in caplog.text


def test_explicit_float32_never_times_anything(monkeypatch):
    monkeypatch.setattr(models, "cpu_bf16_check", lambda: pytest.fail("float32 needs no check"))
    assert resolve_dtype("float32", CPU) == torch.float32


def test_the_real_check_times_both_dtypes():
    check = models.cpu_bf16_check()
    assert check.bf16_ms > 0 and check.fp32_ms > 0
    assert set(check.flags) <= {"avx512_bf16", "amx_bf16"}
    assert check.fast == (bool(check.flags) and check.bf16_ms < check.fp32_ms)
