"""fp8_gemm: ``x @ W.T`` with W an FP8 (e4m3) weight and its scales, dequantized a tile at a time
inside the product: the path for block-scaled FP8 checkpoints, and for every FP8 checkpoint on a
GPU without FP8 tensor cores (capability < 8.9, where ``torch._scaled_mm`` does not run).

Every scale layout is one grid of blocks: ``scale [ceil(N / SCALE_BN), ceil(K / SCALE_BK)]``
multiplies the weights of block ``(n // SCALE_BN, k // SCALE_BK)``: per tensor is one block of
``N x K``, per channel blocks of ``1 x K``, DeepSeek-style checkpoints ``128 x 128``. ``BLOCK_K``
divides ``SCALE_BK`` (or K is one block), so a K tile needs one scale per column. The codes are
decoded from their bits (sign, 4 exponent bits with a bias of 7, 3 mantissa bits, subnormals
below exponent 1) where the GPU has no FP8 conversion, by a plain conversion where it has; the
scaled value is rounded to the activations' dtype for ``tl.dot`` (fp32 accumulation). The weight
is read at 1 byte a value instead of bf16's 2; a few rows are also cut along K as in
``engine.kernels.triton_int4_gemm``.

The torch reference is ``engine.kernels.fp8_weights.linear_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_int4_gemm import (
    dot_tile,
    launch_split,
    split_k_for,
    store_split_tile,
)


@triton.jit
def _e4m3_to_float(bits):
    """uint8 e4m3fn codes -> fp32 (NaN, 0x7f / 0xff, is not decoded: weights never hold it)."""
    b = bits.to(tl.int32) & 0xFF
    sign = b >> 7
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32,
                                                                             bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # m * 2^-9
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K, K_PER_SPLIT, SCALE_BN, SCALE_BK,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk,
    stride_os, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, NATIVE_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 activations (no TF32), the default otherwise
    UPCAST_DOT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    scale_cols = scale_ptr + (cols // SCALE_BN) * stride_sn
    split = tl.program_id(2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * K_PER_SPLIT, tl.minimum(K, (split + 1) * K_PER_SPLIT), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        codes = tl.load(w_cols + ks[:, None] * stride_wk,
                        mask=k_mask[:, None] & col_mask[None, :], other=0)  # [BLOCK_K, BLOCK_N]
        if NATIVE_FP8:
            values = codes.to(tl.float32)
        else:
            values = _e4m3_to_float(codes)
        scale = tl.load(scale_cols + (k0 // SCALE_BK) * stride_sk, mask=col_mask, other=0.0)
        w = (values * scale.to(tl.float32)[None, :]).to(x.dtype)
        acc = dot_tile(acc, x, w, PRECISION, UPCAST_DOT)
    store_split_tile(acc, bias_ptr, out_ptr, rows, cols, row_mask, col_mask, split,
                     stride_os, stride_om, stride_on, HAS_BIAS)


# Triton's CPU interpreter multiplies the raw bits of bf16 dot operands (it stores bf16 as
# uint16), so under TRITON_INTERPRET the kernel feeds tl.dot fp32 copies instead.
_INTERPRETED = not isinstance(_fp8_gemm_kernel, triton.JITFunction)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
             bias: torch.Tensor | None = None, *, split_k: int | None = None) -> torch.Tensor:
    """``x [M, K]`` times ``weight [N, K]`` (float8_e4m3fn) transposed, each ``block = (bn, bk)``
    block of it multiplied by its entry of ``scale [ceil(N / bn), ceil(K / bk)]`` (fp32),
    + ``bias [N]`` -> ``[M, N]`` in ``x.dtype``; ``split_k`` (None: ``split_k_for``) slices K
    for a few rows, as ``int4_gemm`` does."""
    if x.dim() != 2 or weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x must be [M, K] and weight float8_e4m3fn [N, K], got x "
                         f"{tuple(x.shape)} and weight {weight.dtype} {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} has {weight.shape[1]} inputs, x has {k}")
    block_n, block_k = block
    grid_shape = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    if scale.shape != grid_shape or scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 {grid_shape} for blocks of {block}, got "
                         f"{scale.dtype} {tuple(scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    tile_k = 64 if block_k >= k else next((t for t in (64, 32, 16) if block_k % t == 0), None)
    if tile_k is None:
        raise ValueError(f"scale blocks {block_k} inputs wide are not a multiple of 16, which "
                         "the FP8 kernel needs")
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    native = (x.device.type == "cuda" and not _INTERPRETED
              and torch.cuda.get_device_capability(x.device) >= (8, 9))
    codes = weight if native else weight.view(torch.uint8)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tile_n = 64 if m <= 64 else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, tile_n))
    if split_k is None:
        split_k = split_k_for(m, grid[1], triton.cdiv(k, tile_k), x.device)
    return launch_split(
        _fp8_gemm_kernel, grid, m, n, k, tile_k, split_k, bias, x.dtype, x.device,
        x_ptr=x, w_ptr=codes, scale_ptr=scale, M=m, N=n, K=k, SCALE_BN=block_n,
        SCALE_BK=block_k, stride_xm=x.stride(0), stride_xk=x.stride(1),
        stride_wn=codes.stride(0), stride_wk=codes.stride(1), stride_sn=scale.stride(0),
        stride_sk=scale.stride(1), NATIVE_FP8=native,
        BLOCK_M=block_m, BLOCK_N=tile_n, BLOCK_K=tile_k,
        PRECISION="ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32",
        UPCAST_DOT=_INTERPRETED and x.dtype != torch.float32,
    )
