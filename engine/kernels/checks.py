"""Shape checks shared by the attention kernels' launchers: clear ValueErrors, never asserts."""

from __future__ import annotations

import torch


def check_query_and_cache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_layout: str
) -> None:
    """q is ``[rows, num_heads, head_dim]``; the caches are ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` with a power-of-two block size and heads that group evenly."""
    if q.dim() != 3:
        raise ValueError(f"q must be [{q_layout}, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
