"""The online-softmax step the Triton attention kernels share (paged decode, paged prefill, packed).

Each kernel walks its keys in ``BLOCK_N``-token tiles and keeps, per query row, the running max
``m_i`` (in log2 units), the running denominator ``l_i`` and an fp32 accumulator;
``online_softmax_tile`` folds one tile into them (FlashAttention's update). Where a tile's keys
are is the kernel's business: the paged kernels find them through the block table
(``paged_kv_ptrs``), the packed kernel in the flat batch. These are ``@triton.jit`` device
functions, inlined into the kernels that call them; no kernel lives here.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap_log2(qk, soft_cap):
    """``cap * tanh(s / cap)`` for scores ``qk = s * log2(e)``, still in log2 units. tanh from
    exp (no tanh in every Triton): ``tanh(x) = 1 - 2 / (exp(2x) + 1)``, exact at +-inf."""
    x = qk / (soft_cap * 1.4426950408889634)
    tanh = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    return tanh * soft_cap * 1.4426950408889634


@triton.jit
def paged_kv_ptrs(
    k_base,
    v_base,
    table,
    offs_n,
    n_mask,
    offs_d,
    stride_k_block,
    stride_k_off,
    stride_v_block,
    stride_v_off,
    BLOCK_SIZE: tl.constexpr,
):
    """Pointers to the K and V rows of positions ``offs_n`` of one sequence and kv head, through
    its block table ``table`` (``k_base``/``v_base`` already at the kv head); positions outside
    ``n_mask`` point into block 0 and must not be loaded. Each ``[BLOCK_N, BLOCK_D]``."""
    block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    offsets = offs_n % BLOCK_SIZE
    k_ptrs = (k_base + block_ids[:, None] * stride_k_block + offsets[:, None] * stride_k_off
              + offs_d[None, :])
    v_ptrs = (v_base + block_ids[:, None] * stride_v_block + offsets[:, None] * stride_v_off
              + offs_d[None, :])
    return k_ptrs, v_ptrs


@triton.jit
def online_softmax_tile(
    q,
    k_ptrs,
    v_ptrs,
    kv_mask,
    visible,
    m_i,
    l_i,
    acc,
    scale_log2,
    soft_cap,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
):
    """Fold one key tile into ``(m_i, l_i, acc)`` and return them.

    ``q`` is ``[rows, BLOCK_D]`` (fp32 already when ``UPCAST_DOT``: the interpreter's bf16 dot
    is wrong); ``k_ptrs``/``v_ptrs`` with ``kv_mask`` are the tile's ``[BLOCK_N, BLOCK_D]`` rows;
    ``visible`` (broadcast to ``[rows, BLOCK_N]``) is which keys each query row sees. The max is
    kept at -1e30 or above (no real score is that low), so a row that sees nothing (a padding row
    past the queries) adds zeros rather than NaN, and one that never sees anything ends with
    ``l_i == 0``.
    """
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    if UPCAST_DOT:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if HAS_SOFT_CAP:
        qk = soft_cap_log2(qk, soft_cap)
    qk = tl.where(visible, qk, float("-inf"))  # [rows, BLOCK_N]
    m_new = tl.maximum(tl.maximum(m_i, tl.max(qk, 1)), -1.0e30)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    if UPCAST_DOT:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
