"""AttentionMetadata and the AttentionBackend interface every attention implementation follows.

The KV cache of one layer is two tensors ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's *slot* is
``block_id * block_size + offset``. The tokens of a step are laid out flat: first ``num_decodes``
single-token decodes, then the prefill chunks back to back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    # [num_tokens] int64: the cache slot each new token's K/V is written to.
    slot_mapping: torch.Tensor
    num_decodes: int
    # [num_decodes, max_blocks] int32 block tables, [num_decodes] int32 context lengths
    # (the new token included).
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    num_prefills: int
    # [num_prefills + 1] int32 offsets of each chunk among the prefill tokens (0-based at the
    # first prefill token, i.e. token index num_decodes of the step).
    prefill_query_start_loc: torch.Tensor
    # [num_prefills, max_blocks] int32, [num_prefills] int32 context lengths (prefix + chunk).
    prefill_block_tables: torch.Tensor
    prefill_context_lens: torch.Tensor
    # Host-side copies for backends that plan on the CPU.
    prefill_query_lens_list: list[int] = field(default_factory=list)
    prefill_context_lens_list: list[int] = field(default_factory=list)
    decode_context_lens_list: list[int] = field(default_factory=list)
    # Backend-private precomputed state (e.g. gather indices), filled by ``prepare``.
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # Where the sliding-window layers keep their own blocks (engine/core/window_kv.py): the same
    # step with their slot mapping and block tables; None when every layer shares one table.
    window: AttentionMetadata | None = None

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


class AttentionBackend(Protocol):
    """Writes the step's new K/V into the paged cache, then attends over it."""

    name: str

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Precompute per-step state once, before the first layer runs."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,  # each query sees the last `window` positions only
        soft_cap: float | None = None,  # scores -> soft_cap * tanh(score / soft_cap)
        sinks: torch.Tensor | None = None,  # [num_heads] logits joining each denominator
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
