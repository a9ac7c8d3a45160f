"""Pooling models by their Hugging Face architecture string: encoders, cross-encoders (one
relevance score per pair of texts), and decoders pooled
by their last token (a base-model architecture such as ``Qwen3Model``, or a causal-LM one that
``EngineConfig.task='embed'`` or a sentence-transformers folder turns into an embedder)."""

from __future__ import annotations

from engine.layers.pooling import PoolingType
from engine.models.bert import BertModel
from engine.models.bert_classifier import BertForSequenceClassification
from engine.models.decoder_embedding import DecoderEmbeddingModel
from engine.models.registry import MODEL_REGISTRY

ENCODER_ARCHITECTURES: dict[str, type[BertModel]] = {"BertModel": BertModel}
# Cross-encoders: a pair of texts in, one relevance score out (/v1/score, /v1/rerank).
CROSS_ENCODER_ARCHITECTURES = {"BertForSequenceClassification": BertForSequenceClassification}
# Base-model architectures of the decoder families: an embedding checkpoint's own name.
DECODER_BASE_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
EMBEDDING_ONLY_ARCHITECTURES = (*ENCODER_ARCHITECTURES, *DECODER_BASE_ARCHITECTURES,
                                *CROSS_ENCODER_ARCHITECTURES)


def is_embedding_architecture(architecture: str) -> bool:
    return architecture in EMBEDDING_ONLY_ARCHITECTURES


EmbeddingModel = BertModel | DecoderEmbeddingModel | BertForSequenceClassification


def build_embedding_model(config, max_position: int) -> tuple[EmbeddingModel, PoolingType]:
    """The model for ``config.architectures[0]`` and the pooling its kind defaults to."""
    architecture = (list(getattr(config, "architectures", None) or []) or [""])[0]
    if architecture in ENCODER_ARCHITECTURES:
        encoder = ENCODER_ARCHITECTURES[architecture](config, max_position)
        return encoder, PoolingType.CLS
    if architecture in CROSS_ENCODER_ARCHITECTURES:  # its score reads the [CLS] state
        return CROSS_ENCODER_ARCHITECTURES[architecture](config, max_position), PoolingType.CLS
    causal_lm = DECODER_BASE_ARCHITECTURES.get(architecture, architecture)
    if causal_lm in MODEL_REGISTRY:
        model = DecoderEmbeddingModel(config, MODEL_REGISTRY[causal_lm], max_position)
        return model, PoolingType.LAST
    raise ValueError(f"architecture {architecture!r} cannot embed; supported: "
                     f"{sorted([*EMBEDDING_ONLY_ARCHITECTURES, *MODEL_REGISTRY])}")
