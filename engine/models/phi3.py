"""Phi-3 / Phi-4 (Abdin et al. 2024): the Llama decoder with q/k/v and gate/up stored fused in
the checkpoint (``qkv_proj``, ``gate_up_proj``: the engine's own packed layout, loaded as is),
LongRoPE scaling (``rope_scaling`` type ``longrope``/``su``), an optional sliding window on every
layer, and a partial rotary factor on Phi-4-mini."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Everything Phi-3 differs in is data: the config's rope and window, the fused names."""
