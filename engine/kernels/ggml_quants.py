"""ggml's block-quantized weight formats, and their dequantization in plain torch: the reference
every quantized-GEMM kernel (``quant_gemm.py``) is tested against.

A quantized GGUF tensor stores each row of a weight as consecutive blocks: a few scale fields
(fp16, or 6-bit/8-bit integers under an fp16 super-scale for the K-quants) and the packed low-bit
values. The formats kept here are the ones GGUF files for CPUs carry in practice:

    format  block  bytes  value
    Q4_0     32     18    d * (q4 - 8)
    Q4_1     32     20    d * q4 + m
    Q5_0     32     22    d * (q5 - 16)             (the 5th bits gathered in one uint32)
    Q5_1     32     24    d * q5 + m
    Q8_0     32     34    d * q8                    (int8)
    Q4_K    256    144    d*sc[j] * q4 - dmin*mn[j] (8 sub-blocks of 32, 6-bit sc/mn in 12 bytes)
    Q5_K    256    176    d*sc[j] * q5 - dmin*mn[j] (as Q4_K, the 5th bits in 32 bytes)
    Q6_K    256    210    d*sc[j] * (q6 - 32)       (16 sub-blocks of 16, int8 sc, ql/qh split)

``dequantize`` reproduces ``gguf.quants.dequantize`` bit for bit: the same fp32 operations in the
same order (``d * sc`` rounded to fp32 first, then ``* q`` and ``- dmin * mn``; never a fused
multiply-add), vectorized over every block of every row at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GGMLFormat:
    """One ggml block format: its name, gguf's type number and the shape of its blocks."""

    name: str  # "Q4_K"
    ggml_type: int  # gguf's GGMLQuantizationType value
    block_size: int  # values a block (32, or 256 for the K-quants)
    type_size: int  # bytes a block


FORMATS: dict[str, GGMLFormat] = {f.name: f for f in (
    GGMLFormat("Q4_0", 2, 32, 18),
    GGMLFormat("Q4_1", 3, 32, 20),
    GGMLFormat("Q5_0", 6, 32, 22),
    GGMLFormat("Q5_1", 7, 32, 24),
    GGMLFormat("Q8_0", 8, 32, 34),
    GGMLFormat("Q4_K", 12, 256, 144),
    GGMLFormat("Q5_K", 13, 256, 176),
    GGMLFormat("Q6_K", 14, 256, 210),
)}
_BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}


def format_of(ggml_type: int) -> GGMLFormat | None:
    """The format of gguf type number ``ggml_type``; None for a type not kept quantized here
    (F32, F16, the I-quants, ...)."""
    return _BY_TYPE.get(int(ggml_type))


def get_format(fmt: str) -> GGMLFormat:
    """``FORMATS[fmt]``, or a ValueError naming the formats there are."""
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown ggml format {fmt!r}; known: {', '.join(FORMATS)}") from None


def row_bytes(fmt: str, in_features: int) -> int:
    """Bytes one row of ``in_features`` values takes in ``fmt``."""
    spec = get_format(fmt)
    if in_features <= 0 or in_features % spec.block_size:
        raise ValueError(f"{fmt} stores rows in blocks of {spec.block_size} values; "
                         f"in_features={in_features} is not a positive multiple of it")
    return in_features // spec.block_size * spec.type_size


def dequantize(fmt: str, data: torch.Tensor, in_features: int) -> torch.Tensor:
    """``data``: uint8 [rows, row_bytes(fmt, in_features)], ggml's block bytes one row per output
    feature -> float32 [rows, in_features]."""
    spec = get_format(fmt)
    expected = row_bytes(fmt, in_features)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != expected:
        raise ValueError(f"{fmt} data must be uint8 [rows, {expected}] for {in_features} values "
                         f"a row, got {data.dtype} {tuple(data.shape)}")
    rows = data.shape[0]
    blocks = data.reshape(rows * (in_features // spec.block_size), spec.type_size)
    values = _DEQUANTIZE[fmt](blocks)  # [num_blocks, block_size]
    return values.reshape(rows, in_features)


def _half(field: torch.Tensor) -> torch.Tensor:
    """Two bytes a block ([num_blocks, 2], little-endian fp16) -> float32 [num_blocks, 1]."""
    return field.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32] values: the 16 low nibbles, then the 16 high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """[n, bytes] little-endian bit field -> [n, count] of 0/1 (bit i of the field is value i)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[..., None] >> shifts) & 1).reshape(*qh.shape[:-1], -1)[..., :count]


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _half(b[:, 0:2])
    q = _nibbles(b[:, 2:18]).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _half(b[:, 0:2]), _half(b[:, 2:4])
    return d * _nibbles(b[:, 4:20]).float() + m


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return _nibbles(qs) | (_bits(qh, 32) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _half(b[:, 0:2])
    q = _q5(b[:, 2:6], b[:, 6:22]).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _half(b[:, 0:2]), _half(b[:, 2:4])
    return d * _q5(b[:, 4:8], b[:, 8:24]).float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _half(b[:, 0:2])
    return b[:, 2:34].contiguous().view(torch.int8).float() * d


def k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 packed bytes -> (scales, mins), each uint8 [n, 8] of 6-bit values.

    Bytes 0-3 hold sub-blocks 0-3's scales (low 6 bits) and the top 2 bits of 4-7's; bytes 4-7
    the same for the mins; bytes 8-11 the low 4 bits of 4-7's scale (low nibble) and min (high).
    """
    lo, hi, mixed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)), dim=-1)
    mn = torch.cat((hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_quant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's affine step: ``q`` [n, 8, 32] -> [n, 256]."""
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, mn = k_scales_mins(b[:, 4:16])
    scale = (d * sc.float())[..., None]  # [n, 8, 1]
    offset = (dmin * mn.float())[..., None]
    return (scale * q.float() - offset).reshape(-1, 256)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] -> [n, 8, 32]: each 32 bytes hold sub-block 2j (low nibbles) and 2j+1 (high)."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_quant(b, _k_nibbles(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # qh [n, 32]: bit j of byte i is the 5th bit of sub-block j's value i
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[:, None]
    high = (b[:, 16:48][:, None, :] >> shifts) & 1  # [n, 8, 32]
    return _k_quant(b, _k_nibbles(b[:, 48:176]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # Two halves of 128 values; in each, ql's 64 bytes give values 0-63 (low nibbles) and 64-127
    # (high), qh's 32 bytes give bits 4-5 of values i, i+32, i+64, i+96 (shifts 0, 2, 4, 6).
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)
    ql = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[:, None]
    qh = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(-1, 16, 16)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = _half(b[:, 208:210])
    return ((d * scales)[..., None] * q.float()).reshape(-1, 256)


_DEQUANTIZE = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
               "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


# Byte offsets of each block's fp16 fields (d, and m or dmin where the format has one).
HALF_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def random_rows(fmt: str, rows: int, in_features: int, generator: torch.Generator,
                scale: float = 1.0) -> torch.Tensor:
    """Random valid ``fmt`` bytes, uint8 [rows, row_bytes]: every bit pattern of the packed
    values and integer scales, the fp16 fields drawn finite (uniform in +-``scale`` / the largest
    integer they multiply, so values stay near ``scale``). For tests and benchmarks."""
    spec = get_format(fmt)
    num_blocks = rows * (in_features // spec.block_size)
    data = torch.randint(0, 256, (num_blocks, spec.type_size), dtype=torch.uint8,
                         generator=generator)
    largest = {"Q4_K": 15 * 63, "Q5_K": 31 * 63, "Q6_K": 32 * 127, "Q8_0": 127}.get(fmt, 16)
    for offset in HALF_FIELDS[fmt]:
        half = ((torch.rand(num_blocks, 1, generator=generator) * 2 - 1) * scale / largest)
        data[:, offset:offset + 2] = half.to(torch.float16).view(torch.uint8)
    return data.reshape(rows, row_bytes(fmt, in_features))
