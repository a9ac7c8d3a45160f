"""What the engine gets for a pooling line (embeddings, rerank, score): its inputs as the engine
checked them, shared by ``pipeline.engine_adapter`` and ``pipeline.scoring``."""

from __future__ import annotations

from dataclasses import dataclass

from engine.pooling_params import EmbeddingInputs, PoolingParams


@dataclass(frozen=True)
class PooledInput:
    """A pooling line's inputs as the engine checked them (token ids and params;
    ``add_request`` does not check them again), with ``EngineInput``'s fields it never has."""

    inputs: EmbeddingInputs
    tool_mode: None = None
    format_field: None = None
    response_echo: None = None
    lora_name: None = None

    @property
    def prompt(self) -> EmbeddingInputs:
        return self.inputs

    @property
    def params(self) -> PoolingParams:
        return self.inputs.params

    @property
    def num_tokens(self) -> int:
        return self.inputs.num_tokens
