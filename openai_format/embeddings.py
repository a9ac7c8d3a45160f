"""OpenAI's /v1/embeddings in a batch line: the request body (``EmbeddingRequest``) and the
response object (``embedding_body``: ``CreateEmbeddingResponse``, as the ``openai`` package types
it).

OpenAI's rules: ``input`` is a string, a list of strings, a list of token ids or a list of
token-id lists; at most ``MAX_EMBEDDING_INPUTS`` inputs a request, none empty; ``encoding_format``
is ``float`` (the default) or ``base64`` (the little-endian float32 bytes, base64-encoded);
``dimensions`` only for models that support it (checked when the line meets the model).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

from pydantic import model_validator

from openai_format.types import PositiveInt, _Body, _invalid, _one_of_shapes

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit per request
# OpenAI's limit on a batch's embedding inputs, all lines together (the service's default for
# BOXCAR_MAX_BATCH_EMBEDDING_INPUTS).
MAX_BATCH_EMBEDDING_INPUTS = 50_000

EmbeddingInput = Annotated[
    str | list[str] | list[int] | list[list[int]],
    _one_of_shapes("a string, a list of strings, a list of token ids or a list of token-id "
                   "lists"),
]


class EmbeddingRequest(_Body):
    model: str | None = None  # the batch's model; the worker serves the one it has loaded
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: PositiveInt | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> EmbeddingRequest:
        inputs = self.inputs()
        if not inputs:
            raise _invalid("body.input must not be empty")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise _invalid(f"body.input must hold at most {MAX_EMBEDDING_INPUTS} inputs, got "
                           f"{len(inputs)}")
        for index, item in enumerate(inputs):
            if not item:
                what = "an empty string" if isinstance(item, str) else "an empty list"
                raise _invalid(f"body.input[{index}] must not be {what}"
                               if len(inputs) > 1 or not isinstance(self.input, str)
                               else f"body.input must not be {what}")
            if isinstance(item, list) and min(item) < 0:
                raise _invalid(f"body.input[{index}] holds a negative token id {min(item)}")
        return self

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: one string, or one token-id list, is one input."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]

    @property
    def num_inputs(self) -> int:
        return len(self.inputs())


def encode_embedding(vector: Any, encoding_format: str) -> list[float] | str:
    """A vector (anything numpy reads) as OpenAI writes it: floats, or base64 of float32 LE."""
    import numpy as np  # only where responses are built (the worker, boxcar run)

    array = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(array.tobytes()).decode("ascii")
    return array.tolist()


def embedding_body(vectors: list[Any], *, model: str, prompt_tokens: int,
                   encoding_format: str = "float") -> dict[str, Any]:
    """OpenAI's ``CreateEmbeddingResponse``."""
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i,
                  "embedding": encode_embedding(v, encoding_format)}
                 for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
