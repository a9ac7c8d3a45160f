"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm per head) with a
sparse MoE MLP: softmax over the experts, top ``num_experts_per_tok``, renormalised when
``norm_topk_prob``. Layers listed in ``mlp_only_layers`` (or off the ``decoder_sparse_step``)
keep a dense MLP. No shared experts (Qwen2-MoE has them; see ``qwen2_moe.py``).
"""

from __future__ import annotations

from torch import nn

from engine.layers.moe import MoeConfig, SparseMoeBlock
from engine.models.llama import LlamaAttention
from engine.models.moe_decoder import GatedMLP, MoeDecoderLayer, MoeForCausalLM


def is_sparse_layer(config, layer_idx: int) -> bool:
    """transformers' rule: not in ``mlp_only_layers``, experts at all, on the sparse step."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in mlp_only and config.num_experts > 0
            and (layer_idx + 1) % step == 0)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qkv_bias = False
    qk_norm = True

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
        return GatedMLP(config.hidden_size, config.intermediate_size)

    def make_layer(self, config, layer_idx: int) -> MoeDecoderLayer:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (silu only)")
        attention = LlamaAttention(config, self.qkv_bias or bool(config.attention_bias),
                                   self.qk_norm)
        return MoeDecoderLayer(attention, self.make_mlp(config, layer_idx), config.hidden_size,
                               config.rms_norm_eps)
