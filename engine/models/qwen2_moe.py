"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with a sparse
MoE MLP as Qwen3-MoE routes it, plus a shared expert every token passes through, scaled by a
sigmoid gate (``shared_expert_gate``)."""

from __future__ import annotations

from torch import nn

from engine.layers.mlp import GatedMLP
from engine.layers.moe import SparseMoeBlock
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    qk_norm = False

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "qkv_bias", True))  # Qwen2MoeConfig's field, default on

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        shared = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                          config.hidden_act)
        return SparseMoeBlock(self.moe_config(config), shared, shared_expert_gate=True)
