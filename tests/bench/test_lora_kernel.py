"""``bench.lora_kernel`` runs the kernel on a decode step's shapes and prints a layer's totals."""

from __future__ import annotations

import pytest

from bench import lora_kernel
from engine.kernels import cpu_decode_attention


@pytest.mark.skipif(cpu_decode_attention.load() is None, reason="no CPU kernels here")
def test_prints_each_projection_and_a_layers_totals(capsys):
    assert lora_kernel.main(["--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for name in lora_kernel.SHAPES:
        assert out.count(name) == 2  # fp32 and bf16
    assert out.count("a layer: kernel") == 2 and "GB/s" in out
