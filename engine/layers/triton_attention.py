"""TritonAttentionBackend: the GPU attention path, built on the three paged-KV Triton kernels.

Per layer: write the step's new K/V into the cache, run the decode kernel on the first
``num_decodes`` tokens and the prefill kernel on the chunks after them. The decode half reads
only tensors from the metadata and never syncs with the host, so it can be captured in a CUDA
graph (see ``engine/runner/cuda_graphs.py``).
"""

from __future__ import annotations

import torch

from engine.kernels.paged_decode_attention import paged_decode_attention
from engine.kernels.paged_prefill_attention import paged_prefill_attention
from engine.kernels.store_kvcache import store_kvcache
from engine.layers.attention_metadata import AttentionMetadata


class TritonAttentionBackend:
    """AttentionBackend over Triton kernels; CUDA tensors (or CPU under ``TRITON_INTERPRET=1``)."""

    name = "triton"

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Nothing to precompute: the kernels read the block tables and lengths directly."""

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
        window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        num_tokens = q.shape[0]
        num_decodes = metadata.num_decodes
        store_kvcache(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        if num_decodes:
            paged_decode_attention(
                q[:num_decodes],
                k_cache,
                v_cache,
                metadata.decode_block_tables,
                metadata.decode_context_lens,
                scale,
                out=out[:num_decodes],
                window=window, soft_cap=soft_cap, sinks=sinks,
            )
        if num_tokens > num_decodes:
            query_lens = metadata.prefill_query_lens_list
            paged_prefill_attention(
                q[num_decodes:],
                k_cache,
                v_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start_loc,
                metadata.prefill_context_lens,
                scale,
                max(query_lens) if query_lens else None,
                out=out[num_decodes:],
                window=window, soft_cap=soft_cap, sinks=sinks,
            )
        return out
