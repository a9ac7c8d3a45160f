"""Gemma 2 (Gemma Team 2024).

Each layer is a sandwich: RMSNorms before *and after* both attention and the feed-forward,
``h = x + norm(attn(norm(x)))``, ``out = h + norm(mlp(norm(h)))``, with Gemma's ``(1 + weight)``
norms. Local (sliding-window) and global attention layers alternate (``layer_types``, local
first); attention scores are soft-capped, ``cap * tanh(s / cap)``, and scaled by
``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``; the final logits are
soft-capped too. The feed-forward is GeGLU (GELU, tanh approximation); the embeddings are
multiplied by ``sqrt(hidden_size)``; input and output embeddings are tied.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention import SelfAttention
from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.layers.mlp import GatedMLP
from engine.layers.norm import GemmaRMSNorm, residual_stream
from engine.layers.rotary import RotaryEmbedding, rope_parameters_of
from engine.models.causal_lm import CausalLM, check_window, layer_windows
from engine.models.llama import head_dim_of


class GemmaDecoderLayer(nn.Module):
    """Gemma 2 and Gemma 3's layer (Gemma 3 adds q/k norms, passed in as ``qk_norm``)."""

    def __init__(self, config, rotary: RotaryEmbedding, window: int | None,
                 soft_cap: float | None, qk_norm: bool) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = SelfAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, head_dim_of(config),
            rotary, scale=config.query_pre_attn_scalar**-0.5,
            qkv_bias=bool(config.attention_bias), o_bias=bool(config.attention_bias),
            qk_norm=(lambda dim: GemmaRMSNorm(dim, eps)) if qk_norm else None,
            sliding_window=window, soft_cap=soft_cap,
        )
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation,
                            field="hidden_activation")
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        residual = hidden_states  # the fp32 residual stream (engine/layers/norm.py)
        hidden_states = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache,
                                       attn, metadata)
        hidden_states = residual + self.post_attention_layernorm(hidden_states, torch.float32)
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return residual + self.post_feedforward_layernorm(hidden_states, torch.float32)


class GemmaModel(nn.Module):
    """Embeddings scaled by sqrt(hidden), Gemma layers, a final Gemma norm. ``rotary_for``
    gives each layer's rotary embedding (one for Gemma 2; local and global for Gemma 3)."""

    def __init__(self, config, rotary_for, soft_cap: float | None, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Hugging Face multiplies by the scale rounded to the weights' dtype.
        self.embed_scale = float(config.hidden_size**0.5)
        windows = [check_window(w) for w in layer_windows(config)]
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, rotary_for(window), window, soft_cap, qk_norm)
            for window in windows
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        embeddings = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        scale = torch.tensor(self.embed_scale, dtype=embeddings.dtype)
        hidden_states = residual_stream(embeddings * scale)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(positions, hidden_states, kv_cache, attn, metadata)
        return self.norm(hidden_states)


def check_causal(config) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not implemented (a decoder "
                         "generates causally)")


class Gemma2ForCausalLM(CausalLM):
    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        check_causal(config)
        self.final_logit_softcap = config.final_logit_softcapping
        rotary = RotaryEmbedding(head_dim_of(config), max_position, rope_parameters_of(config),
                                 config.max_position_embeddings)
        self.model = GemmaModel(config, lambda window: rotary, config.attn_logit_softcapping,
                                qk_norm=False)
        self.model.rotary_emb = rotary
        self._finish(config, config.intermediate_size)
