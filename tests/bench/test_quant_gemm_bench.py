"""``bench.quant_gemm`` times the kernel against the dense path over a decode step's linears
and prints each linear, the step's sums and the resident bytes."""

from __future__ import annotations

import pytest

from bench import quant_gemm
from engine.kernels.quant_gemm import kernel_formats


@pytest.mark.skipif(not kernel_formats(), reason="no CPU kernels here")
def test_prints_each_linear_the_step_and_the_bytes(capsys):
    assert quant_gemm.main(["--rows", "1,3", "--calls", "1", "--layers", "2",
                            "--shapes", "o_proj,v_proj"]) == 0
    out = capsys.readouterr().out
    assert "quantized kernel: " in out and "dense fp32: " in out
    lines = [line.split() for line in out.splitlines()]
    timed = [line for line in lines if line and line[0] in ("o_proj", "v_proj")]
    # o_proj in both models, v_proj in Gemma 3's: each at 1 and 3 rows
    assert [(line[0], line[1], line[4]) for line in timed] == [
        ("o_proj", "Q4_1", "1"), ("o_proj", "Q4_1", "3"), ("v_proj", "Q8_0", "1"),
        ("o_proj", "Q4_K", "1"), ("v_proj", "Q8_0", "3"), ("o_proj", "Q4_K", "3")]
    assert all(float(line[5]) > 0 and float(line[6]) > 0 and line[7].endswith("x")
               for line in timed)
    steps = [line for line in lines if line[:1] == ["step"] and len(line) > 3]
    assert [line[1] for line in steps] == ["1", "3", "1", "3"]
    assert all(float(line[2]) > 0 and line[4].endswith("x") for line in steps)
    assert out.count("resident ") == 3 and "(1.000x)" in out and "(1.028x)" in out


def test_unknown_models_are_refused():
    with pytest.raises(SystemExit):
        quant_gemm.main(["--models", "llama-7b"])
