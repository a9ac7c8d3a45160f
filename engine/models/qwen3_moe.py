"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm per head) with a
sparse MoE MLP: softmax over the experts, top ``num_experts_per_tok``, renormalised when
``norm_topk_prob``. Layers listed in ``mlp_only_layers`` (or off the ``decoder_sparse_step``)
keep a dense MLP. No shared experts (Qwen2-MoE has them: ``qwen2_moe.py``).
"""

from __future__ import annotations

from torch import nn

from engine.layers.attention import SelfAttention
from engine.layers.mlp import GatedMLP
from engine.layers.moe import MoeConfig, SparseMoeBlock
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import DecoderLayer, head_dim_of
from engine.models.moe_decoder import MoeForCausalLM


def is_sparse_layer(config, layer_idx: int) -> bool:
    """transformers' rule: not in ``mlp_only_layers``, experts at all, on the sparse step."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in mlp_only and config.num_experts > 0
            and (layer_idx + 1) % step == 0)


def check_silu(config) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} is not implemented for the experts "
                         "(the engine has silu)")


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def moe_config(self, config) -> MoeConfig:
        return MoeConfig(
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            scoring="softmax_topk",
            renormalize=bool(config.norm_topk_prob),
        )

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return SparseMoeBlock(self.moe_config(config))
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def make_layer(self, config, layer_idx: int, rotary: RotaryEmbedding,
                   window: int | None) -> DecoderLayer:
        check_silu(config)
        eps = config.rms_norm_eps
        attention = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            head_dim_of(config), rotary,
            qkv_bias=self.qkv_bias(config),
            qk_norm=(lambda dim: RMSNorm(dim, eps)) if self.qk_norm else None,
            sliding_window=window,
        )
        return DecoderLayer(attention, self.make_mlp(config, layer_idx), config.hidden_size,
                               eps)
