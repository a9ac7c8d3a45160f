"""int4_gemm: ``x @ W.T`` with W the 4-bit grouped weight of ``Int4Weight``, dequantized a tile at a
time inside the product (AWQ and GPTQ checkpoints on a GPU).

Program (row tile, column tile) walks the inputs ``BLOCK_K`` at a time. A K tile of the packed
weight ``qweight [K / 8, N]`` is read as ``[BLOCK_K, BLOCK_N]`` words (each word serves 8
consecutive rows; the loads hit the same cache lines), shifted and masked to its codes, and turned
into ``(q - z) * s`` in fp32 with the zero point and scale of its group, then rounded to the
activations' dtype for ``tl.dot`` (fp32 accumulation). ``BLOCK_K`` divides the group size, so a
tile lies in one group and its zeros and scales are one row each. The packed weight is read once
per row tile: 0.5 byte a weight instead of bf16's 2, which is what a decode step (a few rows)
is bound by. A few rows make few column tiles, too few programs to keep every SM streaming the
weight, so such a product is also cut along K (``split_k_for``), its fp32 partial sums added
in a fixed order afterwards.

The torch reference is ``engine.kernels.int4_weights.linear_reference``: the same fp32
dequantization rounded once to ``x.dtype``, then a matmul.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

SUPPORTED_GROUP_SIZES = (32, 64, 128)  # and one group a row (group_size == in_features)


@triton.jit
def dot_tile(acc, x, w, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``acc + x @ w`` (fp32 accumulation); ``UPCAST_DOT``: fp32 operands (the interpreter's)."""
    if UPCAST_DOT:
        x, w = x.to(tl.float32), w.to(tl.float32)
    return acc + tl.dot(x, w, input_precision=PRECISION)


@triton.jit
def store_split_tile(acc, bias_ptr, out_ptr, rows, cols, row_mask, col_mask, split,
                     stride_os, stride_om, stride_on, HAS_BIAS: tl.constexpr):
    """A program's ``[BLOCK_M, BLOCK_N]`` tile (+ bias) into its K slice's output
    (``launch_split``'s layout)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = (out_ptr + split * stride_os + rows.to(tl.int64)[:, None] * stride_om
           + cols[None, :] * stride_on)
    tl.store(out, acc, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qweight_ptr, zeros_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
    stride_os, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 activations (no TF32), the default otherwise
    UPCAST_DOT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    split = tl.program_id(2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * K_PER_SPLIT, tl.minimum(K, (split + 1) * K_PER_SPLIT), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        words = tl.load(qweight_ptr + (ks // 8)[:, None] * stride_qk + cols[None, :] * stride_qn,
                        mask=k_mask[:, None] & col_mask[None, :], other=0)
        codes = (words >> ((ks % 8) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N]
        group = k0 // GROUP_SIZE
        zero = tl.load(zeros_ptr + group * stride_zg + cols * stride_zn, mask=col_mask, other=0)
        scale = tl.load(scales_ptr + group * stride_sg + cols * stride_sn, mask=col_mask,
                        other=0.0)
        w = (codes - zero.to(tl.int32)[None, :]).to(tl.float32) * scale.to(tl.float32)[None, :]
        w = w.to(x.dtype)
        acc = dot_tile(acc, x, w, PRECISION, UPCAST_DOT)
    store_split_tile(acc, bias_ptr, out_ptr, rows, cols, row_mask, col_mask, split,
                     stride_os, stride_om, stride_on, HAS_BIAS)


# Triton's CPU interpreter multiplies the raw bits of bf16 dot operands (it stores bf16 as
# uint16), so under TRITON_INTERPRET the kernel feeds tl.dot fp32 copies instead.
_INTERPRETED = not isinstance(_int4_gemm_kernel, triton.JITFunction)


def split_k_for(m: int, column_tiles: int, k_tiles: int, device: torch.device) -> int:
    """How many slices of K a few-row product is cut into, so that a decode step's handful of
    column tiles still gives every SM of the GPU two programs (the weight streams from
    memory in parallel; the partial sums are added in a fixed order: deterministic)."""
    if m > 16 or device.type != "cuda":
        return 1
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(k_tiles // 4, triton.cdiv(programs, column_tiles), 16))


def launch_split(kernel: Any, grid_mn: tuple[int, int], m: int, n: int, k: int,
                 block_k: int, split_k: int, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device, **launch: Any) -> torch.Tensor:
    """Run ``kernel`` over ``grid_mn`` x ``split_k`` programs, each summing
    ``k_per_split`` inputs: one slice writes ``[M, N]`` in ``dtype`` with the bias; several
    write fp32 partial sums that are added here, the bias after."""
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    if split_k == 1:
        out = torch.empty(m, n, dtype=dtype, device=device)
        kernel[(*grid_mn, 1)](bias_ptr=bias if bias is not None else out, out_ptr=out,
                              K_PER_SPLIT=k_per_split, stride_os=0, stride_om=out.stride(0),
                              stride_on=out.stride(1), HAS_BIAS=bias is not None, **launch)
        return out
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=device)
    kernel[(*grid_mn, split_k)](bias_ptr=partial, out_ptr=partial, K_PER_SPLIT=k_per_split,
                                stride_os=partial.stride(0), stride_om=partial.stride(1),
                                stride_on=partial.stride(2), HAS_BIAS=False, **launch)
    total = partial.sum(0)
    return (total if bias is None else total + bias.float()).to(dtype)


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor,
              scales: torch.Tensor, group_size: int, bias: torch.Tensor | None = None, *,
              split_k: int | None = None) -> torch.Tensor:
    """``x [M, K]`` times the weight ``qweight [K / 8, N]`` int32 / ``zeros [K / group, N]``
    uint8 / ``scales [K / group, N]`` transposed (+ ``bias [N]``) -> ``[M, N]`` in ``x.dtype``.
    ``group_size`` is 32, 64, 128 or K; ``split_k`` (None: ``split_k_for``) slices K."""
    if x.dim() != 2 or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"x must be [M, K] and qweight int32 [K / 8, N], got x "
                         f"{tuple(x.shape)} and qweight {qweight.dtype} {tuple(qweight.shape)}")
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"qweight {tuple(qweight.shape)} packs {qweight.shape[0] * 8} inputs, "
                         f"x has {k}")
    if group_size not in SUPPORTED_GROUP_SIZES and group_size != k:
        raise ValueError(f"group size {group_size} is not supported by the int4 kernel "
                         f"(supported: {SUPPORTED_GROUP_SIZES} or one group a row)")
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    groups = k // group_size
    if zeros.shape != (groups, n) or zeros.dtype != torch.uint8:
        raise ValueError(f"zeros must be uint8 [{groups}, {n}], got {zeros.dtype} "
                         f"{tuple(zeros.shape)}")
    if scales.shape != (groups, n) or not scales.is_floating_point():
        raise ValueError(f"scales must be float [{groups}, {n}], got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    # a K tile lies in one group: BLOCK_K divides every supported group size (or K is one group)
    block_k = 32 if group_size == 32 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    if split_k is None:
        split_k = split_k_for(m, grid[1], triton.cdiv(k, block_k), x.device)
    return launch_split(
        _int4_gemm_kernel, grid, m, n, k, block_k, split_k, bias, x.dtype, x.device,
        x_ptr=x, qweight_ptr=qweight, zeros_ptr=zeros, scales_ptr=scales, M=m, N=n, K=k,
        stride_xm=x.stride(0), stride_xk=x.stride(1), stride_qk=qweight.stride(0),
        stride_qn=qweight.stride(1), stride_zg=zeros.stride(0), stride_zn=zeros.stride(1),
        stride_sg=scales.stride(0), stride_sn=scales.stride(1),
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32",
        UPCAST_DOT=_INTERPRETED and x.dtype != torch.float32,
    )
