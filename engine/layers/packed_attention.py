"""PackedAttentionBackend: attention for pooling steps, where every sequence is computed whole.

It follows the ``AttentionBackend`` interface, so a model file calls it as it calls the paged
backends, but it reads no KV cache and writes none (the ``k_cache``/``v_cache`` arguments are
ignored): a pooling request is prefill-only and keeps nothing after its step. The step's tokens
are its sequences back to back (``metadata.prefill_query_start_loc``); attention never crosses
from one to the next. ``causal`` is off for encoders (BERT) and on for decoders used as embedders.

A layer's options (``engine/layers/attention.py``) are honoured too: a sliding window narrows a
causal sequence's mask to its last ``window`` positions, a soft-cap or sinks take the explicit
softmax (``attend_ref``); such a layer attends one sequence at a time in torch (the kernels below
compute plain attention only).

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
from engine.layers.torch_attention import attend_ref


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
        *,
        window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        lens = metadata.prefill_query_lens_list
        if window is not None and window >= max(lens, default=0):
            window = None  # every sequence fits in the window: plain attention
        if window is not None or soft_cap is not None or sinks is not None:
            return self._with_options(q, k, v, lens, scale, window, soft_cap, sinks)
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

    def _with_options(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                      scale: float, window: int | None, soft_cap: float | None,
                      sinks: torch.Tensor | None) -> torch.Tensor:
        """One sequence at a time, with the layer's window, soft-cap and sinks."""
        if window is not None and not self.causal:
            raise ValueError("a sliding window needs causal attention (an embedding decoder)")
        out = torch.empty_like(q)
        start = 0
        for length in lens:
            end = start + length
            # [1, num_heads, length, head_dim] views of this sequence's rows
            qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            mask = None
            if self.causal:
                pos = torch.arange(length, device=q.device)
                mask = pos[None, :] <= pos[:, None]  # [q, k]: key at or before the query
                if window is not None:
                    mask &= pos[None, :] > pos[:, None] - window
            if soft_cap is None and sinks is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                   enable_gqa=q.shape[1] != k.shape[1])
            else:
                o = attend_ref(qs, ks, vs, mask, scale, soft_cap, sinks)
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out
