"""The paged KV cache's tensors: how many blocks the budget buys, and for which layers.

Every layer's cache is two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``. Layers
share one block table, except in a model that mixes sliding-window and full-attention layers:
there the windowed layers form a second group with its own, smaller pool
(``engine/core/window_kv.py``), sized for what a windowed layer holds per request,
``(window - 1 + max_num_batched_tokens) / block_size + 1`` blocks, instead of the whole context.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from engine.config import EngineConfig


def zeroed_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zero-filled cache whose host memory is only committed where it is written.

    The attention paths read unwritten slots of a block (masked, then multiplied by 0), so the
    cache must hold zeros, not garbage that could be NaN. ``torch.zeros`` writes every byte up
    front: seconds and the whole budget in RSS for a cache a short run barely touches. On the CPU,
    an anonymous mapping is zero by definition and the kernel hands pages out at the first write;
    the block pool hands blocks out in id order, so the resident part grows with what the run uses.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps ``buffer`` alive; the mapping is released with the last view of it
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


@dataclass(frozen=True)
class KVCacheLayout:
    """Which layers go in which group and how many blocks each group gets."""

    full_layers: list[int]
    window_layers: list[int]  # empty: one group for all layers
    window: int | None  # the windowed group's window (the largest of its layers')
    num_blocks: int  # the full group's (every layer's, with one group)
    num_window_blocks: int  # the windowed group's, its null block included; 0 with one group
    bytes_per_block: int  # of the full group (every layer's with one group)
    window_bytes_per_block: int

    @property
    def total_bytes(self) -> int:
        return (self.num_blocks * self.bytes_per_block
                + self.num_window_blocks * self.window_bytes_per_block)


def window_blocks_per_request(window: int, config: EngineConfig) -> int:
    """The most blocks a windowed layer holds for one request: the window behind its first new
    token plus one step's chunk, over block edges."""
    return -(-(window - 1 + config.max_num_batched_tokens) // config.block_size) + 1


def plan_kv_cache(config: EngineConfig, windows: list[int | None], max_position: int,
                  num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVCacheLayout:
    """Split the layers into groups and size each from ``config`` (its ``num_kv_blocks``, else
    its ``kv_cache_memory`` budget capped at ``max_num_seqs`` full-length sequences and at
    ``max_kv_blocks``)."""
    bs = config.block_size
    element = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * bs * num_kv_heads * head_dim * element
    full = [i for i, w in enumerate(windows) if w is None or w >= max_position]
    windowed = [i for i, w in enumerate(windows) if i not in full]
    blocks_per_seq = -(-max_position // bs)
    if not windowed:
        full = list(range(len(windows)))  # one group: every layer reads the whole context
    window = max((w for i, w in enumerate(windows) if i in windowed and w is not None),
                 default=None)
    bytes_full, bytes_window = per_layer * len(full), per_layer * len(windowed)
    window_per_seq = (min(blocks_per_seq, window_blocks_per_request(window, config))
                      if window is not None else 0)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
        num_window = max(config.num_kv_blocks, window_per_seq) if windowed else 0
    else:
        # Each sequence's worth: its full blocks and its windowed ones.
        per_seq = blocks_per_seq * bytes_full + window_per_seq * bytes_window
        seqs = min(config.kv_cache_memory / per_seq, float(config.max_num_seqs))
        num_window = max(int(seqs * window_per_seq), window_per_seq) if windowed else 0
        # Every layer windowed: the full group is bookkeeping only (hashes, the prefix cache's
        # keys), zero bytes a block, as many blocks as max_num_seqs sequences could use.
        book_seqs = seqs if full else float(config.max_num_seqs)
        num_blocks = min(int(book_seqs * blocks_per_seq), config.max_num_seqs * blocks_per_seq)
        if config.max_kv_blocks is not None:
            num_blocks = min(num_blocks, config.max_kv_blocks)
    if num_blocks < 2 and full:
        raise ValueError(
            f"kv_cache_memory={config.kv_cache_memory} bytes holds {num_blocks} blocks "
            f"of {bytes_full} bytes; give it at least {2 * bytes_full + 2 * bytes_window}"
        )
    if not full:
        num_blocks = max(num_blocks, 2)
    return KVCacheLayout(full, windowed, window, int(num_blocks),
                         int(num_window) + 1 if windowed else 0, bytes_full, bytes_window)


class KVCache:
    """The cache tensors of a layout, and each layer's (k_cache, v_cache) views in layer order."""

    def __init__(self, layout: KVCacheLayout, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        num_layers = len(layout.full_layers) + len(layout.window_layers)
        views: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.tensors: list[torch.Tensor] = []
        for layers, num_blocks in ((layout.full_layers, layout.num_blocks),
                                   (layout.window_layers, layout.num_window_blocks)):
            if not layers:
                continue
            # [num_layers_in_group, 2, num_blocks, block_size, num_kv_heads, head_dim]
            shape = (len(layers), 2, num_blocks, block_size, num_kv_heads, head_dim)
            tensor = zeroed_kv_cache(shape, dtype, device)
            self.tensors.append(tensor)
            for j, layer in enumerate(layers):
                views[layer] = (tensor[j, 0], tensor[j, 1])
        self.layers = [v for v in views if v is not None]
