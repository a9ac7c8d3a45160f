"""Model classes by their Hugging Face architecture string."""

from __future__ import annotations

from engine.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from engine.models.mixtral import MixtralForCausalLM
from engine.models.moe_decoder import MoeForCausalLM
from engine.models.olmoe import OlmoeForCausalLM
from engine.models.qwen2_moe import Qwen2MoeForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

CausalLM = LlamaForCausalLM | MoeForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}


def get_model_class(config) -> type[CausalLM]:
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {architectures or '(none given)'}; "
        f"supported: {sorted(MODEL_REGISTRY)}"
    )
