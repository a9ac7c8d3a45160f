"""An embedding request's inputs, checked against the model: one text or token-id list, or a
list of them; typed errors (``EmbeddingInputError`` and its kinds, with the input's ``index``)
a caller maps to its own codes. No torch here: the worker's pipeline imports this before its
engine is built."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import (
    DimensionsNotSupported,
    EmbeddingInputError,
    EmptyInput,
    InputTooLong,
    NotAnEmbeddingModel,
    TokenOutOfVocabulary,
)

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.pooling.runner import PoolingModelRunner


def pooling_runner(engine: LLMEngine) -> PoolingModelRunner:
    from engine.pooling.runner import PoolingModelRunner

    runner = engine.model_runner
    if not isinstance(runner, PoolingModelRunner):
        raise NotAnEmbeddingModel(f"model {engine.model_name} generates text; it does not "
                                  "embed")
    return runner


def embedding_size(engine: LLMEngine) -> int:
    return pooling_runner(engine).hidden_size


def matryoshka_dimensions(engine: LLMEngine) -> tuple[int, ...] | None:
    return pooling_runner(engine).pooler.matryoshka_dimensions


def check_dimensions(engine: LLMEngine, dimensions: int | None) -> None:
    if dimensions is None:
        return
    dims = matryoshka_dimensions(engine)
    if dims is None:
        raise DimensionsNotSupported(
            f"model {engine.model_name} does not support dimensions (it declares no "
            "Matryoshka dimensions); leave it out")
    size = embedding_size(engine)
    if dimensions > size:
        raise DimensionsNotSupported(f"dimensions must be at most {size} for model "
                                     f"{engine.model_name}, got {dimensions}")
    if dimensions not in dims and dimensions != size:
        raise DimensionsNotSupported(f"dimensions must be one of {[*dims]} for model "
                                     f"{engine.model_name}, got {dimensions}")


def split_inputs(prompt: Any) -> list[str | list[int]]:
    """One input (a text, a token-id list) or several, as a list of inputs."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list | tuple):
        raise EmbeddingInputError(f"input must be a string or a list, got "
                                  f"{type(prompt).__name__}")
    if not prompt:
        raise EmptyInput("input is empty")
    if isinstance(prompt[0], int) and not isinstance(prompt[0], bool):
        return [list(prompt)]
    return list(prompt)


def encode_inputs(engine: LLMEngine, inputs: Sequence[str | list[int]]) -> list[list[int]]:
    """Each input's token ids, checked (module docstring); typed errors name the input."""
    if not inputs:
        raise EmptyInput("input is empty")
    max_len = engine.max_model_len
    vocab = engine.model_runner.vocab_size
    truncate = engine.config.truncate_embedding_inputs
    token_ids: list[list[int]] = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise EmptyInput("input is an empty string", index)
            if truncate:
                ids = list(engine.tokenizer(item, truncation=True, max_length=max_len).input_ids)
            else:
                ids = list(engine.tokenizer(item).input_ids)
        elif isinstance(item, list | tuple):
            if not item:
                raise EmptyInput("input is an empty list of token ids", index)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                raise EmbeddingInputError("token ids must be integers", index)
            ids = list(item[:max_len] if truncate else item)
            low, high = min(ids), max(ids)
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise TokenOutOfVocabulary(f"token id {bad} is outside the model's vocabulary "
                                           f"(ids 0 to {vocab - 1})", index)
        else:
            raise EmbeddingInputError(f"an input must be a string or a list of token ids, got "
                                      f"{type(item).__name__}", index)
        if not ids:
            raise EmptyInput("input has no tokens", index)
        if len(ids) > max_len:
            raise InputTooLong(f"input is {len(ids)} tokens; this model's maximum input "
                               f"length is {max_len} tokens", index)
        token_ids.append(ids)
    return token_ids
