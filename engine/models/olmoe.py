"""OLMoE (OLMoE-1B-7B): attention whose q and k are RMS-normalised over all heads at once (not
per head, as Qwen3 does), optionally clipped to ``clip_qkv``, and a sparse MoE MLP routed as
Qwen3-MoE routes it (softmax, top-k, renormalised when ``norm_topk_prob``)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.layers.linear import Linear
from engine.layers.moe import MoeConfig, SparseMoeBlock
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.moe_decoder import MoeDecoderLayer, MoeForCausalLM


class OlmoeAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.clip_qkv: float | None = getattr(config, "clip_qkv", None)
        bias = bool(config.attention_bias)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias)
        # transformers sizes k_norm by hidden_size // heads, whatever head_dim says
        self.q_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.k_norm = RMSNorm((config.hidden_size // self.num_heads) * self.num_kv_heads,
                              config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                rotary: RotaryEmbedding, kv_cache: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size],
                                                     dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)  # [num_tokens, q_size], [num_tokens, kv_size]
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = rotary.rotate(positions, q.view(num_tokens, self.num_heads, self.head_dim))
        k = rotary.rotate(positions, k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        o = attn.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class OlmoeForCausalLM(MoeForCausalLM):
    def make_layer(self, config, layer_idx: int) -> MoeDecoderLayer:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (silu only)")
        moe = MoeConfig(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            scoring="softmax_topk",
            renormalize=bool(config.norm_topk_prob),
        )
        return MoeDecoderLayer(OlmoeAttention(config), SparseMoeBlock(moe), config.hidden_size,
                               config.rms_norm_eps)
