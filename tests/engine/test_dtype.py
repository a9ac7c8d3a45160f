"""``dtype="auto"``: bf16 on a GPU; on a CPU, bf16 where the CPU has bf16 units (measured 1.75x
fp32 there, the quality gate holding), fp32 elsewhere; an explicit dtype is taken as given."""

from __future__ import annotations

import pytest
import torch

import engine.runner.device as device
from engine import LLM
from engine.layers.linear import bf16_packing_available
from engine.runner.device import bf16_is_native, resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(("native", "packs", "want"), [
    (True, True, torch.bfloat16), (False, True, torch.float32), (True, False, torch.float32),
    (False, False, torch.float32),
])
def test_auto_on_a_cpu_is_bf16_only_where_it_is_native(monkeypatch, native, packs, want):
    monkeypatch.setattr(device, "bf16_is_native", lambda: native)
    monkeypatch.setattr(device, "bf16_packing_available", lambda: packs)
    assert resolve_dtype("auto", CPU) == want
    assert resolve_dtype("auto", CUDA) == torch.bfloat16  # the GPU's choice is unchanged
    # an explicit dtype is taken as given: float32 is the exact mode everywhere
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16


def test_the_engine_resolves_auto_on_this_machine(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu")  # dtype defaults to auto
    runner = llm.engine.model_runner
    native = bf16_is_native() and bf16_packing_available()
    want = torch.bfloat16 if native else torch.float32
    assert runner.dtype == want
    assert runner.kv_cache.dtype == want
    assert runner.model.lm_head.weight.dtype == want
