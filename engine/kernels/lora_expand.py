"""lora_expand: the second half of the segmented LoRA GEMM, ``out[rows] += y[rows] @ B[slot].T``.

``y [num_tokens, R]`` is one slice's columns of ``lora_shrink``'s output (fp32); ``b_stack
[max_loras, N, R]`` that slice's B per slot, scaling folded in, zero past each adapter's rank;
``out [num_tokens, N]`` the slice's columns of the projection's output (a strided view), added
to in place, in its own dtype. Program (segment, row tile, column tile); rows in no segment are
untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.lora_shrink import check_segments


@triton.jit
def _lora_expand_kernel(
    y_ptr, b_ptr, out_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    N, R,
    stride_ym, stride_yr, stride_bl, stride_bn, stride_br, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    segment = tl.program_id(0)
    tile_m = tl.program_id(1)
    tile_n = tl.program_id(2)
    seg_len = tl.load(seg_len_ptr + segment)
    if tile_m * BLOCK_M >= seg_len:
        return
    start = tl.load(seg_start_ptr + segment).to(tl.int64)
    slot = tl.load(seg_slot_ptr + segment).to(tl.int64)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < seg_len
    col_mask = cols < N
    y_rows = y_ptr + (start + rows)[:, None] * stride_ym
    b_cols = b_ptr + slot * stride_bl + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_mask = rs < R
        y = tl.load(y_rows + rs[None, :] * stride_yr, mask=row_mask[:, None] & r_mask[None, :],
                    other=0.0)
        b = tl.load(b_cols + rs[:, None] * stride_br, mask=r_mask[:, None] & col_mask[None, :],
                    other=0.0)
        acc += tl.dot(y, b.to(tl.float32))
    mask = row_mask[:, None] & col_mask[None, :]
    out = out_ptr + (start + rows)[:, None] * stride_om + cols[None, :] * stride_on
    base = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (base.to(tl.float32) + acc).to(base.dtype), mask=mask)


def lora_expand(y: torch.Tensor, b_stack: torch.Tensor, out: torch.Tensor,
                seg_start: torch.Tensor, seg_len: torch.Tensor, seg_slot: torch.Tensor,
                max_seg_len: int, *, block_m: int = 16, block_n: int = 32,
                block_r: int = 16) -> None:
    """``out[rows] += y[rows] @ b_stack[slot].T`` for every segment's rows, in place."""
    if (y.dim() != 2 or b_stack.dim() != 3 or out.dim() != 2 or y.shape[1] != b_stack.shape[2]
            or out.shape != (y.shape[0], b_stack.shape[1])):
        raise ValueError(f"y must be [num_tokens, R], b_stack [max_loras, N, R] and out "
                         f"[num_tokens, N], got {tuple(y.shape)}, {tuple(b_stack.shape)} and "
                         f"{tuple(out.shape)}")
    if y.dtype != torch.float32:
        raise ValueError(f"y must be float32 (lora_shrink's output), got {y.dtype}")
    check_segments(seg_start, seg_len, seg_slot)
    num_segments = seg_start.shape[0]
    n, r = b_stack.shape[1], b_stack.shape[2]
    if num_segments == 0 or max_seg_len == 0:
        return
    grid = (num_segments, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n))
    _lora_expand_kernel[grid](
        y, b_stack, out, seg_start, seg_len, seg_slot, n, r,
        y.stride(0), y.stride(1), b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
    )


def lora_expand_ref(y: torch.Tensor, b_stack: torch.Tensor, out: torch.Tensor,
                    seg_start: torch.Tensor, seg_len: torch.Tensor,
                    seg_slot: torch.Tensor) -> None:
    """The torch reference: one fp32 matmul per segment, added to ``out`` in its dtype."""
    for start, length, slot in zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist(),
                                   strict=True):
        rows = slice(start, start + length)
        out[rows] = (out[rows].float() + y[rows] @ b_stack[slot].float().T).to(out.dtype)
