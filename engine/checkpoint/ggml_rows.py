"""A quantized GGUF weight as ggml stores it, checked once, on its way to the model.

A 2-D weight in a block format (Q4_K, Q8_0, ...) is ``out_features`` rows of ``in_features``
values each, every row a run of fixed-size blocks: rows are independent, which is what lets the
loader un-permute llama's Q/K rows as bytes and the converted cache store them as a uint8
``[out_features, row_bytes]`` tensor. ``GGMLRows`` carries those bytes from the GGUF file or the
cache to the model: packed (``QuantWeight``, kept quantized) or dequantized by gguf's own code,
the one the engine has always loaded GGUF weights with, so both sources give the same bits.

The checks refuse what would otherwise load as garbage or crash later: a byte count that does
not match the shape (a truncated or corrupt tensor) and block scales (fp16 fields) that are not
finite. The scales are read in place as 16-bit words through numpy: 0.06 s for the default
model's 96 MB of blocks on a shared 2-core EPYC, where gathering them into an fp16 tensor first
took 0.34 s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels.ggml_quants import FORMATS, HALF_FIELDS
from engine.kernels.quant_gemm import QuantWeight, pack
from engine.layers.quantized import PackedWeight


@dataclass(frozen=True)
class GGMLRows:
    """A checked quantized weight: ``data`` uint8 ``[out_features, row_bytes]`` in ``fmt``."""

    name: str  # the GGUF tensor's name ("blk.0.attn_q.weight"), for messages
    fmt: str  # gguf's name of its type ("Q4_K")
    data: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    def pack(self) -> QuantWeight:
        """Kept quantized (a ``QuantWeight`` of these bytes)."""
        if self.fmt not in FORMATS:
            raise ValueError(f"tensor {self.name!r} is {self.fmt}, which the engine cannot keep "
                             f"quantized (it keeps {', '.join(FORMATS)}); load it with "
                             "quantization='dequantize'")
        return pack(self.fmt, self.data, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out_features, in_features]``: gguf's ``dequantize``, bit for bit what
        the engine loaded before it kept anything quantized. (The kernels' torch reference
        gives the same bits, but loading the default model's rows through it took 6-21 s
        against gguf's 2-4 s, interleaved runs on a shared 2-core EPYC.)"""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.data.numpy(), GGMLQuantizationType[self.fmt])
        return torch.from_numpy(values.reshape(self.out_features, self.in_features))


def block_shape(fmt: str) -> tuple[int, int]:
    """(values, bytes) of one block of ``fmt``; ValueError for a name gguf does not know."""
    if fmt in FORMATS:
        return FORMATS[fmt].block_size, FORMATS[fmt].type_size
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    except KeyError:
        raise ValueError(f"unknown ggml type {fmt!r}") from None


def ggml_rows(name: str, fmt: str, data: torch.Tensor, shape: tuple[int, int]) -> GGMLRows:
    """``data`` (uint8, the tensor's bytes) as the rows of a ``shape`` = (out, in) weight in
    ``fmt``, checked: the byte count the shape needs, and finite block scales."""
    out_features, in_features = shape
    block_values, block_bytes = block_shape(fmt)
    if in_features % block_values:
        raise ValueError(f"tensor {name!r} ({fmt}, {out_features} x {in_features}) has rows of "
                         f"{in_features} values, not a multiple of {fmt}'s blocks of "
                         f"{block_values}: corrupt shape")
    row_bytes = in_features // block_values * block_bytes
    expected = out_features * row_bytes
    if data.dtype != torch.uint8 or data.numel() != expected:
        raise ValueError(f"tensor {name!r} ({fmt}, {out_features} x {in_features}) needs "
                         f"{expected} bytes ({out_features} rows of {row_bytes}), got "
                         f"{data.numel() * data.element_size()}: truncated or corrupt")
    data = data.reshape(out_features, row_bytes)
    _check_scales(name, fmt, data, block_bytes)
    return GGMLRows(name, fmt, data, in_features)


def _check_scales(name: str, fmt: str, data: torch.Tensor, block_bytes: int) -> None:
    """Every block's fp16 scale fields finite (where the format's layout is known here): read
    in place as 16-bit words, an all-ones exponent is an infinity or a NaN."""
    offsets = HALF_FIELDS.get(fmt, ())
    if not offsets:
        return
    words = data.numpy().view(np.uint16).reshape(-1, block_bytes // 2)  # every type size is even
    for offset in offsets:
        field = words[:, offset // 2]  # one scale a block, little-endian like the file
        bad = (field & 0x7C00) == 0x7C00
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            blocks_per_row = data.shape[1] // block_bytes
            raise ValueError(
                f"tensor {name!r} ({fmt}) has {int(bad.sum())} blocks whose fp16 scale is "
                f"not finite, the first in row {first // blocks_per_row} "
                f"({float(field[first:first + 1].view(np.float16)[0])}): a corrupt file")


def materialize(tensor: torch.Tensor | GGMLRows, dtype: torch.dtype,
                quantized: bool) -> torch.Tensor | PackedWeight:
    """A stored weight as the model takes it: ggml rows packed (``quantized``) or dequantized
    and cast, a dense tensor cast. The GGUF file and its converted cache both go through here,
    so they load the same bits."""
    if isinstance(tensor, GGMLRows):
        return tensor.pack() if quantized else tensor.dequantize().to(dtype)
    return tensor.to(dtype)


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A tensor of its own memory from ``array`` (a read-only view of a GGUF mapping, or an
    array of its own)."""
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, order="C")
    return torch.from_numpy(array)
