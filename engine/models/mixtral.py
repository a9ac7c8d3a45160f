"""Mixtral (8x7B, 8x22B): Mistral's attention with a sparse MoE MLP: softmax over the
``num_local_experts`` experts, the top ``num_experts_per_tok`` (2), always renormalised, the
weights kept in fp32. The hub stores the block as ``block_sparse_moe`` with experts ``w1`` (gate),
``w3`` (up) and ``w2`` (down)."""

from __future__ import annotations

from engine.layers.moe import MoeConfig, SparseMoeBlock
from engine.models.llama import LlamaAttention
from engine.models.moe_decoder import MoeDecoderLayer, MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    EXPERT_PROJECTIONS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")

    def make_layer(self, config, layer_idx: int) -> MoeDecoderLayer:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (silu only)")
        moe = MoeConfig(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            scoring="softmax_topk",
            renormalize=True,
            fp32_weights=True,
        )
        return MoeDecoderLayer(LlamaAttention(config, False, False), SparseMoeBlock(moe),
                               config.hidden_size, config.rms_norm_eps)
