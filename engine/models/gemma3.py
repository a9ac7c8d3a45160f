"""Gemma 3, text (Gemma Team 2025): Gemma 2's sandwich layer with per-head q/k RMSNorms in place
of attention soft-capping, and a local/global pattern of five sliding-window layers to one
global (``layer_types``, from ``sliding_window_pattern``). Local layers rotate with their own
base (``rope_local_base_freq``, or ``rope_parameters["sliding_attention"]``); global layers
with ``rope_theta`` and the checkpoint's rope scaling (linear x8 on the 4B-27B models).

Registered for ``Gemma3ForCausalLM`` (the 1B text checkpoint, ``model_type`` gemma3_text).
"""

from __future__ import annotations

from typing import Any

from engine.layers.rotary import RotaryEmbedding
from engine.models.causal_lm import CausalLM
from engine.models.gemma2 import GemmaModel, check_causal
from engine.models.llama import head_dim_of


def gemma3_rope_parameters(config) -> dict[str, dict[str, Any]]:
    """{"full_attention": ..., "sliding_attention": ...} from transformers 5's nested
    ``rope_parameters`` (or the legacy ``rope_theta`` / ``rope_local_base_freq`` /
    ``rope_scaling`` fields)."""
    nested = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        return {kind: dict(nested.get(kind) or {"rope_type": "default"})
                for kind in ("full_attention", "sliding_attention")}
    full = dict(getattr(config, "rope_scaling", None) or nested or {})
    full.setdefault("rope_theta", getattr(config, "rope_theta", 1_000_000.0))
    local = {"rope_type": "default",
             "rope_theta": getattr(config, "rope_local_base_freq", 10_000.0)}
    return {"full_attention": full, "sliding_attention": local}


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        check_causal(config)
        if getattr(config, "attn_logit_softcapping", None) is not None:
            # Hugging Face's Gemma 3 never applies it; refusing beats a silent difference.
            raise ValueError("attn_logit_softcapping is not part of Gemma 3 (transformers "
                             "ignores it); remove it from the config")
        self.final_logit_softcap = config.final_logit_softcapping
        params = gemma3_rope_parameters(config)
        head_dim = head_dim_of(config)
        self.rotary_global = RotaryEmbedding(head_dim, max_position, params["full_attention"],
                                             config.max_position_embeddings)
        self.rotary_local = RotaryEmbedding(head_dim, max_position, params["sliding_attention"],
                                            config.max_position_embeddings)
        self.model = GemmaModel(
            config,
            lambda window: self.rotary_global if window is None else self.rotary_local,
            None, qk_norm=True,
        )
        self._finish(config, config.intermediate_size)
