"""Packed (varlen) attention: ragged sequences laid end to end, no padding, no KV cache.

Sequence ``s`` owns tokens ``cu_seqlens[s]:cu_seqlens[s + 1]`` of the flat batch; its queries
see its own keys only (every key of it when ``causal`` is off, as an encoder attends; keys up to
their own position when it is on, as a decoder used as an embedder does), never another
sequence's. That is the whole of attention for a pooling step: each input is computed in one
step and nothing of it is kept.

One program handles ``BLOCK_M`` queries of one (sequence, head) with an online softmax over
``BLOCK_N``-token tiles of that sequence's keys, accumulating in fp32. Grouped-query attention
maps query head ``h`` to KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.cpu_packed_attention import check_packed
from engine.kernels.online_softmax import online_softmax_tile

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PackedConfig:
    """Launch knobs."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _packed_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cu_seqlens_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    group_size,
    head_dim,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    m_tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)

    start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - start
    if m_tile * BLOCK_M >= seq_len:
        return
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < seq_len
    d_mask = offs_d < head_dim
    q_tokens = (start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    kv_head = head // group_size
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = seq_len
    if CAUSAL:
        end = tl.minimum(seq_len, (m_tile + 1) * BLOCK_M)
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k_tokens = (start + offs_n).to(tl.int64)
        k_ptrs = k_ptr + k_tokens[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        v_ptrs = v_ptr + k_tokens[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        # This kernel takes no soft cap (the 1.0 is unused).
        m_i, l_i, acc = online_softmax_tile(
            q, k_ptrs, v_ptrs, n_mask[:, None] & d_mask[None, :], visible, m_i, l_i, acc,
            scale_log2, 1.0, DOT_PRECISION, UPCAST_DOT, False)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


# Triton's CPU interpreter multiplies the raw bits of bf16 dot operands (it stores bf16 as
# uint16), so under TRITON_INTERPRET the kernel feeds tl.dot fp32 copies instead.
_INTERPRETED = not isinstance(_packed_attention_kernel, triton.JITFunction)


def packed_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1] int32, cu_seqlens[-1] == num_tokens
    scale: float,
    max_seq_len: int,
    *,
    causal: bool,
    config: PackedConfig | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each packed sequence over itself (module docstring). ``max_seq_len`` (the
    longest sequence, known on the host) sizes the grid."""
    check_packed(q, k, v, cu_seqlens)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    config = config or PackedConfig()
    grid = (triton.cdiv(max_seq_len, config.block_m), num_heads, num_seqs)
    _packed_attention_kernel[grid](
        q, k, v, cu_seqlens, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        num_heads // k.shape[1],
        head_dim,
        CAUSAL=causal,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=_INTERPRETED and q.dtype == torch.bfloat16,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    return out


def packed_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    causal: bool,
) -> torch.Tensor:
    """Pure-PyTorch packed attention in fp32, one sequence at a time."""
    check_packed(q, k, v, cu_seqlens)
    starts = cu_seqlens.tolist()
    if starts[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens[-1] ({starts[-1]}) != num_tokens ({q.shape[0]})")
    group_size = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for s in range(len(starts) - 1):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        qs = q[lo:hi].float()
        ks = k[lo:hi].float().repeat_interleave(group_size, 1)
        vs = v[lo:hi].float().repeat_interleave(group_size, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale  # [num_heads, len, len]
        if causal:
            pos = torch.arange(hi - lo, device=q.device)
            scores = scores.masked_fill(pos[None, None, :] > pos[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).to(q.dtype)
    return out
