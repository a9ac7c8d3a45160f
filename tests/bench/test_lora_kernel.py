"""``bench.lora_kernel`` runs the kernel on a decode step's shapes and prints a layer's totals."""

from __future__ import annotations

import pytest
import torch

from bench import lora_kernel
from engine.kernels import cpu_decode_attention
from engine.layers.linear import onednn_packing_available


@pytest.mark.skipif(cpu_decode_attention.load() is None, reason="no CPU kernels here")
def test_prints_each_projection_and_a_layers_totals(capsys):
    assert lora_kernel.main(["--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for name in lora_kernel.SHAPES:
        assert out.count(name) == 2  # fp32 and bf16
    assert out.count("a layer: kernel") == 2 and "GB/s" in out


@pytest.mark.skipif(cpu_decode_attention.load() is None, reason="no CPU kernels here")
def test_prompt_length_segments_are_timed_against_onednn(capsys):
    assert lora_kernel.main(["--repeats", "1", "--rows-per-adapter", "32"]) == 0
    out = capsys.readouterr().out
    packed = sum(onednn_packing_available(d) for d in (torch.float32, torch.bfloat16))
    assert out.count("oneDNN's LoRA") == packed * (len(lora_kernel.SHAPES) + 1)
    assert out.count("x faster") == packed


@pytest.mark.skipif(cpu_decode_attention.load() is None, reason="no CPU kernels here")
def test_a_whole_step_over_layers_of_their_own(capsys):
    assert lora_kernel.main(["--repeats", "2", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("a step over 2 layers: kernel median") == 2  # fp32 and bf16
    assert "a layer" not in out
