"""Paged decode attention: one query token per sequence over its paged KV cache (flash-decoding).

One program handles one (sequence, kv head, split): the query heads that share the kv head are
one ``tl.dot`` tile, so each K/V row is read from memory once per kv head. A sequence's context is
cut into ``num_splits`` even ranges; each split keeps its partial max, sum and fp32 accumulator and
a second, tiny kernel merges them. With one split the first kernel writes the output directly.

The grid depends only on tensor shapes and the launcher never reads device memory, so a launch is
safe inside a CUDA graph. Rows with ``context_len == 0`` (graph padding) produce zeros.

Layer options: ``window`` (the query sees the last ``window`` positions: the splits cover only
those, and blocks before them are never read), ``soft_cap`` (``cap * tanh(score / cap)`` before
the softmax) and ``sinks`` (one logit per head added to the denominator, at the merge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels import cpu_decode_attention
from engine.kernels.checks import check_query_and_cache
from engine.kernels.cpu_decode_attention import check_options
from engine.kernels.online_softmax import online_softmax_tile, paged_kv_ptrs

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16
# A split is worth its merge cost only if it covers at least this many tokens of the longest
# context the block table allows.
_MIN_TOKENS_PER_SPLIT = 256


@dataclass(frozen=True)
class DecodeConfig:
    """Launch knobs; the defaults come from ``_default_config``."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    scale_log2,
    window,
    soft_cap,
    sinks_ptr,
    stride_qb,
    stride_qh,
    stride_kc_block,
    stride_kc_off,
    stride_kc_head,
    stride_vc_block,
    stride_vc_off,
    stride_vc_head,
    stride_bt,
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    group_size,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(context_len - window, 0)
    # Even split of the positions this query sees, in whole tiles.
    tiles_per_split = tl.cdiv(tl.cdiv(context_len - first, BLOCK_N), num_splits)
    start = first + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * group_size + offs_g
    g_mask = offs_g < group_size
    d_mask = offs_d < head_dim
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kc_head
    v_base = v_cache_ptr + kv_head * stride_vc_head
    table = block_tables_ptr + seq * stride_bt
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k_ptrs, v_ptrs = paged_kv_ptrs(k_base, v_base, table, offs_n, n_mask, offs_d,
                                       stride_kc_block, stride_kc_off, stride_vc_block,
                                       stride_vc_off, BLOCK_SIZE)
        m_i, l_i, acc = online_softmax_tile(
            q, k_ptrs, v_ptrs, n_mask[:, None] & d_mask[None, :], n_mask[None, :], m_i, l_i, acc,
            scale_log2, soft_cap, DOT_PRECISION, UPCAST_DOT, HAS_SOFT_CAP)

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
            sink = sink * 1.4426950408889634
            m_all = tl.maximum(m_i, sink)
            acc = acc * tl.exp2(m_i - m_all)[:, None]
            l_i = l_i * tl.exp2(m_i - m_all) + tl.exp2(sink - m_all)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        rows = (seq * num_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_m_ptr + rows, m_i, mask=g_mask)
        tl.store(part_l_ptr + rows, l_i, mask=g_mask)
        tl.store(part_acc_ptr + rows[:, None] * head_dim + offs_d[None, :], acc, mask=out_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    sinks_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim
    rows = (seq * num_heads + head) * num_splits + offs_s

    m = tl.load(part_m_ptr + rows, mask=s_mask, other=float("-inf"))
    l_split = tl.load(part_l_ptr + rows, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: context_len == 0
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    weights = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(weights * l_split, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_max)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.load(
        part_acc_ptr + rows[:, None] * head_dim + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    out = tl.sum(acc * weights[:, None], 0) / denom
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


# Triton's CPU interpreter multiplies the raw bits of bf16 dot operands (it stores bf16 as
# uint16), so under TRITON_INTERPRET the kernel feeds tl.dot fp32 copies instead.
_INTERPRETED = not isinstance(_paged_decode_kernel, triton.JITFunction)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    check_query_and_cache(q, k_cache, v_cache, "batch")
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [{batch}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [{batch}], got {tuple(context_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
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
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def default_num_splits(
    batch: int, num_kv_heads: int, max_context_len: int, device: torch.device
) -> int:
    """Enough splits to give every SM a few programs, from shapes alone (graph-safe)."""
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 8
    )
    wanted = math.ceil(4 * num_sms / max(1, batch * num_kv_heads))
    worthwhile = math.ceil(max_context_len / _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, worthwhile, _MAX_SPLITS))


def _default_config(head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    # Keep one K tile near 16 KiB: 64 rows of 128 bf16 values.
    row_bytes = triton.next_power_of_2(head_dim) * dtype.itemsize
    block_n = max(16, min(128, 16384 // row_bytes))
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=2)


def paged_decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    context_lens: torch.Tensor,  # [batch] int32, the new token included
    scale: float,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [batch, num_heads, head_dim]
    """Attention of each sequence's one query token over its first ``context_len`` cache slots
    (its last ``window`` of them with a window)."""
    _check(q, k_cache, v_cache, block_tables, context_lens)
    check_options(q.shape[1], window, soft_cap, sinks)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {q.dtype} {tuple(q.shape)} with stride 1 in head_dim, got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )
    if batch == 0:
        return out
    if num_splits is None:
        max_context_len = block_tables.shape[1] * block_size
        if window is not None:
            max_context_len = min(max_context_len, window)
        num_splits = default_num_splits(batch, num_kv_heads, max_context_len, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    config = config or _default_config(head_dim, q.dtype)

    group_size = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    single = num_splits == 1
    if single:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_m,
        part_l,
        part_acc,
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
        num_heads,
        num_splits,
        group_size,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        BLOCK_N=config.block_n,
        BLOCK_D=block_d,
        SINGLE_SPLIT=single,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=_INTERPRETED and q.dtype == torch.bfloat16,
        HAS_WINDOW=window is not None,
        HAS_SOFT_CAP=soft_cap is not None,
        HAS_SINKS=sinks is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not single:
        _paged_decode_reduce_kernel[(batch, num_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            sinks if sinks is not None else out,
            out.stride(0),
            out.stride(1),
            num_heads,
            num_splits,
            head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            HAS_SINKS=sinks is not None,
            num_warps=4,
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-PyTorch paged decode attention in fp32, one sequence at a time."""
    _check(q, k_cache, v_cache, block_tables, context_lens)
    return cpu_decode_attention.paged_decode_attention_ref(
        q, k_cache, v_cache, block_tables, context_lens, scale, window, soft_cap, sinks)
