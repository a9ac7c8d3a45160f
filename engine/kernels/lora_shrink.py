"""lora_shrink: the first half of the segmented LoRA GEMM, ``y[rows] = x[rows] @ A[slot].T``.

Segment ``i`` is rows ``seg_start[i] .. seg_start[i] + seg_len[i]`` of the flat batch, all under
the adapter in slot ``seg_slot[i]`` of ``a_stack [max_loras, N, K]`` (N: every slice's ranks,
padded to ``max_lora_rank``). One launch covers every segment: program (segment, row tile, column
tile). Rows in no segment are not written (the expand kernel never reads them). Accumulates and
stores in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _segmented_matmul_kernel(
    x_ptr, w_ptr, out_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    N, K,
    stride_xm, stride_xk, stride_wl, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 weights (no TF32), the default for 16-bit ones
    UPCAST_DOT: tl.constexpr,
):
    """Each segment's rows of ``x [num_tokens, K]`` times its slot's ``w [N, K]`` transposed,
    in fp32: stored into ``out`` (shrink: ``x @ A.T``) or, with ``ACCUMULATE``, added to it in
    its dtype (expand: ``out += y @ B.T``)."""
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
    x_rows = x_ptr + (start + rows)[:, None] * stride_xm
    w_cols = w_ptr + slot * stride_wl + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_mask[:, None] & col_mask[None, :],
                    other=0.0)
        # in the weights' dtype: bf16 tensor-core products into the fp32 accumulator (the
        # expand's fp32 input rounds to bf16 as the CPU path's bf16 shrink output does)
        x = x.to(w.dtype)
        if UPCAST_DOT:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, w, input_precision=PRECISION)
    mask = row_mask[:, None] & col_mask[None, :]
    out = out_ptr + (start + rows)[:, None] * stride_om + cols[None, :] * stride_on
    if ACCUMULATE:
        base = tl.load(out, mask=mask, other=0.0)
        tl.store(out, (base.to(tl.float32) + acc).to(base.dtype), mask=mask)
    else:
        tl.store(out, acc, mask=mask)


# Triton's CPU interpreter multiplies the raw bits of bf16 dot operands (it stores bf16 as
# uint16), so under TRITON_INTERPRET the kernel feeds tl.dot fp32 copies instead.
_INTERPRETED = not isinstance(_segmented_matmul_kernel, triton.JITFunction)


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, seg_start: torch.Tensor,
           seg_len: torch.Tensor, seg_slot: torch.Tensor, row_tiles: int, *, block_m: int,
           block_n: int, block_k: int, accumulate: bool) -> None:
    """One launch over every segment: ``row_tiles`` row tiles each (tiles past a segment's
    length return at once, so a CUDA graph can be captured over a bucket's worth)."""
    n, k = w.shape[1], w.shape[2]
    grid = (seg_start.shape[0], row_tiles, triton.cdiv(n, block_n))
    _segmented_matmul_kernel[grid](
        x, w, out, seg_start, seg_len, seg_slot, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ACCUMULATE=accumulate,
        PRECISION="ieee" if w.dtype == torch.float32 or _INTERPRETED else "tf32",
        UPCAST_DOT=_INTERPRETED and w.dtype != torch.float32,
    )


def check_segments(seg_start: torch.Tensor, seg_len: torch.Tensor,
                   seg_slot: torch.Tensor) -> None:
    """Segment tensors are 1-d int32 of one length, on one device (values are the runner's)."""
    n = seg_start.shape[0]
    for name, t in (("seg_start", seg_start), ("seg_len", seg_len), ("seg_slot", seg_slot)):
        if t.dim() != 1 or t.shape[0] != n or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 [num_segments={n}], got "
                             f"{t.dtype} {tuple(t.shape)}")


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, seg_start: torch.Tensor,
                seg_len: torch.Tensor, seg_slot: torch.Tensor, max_seg_len: int,
                *, block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """``[num_tokens, N]`` fp32: each segment's rows of ``x [num_tokens, K]`` times its slot's
    ``A.T`` (``a_stack [max_loras, N, K]``); rows in no segment are left unwritten.
    ``max_seg_len`` bounds the segments' lengths: the whole batch's rows in a captured graph."""
    if x.dim() != 2 or a_stack.dim() != 3 or a_stack.shape[2] != x.shape[1]:
        raise ValueError(f"x must be [num_tokens, K] and a_stack [max_loras, N, K], got "
                         f"{tuple(x.shape)} and {tuple(a_stack.shape)}")
    check_segments(seg_start, seg_len, seg_slot)
    y = torch.empty(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    if seg_start.shape[0] == 0 or max_seg_len == 0:
        return y
    launch(x, a_stack, y, seg_start, seg_len, seg_slot, triton.cdiv(max_seg_len, block_m),
           block_m=block_m, block_n=block_n, block_k=block_k, accumulate=False)
    return y


def lora_shrink_ref(x: torch.Tensor, a_stack: torch.Tensor, seg_start: torch.Tensor,
                    seg_len: torch.Tensor, seg_slot: torch.Tensor) -> torch.Tensor:
    """The torch reference: one fp32 matmul per segment (rows in no segment are zeros)."""
    y = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for start, length, slot in zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist(),
                                   strict=True):
        y[start: start + length] = x[start: start + length].float() @ a_stack[slot].float().T
    return y
