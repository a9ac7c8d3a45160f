"""PackedAttentionBackend: attention for pooling steps, where every sequence is computed whole.

It follows the ``AttentionBackend`` interface, so a model file calls it as it calls the paged
backends, but it reads no KV cache and writes none (the ``k_cache``/``v_cache`` arguments are
ignored): a pooling request is prefill-only and keeps nothing after its step. The step's tokens
are its sequences back to back (``metadata.prefill_query_start_loc``); attention never crosses
from one to the next. ``causal`` is off for encoders (BERT) and on for decoders used as embedders.

On the CPU one C++ kernel call covers a layer (``engine/kernels/cpu_packed_attention.py``; the
``torch`` backend or a missing compiler: one SDPA call per sequence over views of the flat
q/k/v, no padding, no copy in); on a GPU (or with ``use_triton``) one Triton launch
(``engine/kernels/packed_attention.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cpu_packed_attention
from engine.layers.attention_metadata import AttentionMetadata


class PackedAttentionBackend:
    name = "packed"

    def __init__(self, *, causal: bool, use_triton: bool, use_cpu_kernel: bool = False) -> None:
        self.causal = causal
        self.use_triton = use_triton
        self.use_cpu_kernel = use_cpu_kernel

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Nothing to plan: sequence offsets are all a layer needs."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        lens = metadata.prefill_query_lens_list
        if self.use_triton:
            from engine.kernels.packed_attention import packed_attention

            return packed_attention(q, k.contiguous(), v.contiguous(),
                                    metadata.prefill_query_start_loc, scale,
                                    max(lens, default=1), causal=self.causal)
        if self.use_cpu_kernel and cpu_packed_attention.available(q):
            return cpu_packed_attention.cpu_packed_attention(
                q, k, v, metadata.prefill_query_start_loc, scale, causal=self.causal)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        start = 0
        for length in lens:
            end = start + length
            # [num_heads, length, head_dim] views of this sequence's rows
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1), is_causal=self.causal, scale=scale,
                enable_gqa=gqa)
            out[start:end] = o.transpose(0, 1)
            start = end
        return out
