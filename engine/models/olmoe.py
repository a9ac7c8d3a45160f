"""OLMoE (OLMoE-1B-7B): attention whose q and k are RMS-normalised over all heads at once (not
per head, as Qwen3 does), optionally clipped to ``clip_qkv``, and a sparse MoE MLP routed as
Qwen3-MoE routes it (softmax, top-k, renormalised when ``norm_topk_prob``)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.layers.attention import SelfAttention
from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.layers.moe import MoeConfig, SparseMoeBlock
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import DecoderLayer, head_dim_of
from engine.models.moe_decoder import MoeForCausalLM
from engine.models.qwen3_moe import check_silu


class OlmoeAttention(SelfAttention):
    norms_span_heads = True

    def __init__(self, config, rotary: RotaryEmbedding, window: int | None) -> None:
        bias = bool(config.attention_bias)
        super().__init__(config.hidden_size, config.num_attention_heads,
                         config.num_key_value_heads, head_dim_of(config), rotary,
                         qkv_bias=bias, o_bias=bias, sliding_window=window)
        self.clip_qkv: float | None = getattr(config, "clip_qkv", None)
        # over every head's q (k) at once: transformers sizes them by hidden_size (and
        # hidden // heads per kv head), the same sizes
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend,
                metadata: AttentionMetadata) -> torch.Tensor:
        rotary = self.rotary[0]
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size],
                                                     dim=-1)
        # [num_tokens, q_size], [num_tokens, kv_size]
        q, k = cast(nn.Module, self.q_norm)(q), cast(nn.Module, self.k_norm)(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = rotary.rotate(positions, q.view(num_tokens, self.num_heads, self.head_dim))
        k = rotary.rotate(positions, k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v, kv_cache, attn, metadata)
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class OlmoeForCausalLM(MoeForCausalLM):
    def make_layer(self, config, layer_idx: int, rotary: RotaryEmbedding,
                   window: int | None) -> DecoderLayer:
        check_silu(config)
        moe = MoeConfig(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            scoring="softmax_topk",
            renormalize=bool(config.norm_topk_prob),
        )
        return DecoderLayer(OlmoeAttention(config, rotary, window), SparseMoeBlock(moe),
                               config.hidden_size, config.rms_norm_eps)
