"""bench.cpu_gemm prints both libraries' figures for every shape and names cpu_gemm's pick."""

from __future__ import annotations

import pytest
import torch

from bench import cpu_gemm
from engine.layers.linear import fp32_gemm, mkl_packing_available, onednn_packing_available


def test_prints_every_shape_and_the_choice(capsys):
    if not (mkl_packing_available() and onednn_packing_available(torch.float32)):
        pytest.skip("needs both MKL and oneDNN fp32 packing")
    assert cpu_gemm.main(["--rows", "3,17", "--calls", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"cpu_gemm picks {fp32_gemm()}" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 2 * len(cpu_gemm.SHAPES)
    assert all(float(r[3]) > 0 and float(r[4]) > 0 and r[-1].endswith("x") for r in rows)
