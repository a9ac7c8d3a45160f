"""Self-attention over the paged KV cache, with the options the families need.

``Attention`` is the attention op of one layer: it hands q/k/v to the step's backend with this
layer's options, each off by default:

- ``sliding_window``: a query at position p sees the keys at positions ``p - window + 1 .. p``
  (Mistral, Gemma 2's every other layer, Gemma 3's local layers, Phi-3);
- ``soft_cap``: scores become ``cap * tanh(score / cap)`` before the softmax (Gemma 2);
- ``sinks``: one learned logit per head joins each softmax's denominator and attends to nothing
  (gpt-oss): ``softmax([scores, sink])`` with the sink's column dropped.

``SelfAttention`` is the block around it that every family here shares: one packed q/k/v
projection (Hugging Face's ``q_proj``/``k_proj``/``v_proj``, or Phi-3's ``qkv_proj`` as is),
optional per-head q/k norms (Qwen3, Gemma 3), rotary, the op, ``o_proj``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.layers.linear import Linear
from engine.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
        sliding_window: int | None = None, soft_cap: float | None = None,
        use_sinks: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if soft_cap is not None and soft_cap <= 0:
            raise ValueError(f"attn_logit_softcapping must be > 0, got {soft_cap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        # [num_heads]: gpt-oss's name for the learned sink logits
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if use_sinks else None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [num_heads]: a parameter of the caller's module
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if sinks is None:
            sinks = self.sinks
        if self.sliding_window is not None and metadata.window is not None:
            metadata = metadata.window  # this layer's blocks live in the windowed group
        return attn.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale,
                            window=self.sliding_window, soft_cap=self.soft_cap,
                            sinks=sinks)


class SelfAttention(nn.Module):
    """Projections, rotary and the attention op of one decoder layer."""

    # q_norm / k_norm (where there are) run over one head's values; a family whose norms run
    # over every head at once (OLMoE) says so, and tensor parallel all-reduces them.
    norms_span_heads = False

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
        rotary: RotaryEmbedding, *, scale: float | None = None, qkv_bias: bool = False,
        o_bias: bool = False, qk_norm: Callable[[int], nn.Module] | None = None,
        sliding_window: int | None = None, soft_cap: float | None = None,
        use_sinks: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, qkv_bias)
        self.o_proj = Linear(self.q_size, hidden_size, bias=o_bias)
        self.q_norm = qk_norm(head_dim) if qk_norm is not None else None
        self.k_norm = qk_norm(head_dim) if qk_norm is not None else None
        self.rotary = [rotary]  # shared by the layers: kept out of this module's children
        self.attn = Attention(num_heads, num_kv_heads, head_dim,
                              head_dim**-0.5 if scale is None else scale,
                              sliding_window=sliding_window, soft_cap=soft_cap)
        # [num_heads]: Hugging Face's name for gpt-oss's sinks is ``self_attn.sinks``
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if use_sinks else None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        rotary = self.rotary[0]
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = rotary.rotate_(positions, q), rotary.rotate_(positions, k)
        else:
            # q and k side by side in qkv: rotate both in one pass.
            qk = qkv[:, : self.q_size + self.kv_size].unflatten(-1, (-1, self.head_dim))
            # [num_tokens, num_heads + num_kv_heads, head_dim]; qkv is this call's own tensor
            qk = rotary.rotate_(positions, qk)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        o = self.attn(q, k, v, kv_cache, attn, metadata, self.sinks)
        return self.o_proj(o.reshape(num_tokens, self.q_size))
