"""Mixtral (8x7B, 8x22B): Mistral's attention (a sliding window when the config sets one) with a
sparse MoE MLP: softmax over the ``num_local_experts`` experts, the top ``num_experts_per_tok``
(2), always renormalised, the weights kept in fp32. The hub stores the block as
``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up) and ``w2`` (down)."""

from __future__ import annotations

from engine.layers.attention import SelfAttention
from engine.layers.moe import MoeConfig, SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import DecoderLayer, head_dim_of
from engine.models.moe_decoder import MoeForCausalLM
from engine.models.qwen3_moe import check_silu


class MixtralForCausalLM(MoeForCausalLM):
    EXPERT_PROJECTIONS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")

    def make_layer(self, config, layer_idx: int, rotary: RotaryEmbedding,
                   window: int | None) -> DecoderLayer:
        check_silu(config)
        moe = MoeConfig(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            scoring="softmax_topk",
            renormalize=True,
            fp32_weights=True,
        )
        attention = SelfAttention(config.hidden_size, config.num_attention_heads,
                                  config.num_key_value_heads, head_dim_of(config), rotary,
                                  sliding_window=window)
        return DecoderLayer(attention, SparseMoeBlock(moe), config.hidden_size,
                               config.rms_norm_eps)
