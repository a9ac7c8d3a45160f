"""Paged prefill attention: chunks of new query tokens attend causally to their sequence's KV cache.

Sequence ``s`` has ``query_len = query_start_loc[s + 1] - query_start_loc[s]`` new tokens and
``context_len`` cached tokens in all, the chunk included (``store_kvcache`` wrote it first), so
query ``i`` sits at position ``context_len - query_len + i`` and sees every cached position up to
it. That covers a whole prompt, a later chunk of a long prompt and a prompt behind a prefix-cache
hit alike.

One program handles ``BLOCK_M`` queries of one (sequence, head) with an online softmax over
``BLOCK_N``-token tiles gathered through the block table, accumulating in fp32.

Layer options as in ``paged_decode_attention``: ``window`` (query at p sees p - window + 1 .. p;
tiles wholly before the tile's first window are skipped, never read), ``soft_cap`` and ``sinks``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.checks import check_query_and_cache
from engine.kernels.cpu_decode_attention import check_options
from engine.kernels.online_softmax import online_softmax_tile, paged_kv_ptrs

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Launch knobs; the defaults come from ``_default_config``."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    scale_log2,
    window,
    soft_cap,
    sinks_ptr,
    stride_qt,
    stride_qh,
    stride_kc_block,
    stride_kc_off,
    stride_kc_head,
    stride_vc_block,
    stride_vc_off,
    stride_vc_head,
    stride_bt,
    stride_ot,
    stride_oh,
    group_size,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    m_tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - query_len

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < query_len
    d_mask = offs_d < head_dim
    q_pos = prefix_len + offs_m  # absolute position of each query
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)

    kv_head = head // group_size
    k_base = k_cache_ptr + kv_head * stride_kc_head
    v_base = v_cache_ptr + kv_head * stride_vc_head
    table = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The last query of this tile sees nothing past its own position.
    end = tl.minimum(context_len, prefix_len + (m_tile + 1) * BLOCK_M)
    # ... and, with a window, the first query of the tile nothing before its window.
    begin = 0
    if HAS_WINDOW:
        begin = tl.maximum(prefix_len + m_tile * BLOCK_M - window + 1, 0)
    for start_n in range(begin, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k_ptrs, v_ptrs = paged_kv_ptrs(k_base, v_base, table, offs_n, n_mask, offs_d,
                                       stride_kc_block, stride_kc_off, stride_vc_block,
                                       stride_vc_off, BLOCK_SIZE)
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = online_softmax_tile(
            q, k_ptrs, v_ptrs, n_mask[:, None] & d_mask[None, :], visible, m_i, l_i, acc,
            scale_log2, soft_cap, DOT_PRECISION, UPCAST_DOT, HAS_SOFT_CAP)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_i, sink)
        acc = acc * tl.exp2(m_i - m_all)[:, None]
        l_i = l_i * tl.exp2(m_i - m_all) + tl.exp2(sink - m_all)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


# Triton's CPU interpreter multiplies the raw bits of bf16 dot operands (it stores bf16 as
# uint16), so under TRITON_INTERPRET the kernel feeds tl.dot fp32 copies instead.
_INTERPRETED = not isinstance(_paged_prefill_kernel, triton.JITFunction)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    check_query_and_cache(q, k_cache, v_cache, "num_tokens")
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if context_lens.dim() != 1:
        raise ValueError(f"context_lens must be [num_seqs], got {tuple(context_lens.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [{num_seqs + 1}] (num_seqs + 1), got "
            f"{tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
        )
    for name, t in (
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("context_lens", context_lens),
    ):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got {t.stride()}")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"q, k_cache, v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride 1), got {t.stride()}")
    tensors = (q, k_cache, v_cache, block_tables, query_start_loc, context_lens)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _default_config(head_dim: int) -> PrefillConfig:
    if head_dim > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, prefix + chunk
    scale: float,
    max_query_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each chunk's queries over its sequence's cached context.

    ``max_query_len`` sizes the grid; when ``None`` it is read from ``query_start_loc`` (a device
    sync). ``query_start_loc[-1]`` must equal ``num_tokens``.
    """
    _check(q, k_cache, v_cache, block_tables, query_start_loc, context_lens)
    check_options(q.shape[1], window, soft_cap, sinks)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {q.dtype} {tuple(q.shape)} with stride 1 in head_dim, got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    config = config or _default_config(head_dim)

    grid = (triton.cdiv(max_query_len, config.block_m), num_heads, num_seqs)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale * _LOG2E,
        window or 0,
        soft_cap or 1.0,
        sinks if sinks is not None else out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads // num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=_INTERPRETED and q.dtype == torch.bfloat16,
        HAS_WINDOW=window is not None,
        HAS_SOFT_CAP=soft_cap is not None,
        HAS_SINKS=sinks is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-PyTorch paged prefill attention in fp32, one sequence at a time."""
    _check(q, k_cache, v_cache, block_tables, query_start_loc, context_lens)
    num_tokens, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    if starts[-1] != num_tokens:
        raise ValueError(f"query_start_loc[-1] ({starts[-1]}) != num_tokens ({num_tokens})")
    out = torch.zeros_like(q)
    for s, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[s], starts[s + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        if query_len > context_len:
            raise ValueError(f"sequence {s}: query_len {query_len} > context_len {context_len}")
        blocks = block_tables[s, : math.ceil(context_len / block_size)].long()
        # [context_len, num_heads, head_dim]
        k = k_cache[blocks].flatten(0, 1)[:context_len].float().repeat_interleave(group_size, 1)
        v = v_cache[blocks].flatten(0, 1)[:context_len].float().repeat_interleave(group_size, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), k) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        q_pos = torch.arange(context_len - query_len, context_len, device=q.device)
        k_pos = torch.arange(context_len, device=q.device)
        hidden = k_pos[None, None, :] > q_pos[None, :, None]
        if window is not None:
            hidden |= k_pos[None, None, :] <= q_pos[None, :, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, query_len, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = scores.softmax(dim=-1)[..., :context_len]  # [num_heads, query_len, context_len]
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
