"""ggml_quants.dequantize equals gguf.quants.dequantize bit for bit on every format kept here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine.kernels import ggml_quants
from engine.kernels.ggml_quants import FORMATS, dequantize, format_of, random_rows, row_bytes

# gguf implements quantize for these; the K-quants only dequantize there.
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_formats_match_gguf(fmt):
    spec = FORMATS[fmt]
    qtype = GGMLQuantizationType[fmt]
    assert spec.ggml_type == int(qtype)
    assert (spec.block_size, spec.type_size) == GGML_QUANT_SIZES[qtype]
    assert format_of(int(qtype)) is spec


def test_format_of_unknown_types():
    assert format_of(int(GGMLQuantizationType.F32)) is None
    assert format_of(int(GGMLQuantizationType.IQ2_XS)) is None


def _assert_bitwise(fmt: str, data: torch.Tensor, in_features: int) -> None:
    ours = dequantize(fmt, data, in_features)
    theirs = gguf_dequantize(data.numpy(), GGMLQuantizationType[fmt])
    assert ours.dtype == torch.float32 and ours.shape == (data.shape[0], in_features)
    assert theirs.shape == ours.shape
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("blocks", [1, 3])
def test_random_blocks_equal_gguf(fmt, blocks):
    # every bit pattern of the packed values and integer scales; the fp16 fields finite
    generator = torch.Generator().manual_seed(blocks)
    in_features = blocks * FORMATS[fmt].block_size
    data = random_rows(fmt, 37, in_features, generator)
    assert data.shape == (37, row_bytes(fmt, in_features))
    _assert_bitwise(fmt, data, in_features)


@pytest.mark.parametrize("fmt", QUANTIZABLE)
def test_quantized_floats_equal_gguf(fmt):
    values = np.random.default_rng(0).standard_normal((19, 160)).astype(np.float32)
    data = torch.from_numpy(gguf_quantize(values, GGMLQuantizationType[fmt]))
    _assert_bitwise(fmt, data, 160)
    # and it is a dequantization: close to what was quantized (the coarsest step: Q4_0's)
    assert np.abs(dequantize(fmt, data, 160).numpy() - values).max() < 0.6


def test_random_rows_fields_are_finite():
    generator = torch.Generator().manual_seed(0)
    for fmt in FORMATS:
        values = dequantize(fmt, random_rows(fmt, 8, 512, generator), 512)
        assert torch.isfinite(values).all(), fmt
        assert 0.05 < values.abs().max() < 4, fmt


def test_row_bytes_and_errors():
    assert row_bytes("Q4_K", 512) == 2 * 144
    assert row_bytes("Q8_0", 64) == 68
    with pytest.raises(ValueError, match="Q4_K stores rows in blocks of 256 values; "
                                         "in_features=288"):
        row_bytes("Q4_K", 288)
    with pytest.raises(ValueError, match="unknown ggml format 'Q3_K'"):
        row_bytes("Q3_K", 256)
    with pytest.raises(ValueError, match=r"Q8_0 data must be uint8 \[rows, 34\]"):
        dequantize("Q8_0", torch.zeros(2, 35, dtype=torch.uint8), 32)


def test_half_fields_cover_every_format():
    assert set(ggml_quants.HALF_FIELDS) == set(FORMATS)
