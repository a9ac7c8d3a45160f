"""fused_moe: a step's experts in two Triton launches, rows grouped by expert, no host sync.

The (token, k) pairs are sorted by expert and each expert's run is padded to a multiple of
``BLOCK_M`` (``align_by_expert``, torch ops of fixed shapes, so a CUDA graph can capture it): a
block of ``BLOCK_M`` rows then belongs to one expert. Launch one multiplies each block's rows,
gathered from the hidden states, by that expert's ``w13`` (gate and up); the activation runs in
torch on the padded rows; launch two multiplies by ``w2``, scales each row by its routing weight
and writes it back at its (token, k) place, so the k rows of a token sum in the same order as the
torch path (``engine.layers.moe.experts_grouped``, the reference the tests compare against under
``TRITON_INTERPRET=1``). Accumulation is fp32 (IEEE, no TF32), biases are added per expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, bias_ptr, out_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr, weights_ptr,
    num_pairs, num_experts, top_k, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_om,
    GATHER_TOKENS: tl.constexpr,  # a rows are tokens (pair // top_k), else padded rows
    SCATTER_PAIRS: tl.constexpr,  # write row p (times its routing weight), else padded rows
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 (no TF32), the default for 16-bit inputs
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return  # a block past the last expert's rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + rows).to(tl.int64)
    valid = pairs < num_pairs
    if GATHER_TOKENS:
        a_rows = pairs // top_k
    else:
        a_rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :],
                    mask=valid[:, None] & (kk[None, :] < K), other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0)
        if UPCAST_DOT:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + cols, mask=cols < N, other=0.0)
        acc += bias[None, :].to(tl.float32)
    if SCATTER_PAIRS:
        # the torch path rounds the projection before weighting it
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        out_rows = pairs
    else:
        out_rows = rows.to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


# Triton's CPU interpreter multiplies the raw bits of bf16 dot operands (it stores bf16 as
# uint16), so under TRITON_INTERPRET the kernel feeds tl.dot fp32 copies instead.
_INTERPRETED = not isinstance(_expert_gemm_kernel, triton.JITFunction)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pair_ids, block_expert_ids)``: the pair ids (``token * k + j``) grouped by
    expert, each expert's run padded with ``num_pairs`` to a multiple of ``block_m``; and each
    block's expert (``num_experts`` for blocks past the end). Shapes depend only on
    ``topk_ids.shape`` and ``num_experts``."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    sorted_ids, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_pairs, device=flat.device) - start[sorted_ids]
    dest = (padded_end - padded)[sorted_ids] + rank
    capacity = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = -(-capacity // block_m)
    sorted_pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32,
                                 device=flat.device)
    sorted_pair_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_pair_ids, block_expert_ids


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [num_tokens, hidden], w13 [num_experts, 2 * inter, hidden], "
                         f"w2 [num_experts, hidden, inter]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_inter, hidden = w13.shape
    if x.shape[1] != hidden or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 "
                         f"{tuple(w2.shape)} do not fit together")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [num_tokens, top_k]")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got {t.stride()}")
    if len({t.device for t in (x, w13, w2, topk_weights, topk_ids)}) != 1:
        raise ValueError("x, the weights and the routing must be on one device")


def fused_moe_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    return (x.device.type == "cuda" and x.dtype == w13.dtype == w2.dtype
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and w13.stride(-1) == 1 and w2.stride(-1) == 1)


def _gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
          sorted_pair_ids: torch.Tensor, block_expert_ids: torch.Tensor,
          weights: torch.Tensor, num_pairs: int, top_k: int, gather: bool) -> None:
    num_experts, n, k = w.shape
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert_ids.numel(), triton.cdiv(n, block_n))
    _expert_gemm_kernel[grid](
        a, w, bias if bias is not None else w, out, sorted_pair_ids, block_expert_ids, weights,
        num_pairs, num_experts, top_k, n, k,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        GATHER_TOKENS=gather, SCATTER_PAIRS=not gather, HAS_BIAS=bias is not None,
        PRECISION="ieee" if a.dtype == torch.float32 or _INTERPRETED else "tf32",
        UPCAST_DOT=_INTERPRETED and a.dtype != torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    w13_bias: torch.Tensor | None,  # [num_experts, 2 * inter]
    w2_bias: torch.Tensor | None,  # [num_experts, hidden]
    activation: Callable[[torch.Tensor], torch.Tensor],  # [rows, 2 * inter] -> [rows, inter]
) -> torch.Tensor:  # [num_tokens, hidden]
    """The experts' output for each token, summed over its k experts (Triton)."""
    _check(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    sorted_pair_ids, block_expert_ids = align_by_expert(topk_ids, w13.shape[0])
    weights = topk_weights.reshape(-1).to(x.dtype).contiguous()
    gate_up = x.new_empty(sorted_pair_ids.numel(), w13.shape[1])  # [padded rows, 2 * inter]
    _gemm(x, w13, w13_bias, gate_up, sorted_pair_ids, block_expert_ids, weights, num_pairs,
          top_k, gather=True)
    hidden = activation(gate_up).contiguous()  # [padded rows, inter]
    out = x.new_empty(num_pairs, w2.shape[1])  # [num_pairs, hidden], (token, k) order
    _gemm(hidden, w2, w2_bias, out, sorted_pair_ids, block_expert_ids, weights, num_pairs,
          top_k, gather=False)
    return out.view(num_tokens, top_k, -1).sum(dim=1)

