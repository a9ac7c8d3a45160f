"""QuantWeight: pack's checks, the reference product, rows(), raw() and to()."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.ggml_quants import FORMATS, dequantize, random_rows, row_bytes
from engine.kernels.quant_gemm import QuantWeight, kernel_formats, linear_reference, pack


def _weight(fmt: str, out_features: int, in_features: int, seed: int = 0) -> tuple[
        QuantWeight, torch.Tensor]:
    data = random_rows(fmt, out_features, in_features, torch.Generator().manual_seed(seed))
    return pack(fmt, data, in_features), data


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_pack_keeps_ggml_bytes(fmt):
    in_features = 2 * FORMATS[fmt].block_size
    w, data = _weight(fmt, 21, in_features)
    assert (w.fmt, w.out_features, w.in_features) == (fmt, 21, in_features)
    assert torch.equal(w.raw(), data)
    assert torch.equal(w.dequantize(), dequantize(fmt, data, in_features))
    assert w.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert w.nbytes <= 1.15 * data.nbytes


def test_pack_errors():
    with pytest.raises(ValueError, match=r"Q4_K expects 288 bytes a row \(2 blocks of 144 "
                                         r"bytes for 512 values\), got 287"):
        pack("Q4_K", torch.zeros(4, 287, dtype=torch.uint8), 512)
    with pytest.raises(ValueError, match="2-D uint8"):
        pack("Q8_0", torch.zeros(4, 34), 32)
    with pytest.raises(ValueError, match="2-D uint8"):
        pack("Q8_0", torch.zeros(34, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="blocks of 32 values; in_features=40"):
        pack("Q8_0", torch.zeros(4, 34, dtype=torch.uint8), 40)
    with pytest.raises(ValueError, match="unknown ggml format"):
        pack("F16", torch.zeros(4, 34, dtype=torch.uint8), 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_is_the_dequantized_product(dtype, with_bias):
    w, data = _weight("Q4_K", 13, 512)
    x = torch.randn(2, 5, 512).to(dtype)
    bias = torch.randn(13) if with_bias else None
    dense = dequantize("Q4_K", data, 512)
    expected = x.float() @ dense.T + (bias if bias is not None else 0)
    out = linear_reference(x, w, bias)
    assert out.shape == (2, 5, 13) and out.dtype == dtype
    torch.testing.assert_close(out, expected.to(dtype), rtol=0, atol=0)
    with pytest.raises(ValueError, match="x has 256 features, the weight takes 512"):
        linear_reference(torch.randn(3, 256), w)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q6_K"])
def test_rows_are_the_dequantized_rows(fmt):
    w, _ = _weight(fmt, 40, 256)
    ids = torch.tensor([[3, 0, 39], [3, 17, 8]])
    got = w.rows(ids, torch.float32)
    assert got.shape == (2, 3, 256)
    assert torch.equal(got, w.dequantize()[ids])
    assert torch.equal(w.rows(ids, torch.bfloat16), w.dequantize(torch.bfloat16)[ids])


def test_to_moves_the_bytes():
    w, data = _weight("Q5_0", 9, 64)
    moved = w.to("cpu")
    assert torch.equal(moved.raw(), data) and moved.device.type == "cpu"


def test_kernel_formats_are_known_formats():
    assert kernel_formats() <= set(FORMATS)


def test_row_bytes_of_a_packed_weight():
    w, _ = _weight("Q5_K", 3, 768)
    assert w.raw().shape == (3, row_bytes("Q5_K", 768))
