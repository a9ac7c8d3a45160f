"""ggml_gemm: ``x @ W.T`` with W in one of ggml's block formats (``ggml_quants.FORMATS``), read
from ggml's own rows and dequantized a tile at a time inside the product (GGUF weights kept
quantized on a GPU).

Row n of the weight is ``data[n]``: K / block_size blocks of type_size bytes, one after the
other (``ggml_quants``' table). Each block is cut into sub-blocks of ``SUB`` values that share
one scale: the whole block (32 values) for Q4_0 ... Q8_0, 32 values for Q4_K / Q5_K, 16 for
Q6_K. Program (row tile, column tile) walks the inputs ``BLOCK_K`` at a time, and holds a K tile
of the weight as ``[BLOCK_K / SUB, SUB, BLOCK_N]`` (sub-block, value in it, output column):

- per (sub-block, column), the block's byte offset ``n * row_bytes + block * type_size`` and its
  scales: an fp16 field as its two bytes put together and bitcast (blocks of 18, 22, 34 or 210
  bytes leave fp16 fields at odd addresses, so no fp16 view of the buffer), the K-quants' 6-bit
  scale and min from their 12 bytes, Q6_K's int8 scale;
- per value, the byte or bytes that hold its bits, at the offsets ggml packs them to (the low or
  high nibble of ``qs``, Q5's 5th bit in ``qh``, Q6_K's ``ql`` nibble and ``qh`` pair).

The value is computed in fp32 in ``ggml_quants``' order (``d * sc`` rounded first, then ``* q``,
then ``- dmin * mn`` or ``+ m``), launched with FP fusion off so that no fused multiply-add
changes a rounding: the tile holds ``ggml_quants.dequantize``'s values bit for bit. It is then
rounded to the activations' dtype for ``tl.dot`` (fp32 accumulation; fp32 activations in
"ieee" precision, no TF32). ``BLOCK_K`` is a power of two from 32 to 256, so a tile holds whole
sub-blocks and never straddles a K-quant super-block. The weight comes from memory once per row tile
(4.5 to 8.5 bits a weight against bf16's 16), and a few-row product is also cut along K
(``triton_int4_gemm.split_k_for``), as the int4 kernel's is.

The torch reference is ``engine.kernels.quant_gemm.linear_reference``: the whole weight
dequantized to fp32, then an fp32 matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.ggml_quants import get_format, row_bytes
from engine.kernels.triton_int4_gemm import (
    dot_tile,
    launch_split,
    split_k_for,
    store_split_tile,
)

BLOCK_KS = (32, 64, 128, 256)  # the K tiles the kernel takes (powers of two: tl.arange)
_SUB = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32,
        "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}  # values a scale covers


@triton.jit
def _u8(ptr, mask):
    """The bytes at ``ptr``, as int32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    """The little-endian fp16 at ``ptr`` (any address), as fp32."""
    bits = _u8(ptr, mask) | (_u8(ptr + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(qs, j, mask):
    """Value j of 32 packed in the 16 bytes at ``qs``: low nibbles are 0-15, high ones 16-31."""
    return (_u8(qs + j % 16, mask) >> (j // 16 * 4)) & 0xF


@triton.jit
def _bit(qh, j, mask):
    """Bit j of the little-endian bit field at ``qh``."""
    return (_u8(qh + j // 8, mask) >> (j % 8)) & 1


@triton.jit
def _k_scale_min(block, s, mask):
    """Q4_K / Q5_K: sub-block ``s``'s 6-bit scale and min from the 12 bytes at ``block + 4``
    (``ggml_quants.k_scales_mins``): sub-blocks 0-3 have theirs in bytes s and s + 4; 4-7 the low
    4 bits in byte s + 4's nibbles and the top 2 in the spare bits of bytes s - 4 and s."""
    a = _u8(block + 4 + (s + 4), mask)
    c = _u8(block + 4 + s, mask)
    e = _u8(block + 4 + s % 4, mask)  # byte s - 4 where s >= 4
    low = s < 4
    sc = tl.where(low, c & 0x3F, (a & 0x0F) | ((e >> 2) & 0x30))
    mn = tl.where(low, a & 0x3F, (a >> 4) | ((c >> 2) & 0x30))
    return sc, mn


@triton.jit
def _dequantize_tile(block, s, j, mask, FMT: tl.constexpr):
    """``block [SUBS, BLOCK_N]``: pointers to the block holding each (sub-block, column);
    ``s [SUBS, 1]``: the sub-block's number in its block; ``j [SUBS, SUB, 1]``: each value's
    index in its block -> fp32 values ``[SUBS, SUB, BLOCK_N]``."""
    b = block[:, None, :]  # [SUBS, 1, BLOCK_N]
    m = mask[:, None, :]
    if FMT == "Q4_0":
        q = _nibble(b + 2, j, m) - 8
        w = _f16(block, mask)[:, None, :] * q.to(tl.float32)
    elif FMT == "Q4_1":
        q = _nibble(b + 4, j, m)
        w = (_f16(block, mask)[:, None, :] * q.to(tl.float32)
             + _f16(block + 2, mask)[:, None, :])
    elif FMT == "Q5_0":
        q = (_nibble(b + 6, j, m) | (_bit(b + 2, j, m) << 4)) - 16
        w = _f16(block, mask)[:, None, :] * q.to(tl.float32)
    elif FMT == "Q5_1":
        q = _nibble(b + 8, j, m) | (_bit(b + 4, j, m) << 4)
        w = (_f16(block, mask)[:, None, :] * q.to(tl.float32)
             + _f16(block + 2, mask)[:, None, :])
    elif FMT == "Q8_0":
        q = (_u8(b + 2 + j, m) ^ 0x80) - 0x80  # int8
        w = q.to(tl.float32) * _f16(block, mask)[:, None, :]
    elif FMT == "Q6_K":
        # two halves of 128 values; in each, ql's 64 bytes hold values 0-63 (low nibbles) and
        # 64-127 (high), qh's 32 bytes bits 4-5 of values i, i+32, i+64, i+96 (shifts 0-6)
        half, r = j // 128, j % 128
        ql = (_u8(b + half * 64 + r % 64, m) >> (r // 64 * 4)) & 0xF
        qh = (_u8(b + 128 + half * 32 + r % 32, m) >> (r // 32 * 2)) & 3
        q = (ql | (qh << 4)) - 32
        sc = (_u8(block + 192 + s, mask) ^ 0x80) - 0x80  # int8, [SUBS, BLOCK_N]
        scale = _f16(block + 208, mask) * sc.to(tl.float32)
        w = scale[:, None, :] * q.to(tl.float32)
    else:  # Q4_K, Q5_K: 32 bytes of qs hold sub-blocks 2i (low nibbles) and 2i + 1 (high)
        nibble = j // 64 * 32 + j % 32
        shift = j // 32 % 2 * 4
        if FMT == "Q4_K":
            q = (_u8(b + 16 + nibble, m) >> shift) & 0xF
        else:  # Q5_K: bit s of qh's byte i is the 5th bit of sub-block s's value i
            q = (((_u8(b + 48 + nibble, m) >> shift) & 0xF)
                 | (((_u8(b + 16 + j % 32, m) >> (j // 32)) & 1) << 4))
        sc, mn = _k_scale_min(block, s, mask)
        scale = _f16(block, mask) * sc.to(tl.float32)  # [SUBS, BLOCK_N]
        offset = _f16(block + 2, mask) * mn.to(tl.float32)
        w = scale[:, None, :] * q.to(tl.float32) - offset[:, None, :]
    return w


@triton.jit
def _ggml_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_os, stride_om, stride_on,
    FMT: tl.constexpr, BLOCK_SIZE: tl.constexpr, TYPE_SIZE: tl.constexpr, SUB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 activations (no TF32), the default otherwise
    UPCAST_DOT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64) * stride_wn  # [BLOCK_N]: each output's ggml row
    subs = tl.arange(0, BLOCK_K // SUB)
    lanes = tl.arange(0, SUB)
    split = tl.program_id(2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * K_PER_SPLIT, tl.minimum(K, (split + 1) * K_PER_SPLIT), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :] * stride_xk,
                    mask=row_mask[:, None] & (ks < K)[None, :], other=0.0)
        first = k0 + subs * SUB  # [SUBS]: each sub-block's first input
        s = (first % BLOCK_SIZE) // SUB
        block = w_rows[None, :] + ((first // BLOCK_SIZE) * TYPE_SIZE)[:, None]  # [SUBS, BLOCK_N]
        mask = (first < K)[:, None] & col_mask[None, :]
        j = (s[:, None] * SUB + lanes[None, :])[:, :, None]  # [SUBS, SUB, 1]
        w = _dequantize_tile(block, s[:, None], j, mask, FMT)  # [SUBS, SUB, BLOCK_N]
        w = tl.reshape(w, (BLOCK_K, BLOCK_N)).to(x.dtype)
        acc = dot_tile(acc, x, w, PRECISION, UPCAST_DOT)
    store_split_tile(acc, bias_ptr, out_ptr, rows, cols, row_mask, col_mask, split,
                     stride_os, stride_om, stride_on, HAS_BIAS)


# Triton's CPU interpreter multiplies the raw bits of bf16 dot operands (it stores bf16 as
# uint16), so under TRITON_INTERPRET the kernel feeds tl.dot fp32 copies instead.
_INTERPRETED = not isinstance(_ggml_gemm_kernel, triton.JITFunction)


def ggml_linear(x: torch.Tensor, fmt: str, data: torch.Tensor, in_features: int,
                out_features: int, bias: torch.Tensor | None = None, *,
                split_k: int | None = None, block_k: int = 64) -> torch.Tensor:
    """``x [..., in_features]`` times the ``fmt`` weight ``data`` (ggml's rows, uint8
    ``[out_features, row_bytes(fmt, in_features)]``) transposed (+ ``bias [out_features]``) ->
    ``[..., out_features]`` in ``x.dtype`` (fp32, fp16 or bf16). ``split_k`` (None:
    ``split_k_for``) slices K; ``block_k`` (``BLOCK_KS``) is the K tile."""
    spec = get_format(fmt)
    expected = row_bytes(fmt, in_features)
    if (data.dtype != torch.uint8 or data.shape != (out_features, expected)
            or data.stride(1) != 1):
        raise ValueError(f"{fmt} data must be uint8 [{out_features}, {expected}] with "
                         f"contiguous rows, got {data.dtype} {tuple(data.shape)} strides "
                         f"{data.stride()}")
    if x.shape[-1:] != (in_features,) or x.dtype not in (torch.float32, torch.float16,
                                                         torch.bfloat16):
        raise ValueError(f"x must be float32, float16 or bfloat16 [..., {in_features}], got "
                         f"{x.dtype} {tuple(x.shape)}")
    if x.device != data.device:
        raise ValueError(f"x is on {x.device}, the weight on {data.device}")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
    if block_k not in BLOCK_KS:
        raise ValueError(f"block_k must be one of {BLOCK_KS}, got {block_k}")
    x2d = x.reshape(-1, in_features)  # [M, K]
    m, n, k = x2d.shape[0], out_features, in_features
    if m == 0 or n == 0:
        return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    if split_k is None:
        split_k = split_k_for(m, grid[1], triton.cdiv(k, block_k), x.device)
    out = launch_split(
        _ggml_gemm_kernel, grid, m, n, k, block_k, split_k, bias, x.dtype, x.device,
        x_ptr=x2d, w_ptr=data, M=m, N=n, K=k, stride_xm=x2d.stride(0),
        stride_xk=x2d.stride(1), stride_wn=data.stride(0),
        FMT=fmt, BLOCK_SIZE=spec.block_size, TYPE_SIZE=spec.type_size, SUB=_SUB[fmt],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32",
        UPCAST_DOT=_INTERPRETED and x.dtype != torch.float32,
        enable_fp_fusion=False,  # no fma: the weights round as ggml_quants' do
    )
    return out.reshape(*x.shape[:-1], n)
