"""``bench.quantized`` on a tiny all-Q8_0 GGUF: each configuration in its own process, the
figures printed and written (weight bytes against the file's, tok/s, the quality gate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import quantized
from engine.kernels.quant_gemm import kernel_formats, pack
from tests.engine.test_quantized_loading import CASES, write_mixed_gguf


@pytest.mark.skipif("Q8_0" not in kernel_formats(), reason="no CPU kernels here")
def test_runs_keep_dequantize_and_the_gate_on_a_tiny_gguf(tmp_path: Path, capsys) -> None:
    arch, make, type_of = CASES["llama-q8_0"]
    model = write_mixed_gguf(tmp_path / "tiny.gguf", make()[0], arch, type_of)
    figures = tmp_path / "figures.json"
    quantized.main(["--models", str(model), "--num-requests", "3", "--quality-requests", "2",
                    "--max-output", "12", "--threads", "1", "--json", str(figures)])
    out = capsys.readouterr().out
    assert "keep / dequantize:" in out and "top-1 agreement" in out
    (result,) = json.loads(figures.read_text()).values()
    assert set(result["runs"]) == {"keep", "dequantize"}
    keep = result["runs"]["keep"]
    # the blocks and the F32 norms, nothing dequantized beside them
    assert result["bytes_ratio"] == pytest.approx(1.0, abs=0.02)
    # Q8_0 is 1.06 bytes a value: fp32 weights ~3.8x it, bf16 (a CPU with bf16 units) ~1.9x
    dense_over_kept = 3 if keep["dtype"] == "float32" else 1.5
    assert result["runs"]["dequantize"]["weight_bytes"] > dense_over_kept * keep["weight_bytes"]
    assert keep["output_tokens"] == result["runs"]["dequantize"]["output_tokens"]
    assert result["quality"]["positions"] > 0 and 0.0 <= result["quality"]["agreement"] <= 1.0
    # in bf16 (a CPU with bf16 units) the dense path's own agreement is printed beside it
    if result["quality"]["dtype"] != "float32":
        assert "for the dtype: dequantize (bfloat16)" in out
        assert 0.0 <= result["quality_dequantized"]["agreement"] <= 1.0
    else:
        assert "quality_dequantized" not in result


def test_resident_bytes_count_a_shared_storage_and_a_kept_weight_once() -> None:
    table = torch.nn.Embedding(8, 32)
    head = torch.nn.Linear(32, 8, bias=False)
    head.weight = table.weight  # tied: one storage
    kept = pack("Q8_0", torch.zeros(4, 34, dtype=torch.uint8), 32)
    model = torch.nn.ModuleDict({"table": table, "head": head})
    model.kept = [kept, kept]  # type: ignore[assignment]
    assert quantized.resident_weight_bytes(model) == 8 * 32 * 4 + kept.nbytes
