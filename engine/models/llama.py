"""The Llama family: Llama 2/3.x, SmolLM/SmolLM2, Mistral (and Mistral-Nemo's wider heads),
Qwen2 (q/k/v bias), Qwen3 (q/k norm), Phi-3/Phi-4 (fused q/k/v and gate/up in the checkpoint,
LongRoPE).

Pre-norm decoder (Touvron et al. 2023): ``h = x + attn(rms_norm(x))``, ``out = h +
mlp(rms_norm(h))``, SwiGLU feed-forward, rotary positions. Each layer returns the MLP's output
and the residual before it; the next norm adds them, fused (``RMSNorm.add_and_norm``). The
residual stream is fp32 in every dtype (``engine/layers/norm.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention import SelfAttention
from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm, residual_stream
from engine.layers.rotary import RotaryEmbedding, rope_parameters_of
from engine.models.causal_lm import CausalLM, check_window, layer_windows


class DecoderLayer(nn.Module):
    """``h = x + attn(norm(x)); out = h + mlp(norm(h))``, any attention and MLP (a mixture of
    experts too). Returns the MLP's output and the residual before it, which the next norm adds,
    fused."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int,
                 eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        metadata: AttentionMetadata,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = residual_stream(hidden_states)
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.add_and_norm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn, metadata)
        hidden_states, residual = self.post_attention_layernorm.add_and_norm(
            hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
                 window: int | None) -> None:
        eps = config.rms_norm_eps
        attention = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            head_dim_of(config), rotary, qkv_bias=qkv_bias,
            qk_norm=(lambda dim: RMSNorm(dim, eps)) if qk_norm else None,
            sliding_window=window,
        )
        mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                       getattr(config, "hidden_act", "silu"))
        super().__init__(attention, mlp, config.hidden_size, eps)


class DecoderModel(nn.Module):
    """Embedding, the decoder layers, the final norm: ``[num_tokens]`` ids to hidden states."""

    def __init__(self, config, rotary: RotaryEmbedding, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(
                positions, hidden_states, kv_cache, attn, metadata, residual)
        if residual is None:  # no layers
            return self.norm(hidden_states)
        return self.norm.add_and_norm(hidden_states, residual)[0]


class LlamaModel(DecoderModel):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, max_position: int) -> None:
        rotary = RotaryEmbedding(head_dim_of(config), max_position, rope_parameters_of(config),
                                 config.max_position_embeddings)
        super().__init__(config, rotary, [
            LlamaDecoderLayer(config, rotary, qkv_bias, qk_norm, check_window(window))
            for window in layer_windows(config)
        ])


def head_dim_of(config) -> int:
    """``head_dim`` when the config sets it (Qwen3, Mistral-Nemo: not hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaForCausalLM(CausalLM):
    # Qwen2 puts biases on q/k/v; Qwen3 normalizes q and k per head.
    qkv_bias = False
    qk_norm = False

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not implemented")
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, field, None) is not None:
                # transformers' Llama-family models ignore it; refusing beats a silent difference
                raise ValueError(f"{field} is not part of {type(self).__name__} (transformers "
                                 "ignores it); remove it from the config")
        self.model = LlamaModel(config, qkv_bias, self.qk_norm, max_position)
        self._finish(config, config.intermediate_size)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
