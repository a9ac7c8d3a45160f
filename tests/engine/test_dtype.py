"""``dtype="auto"``: bf16 on a GPU, fp32 on a CPU (bf16 there is opt-in until measured faster)."""

from __future__ import annotations

import pytest
import torch

import engine.layers.greedy_screen as greedy_screen
from engine import LLM
from engine.model_runner import resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_fp32_on_any_cpu(monkeypatch, native):
    monkeypatch.setattr(greedy_screen, "bf16_is_native", lambda: native)
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", CUDA) == torch.bfloat16  # the GPU's choice is unchanged
    # an explicit dtype is taken as given: float32 is the exact mode everywhere
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16


def test_the_engine_resolves_auto_on_this_machine(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu")  # dtype defaults to auto
    runner = llm.engine.model_runner
    want = torch.float32
    assert runner.dtype == want
    assert runner.kv_cache.dtype == want
    assert runner.model.lm_head.weight.dtype == want
