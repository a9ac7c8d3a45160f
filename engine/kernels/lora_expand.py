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

from engine.kernels.lora_shrink import check_segments, launch


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
    if seg_start.shape[0] == 0 or max_seg_len == 0:
        return
    launch(y, b_stack, out, seg_start, seg_len, seg_slot, triton.cdiv(max_seg_len, block_m),
           block_m=block_m, block_n=block_n, block_k=block_r, accumulate=True)


def lora_expand_ref(y: torch.Tensor, b_stack: torch.Tensor, out: torch.Tensor,
                    seg_start: torch.Tensor, seg_len: torch.Tensor,
                    seg_slot: torch.Tensor) -> None:
    """The torch reference: one fp32 matmul per segment, added to ``out`` in its dtype."""
    for start, length, slot in zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist(),
                                   strict=True):
        rows = slice(start, start + length)
        out[rows] = (out[rows].float() + y[rows] @ b_stack[slot].float().T).to(out.dtype)
