"""An embedding request's inputs, checked against the model: one text or token-id list, or a
list of them; typed errors (``engine.errors.EmbeddingInputError`` and its kinds, with the input's
``index``) a caller maps to its own codes. No torch here, and no engine: the checks take the
model's limits (``EmbeddingSpec``, fixed at start-up) and a tokenize function."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.errors import (
    DimensionsNotSupported,
    EmbeddingInputError,
    EmptyInput,
    InputTooLong,
    TokenOutOfVocabulary,
)
from engine.pooling_params import EmbeddingSpec

# text, max_length (None: no truncation) -> token ids
Tokenize = Callable[[str, int | None], list[int]]


def check_dimensions(spec: EmbeddingSpec, dimensions: int | None) -> None:
    if dimensions is None:
        return
    dims = spec.matryoshka_dimensions
    if dims is None:
        raise DimensionsNotSupported(
            f"model {spec.model_name} does not support dimensions (it declares no "
            "Matryoshka dimensions); leave it out")
    size = spec.hidden_size
    if dimensions > size:
        raise DimensionsNotSupported(f"dimensions must be at most {size} for model "
                                     f"{spec.model_name}, got {dimensions}")
    if dimensions not in dims and dimensions != size:
        raise DimensionsNotSupported(f"dimensions must be one of {[*dims]} for model "
                                     f"{spec.model_name}, got {dimensions}")


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


def encode_inputs(inputs: Sequence[str | list[int]], tokenize: Tokenize,
                  spec: EmbeddingSpec) -> list[list[int]]:
    """Each input's token ids, checked (module docstring); typed errors name the input."""
    if not inputs:
        raise EmptyInput("input is empty")
    max_len, vocab = spec.max_len, spec.vocab_size
    token_ids: list[list[int]] = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise EmptyInput("input is an empty string", index)
            ids = tokenize(item, max_len if spec.truncate else None)
        elif isinstance(item, list | tuple):
            if not item:
                raise EmptyInput("input is an empty list of token ids", index)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                raise EmbeddingInputError("token ids must be integers", index)
            ids = list(item[:max_len] if spec.truncate else item)
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


def pair_token_ids(first: list[int], second: list[int]) -> tuple[list[int], int]:
    """A cross-encoder's pair from its two texts' token ids, each with the tokenizer's special
    tokens (``[CLS] a [SEP]``, ``[CLS] b [SEP]``), as BERT's tokenizer encodes a pair:
    ``[CLS] a [SEP] b [SEP]``; and where the second text begins (token type 1 from there on)."""
    return [*first, *second[1:]], len(first)
