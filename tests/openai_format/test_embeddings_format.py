"""/v1/embeddings lines: the request body (OpenAI's input shapes and limits), the line errors
naming the field, and the response body checked strictly against the ``openai`` package's
``CreateEmbeddingResponse`` (no field more or less; base64 decoded as the SDK decodes it)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse, Embedding
from openai.types.create_embedding_response import Usage

from openai_format.embeddings import MAX_EMBEDDING_INPUTS, EmbeddingRequest, embedding_body
from openai_format.engine_fields import engine_fields
from openai_format.parse import BatchLine, LineError, parse_line
from openai_format.types import EMBEDDINGS_URL


def line(body: dict, url: str = EMBEDDINGS_URL) -> BatchLine | LineError:
    raw = json.dumps({"custom_id": "c1", "method": "POST", "url": url, "body": body})
    return parse_line(raw, line_no=3)


@pytest.mark.parametrize("value, inputs", [
    ("one text", ["one text"]),
    (["a", "b", "c"], ["a", "b", "c"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    (["x"] * MAX_EMBEDDING_INPUTS, ["x"] * MAX_EMBEDDING_INPUTS),
])
def test_input_shapes(value, inputs):
    parsed = line({"model": "m", "input": value, "user": "u-1", "encoding_format": "base64"})
    assert isinstance(parsed, BatchLine) and isinstance(parsed.body, EmbeddingRequest)
    assert parsed.body.inputs() == inputs
    assert engine_fields(parsed.body) == {"embedding": {
        "input": inputs, "encoding_format": "base64", "dimensions": None}}


@pytest.mark.parametrize("body, code, message", [
    ({}, "invalid_request", "body.input is required"),
    ({"input": []}, "invalid_value", "body.input must not be empty"),
    ({"input": ""}, "invalid_value", "body.input must not be an empty string"),
    ({"input": ["ok", ""]}, "invalid_value", "body.input[1] must not be an empty string"),
    ({"input": [[1], []]}, "invalid_value", "body.input[1] must not be an empty list"),
    ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "invalid_value",
     "body.input must hold at most 2048 inputs, got 2049"),
    ({"input": [1, "a"]}, "invalid_request", "body.input must be a string, a list of strings"),
    ({"input": [-3]}, "invalid_value", "body.input[0] holds a negative token id -3"),
    ({"input": "x", "encoding_format": "hex"}, "invalid_value",
     "body.encoding_format must be 'float' or 'base64', got 'hex'"),
    ({"input": "x", "dimensions": 0}, "invalid_value", "body.dimensions must be an integer >= 1"),
    ({"input": "x", "temperature": 1}, "invalid_value",
     "body.temperature is not a supported parameter"),
])
def test_bad_bodies_name_the_field(body, code, message):
    parsed = line(body)
    assert isinstance(parsed, LineError)
    assert parsed.code == code and message in parsed.message, parsed
    assert parsed.message.startswith("line 3: ")


def test_a_chat_body_is_not_an_embeddings_body():
    parsed = line({"messages": [{"role": "user", "content": "hi"}]})
    assert isinstance(parsed, LineError)
    assert "body.messages is not a supported parameter" in parsed.message


def strict(body: dict) -> CreateEmbeddingResponse:
    """The body as the SDK reads it, and exactly its fields (the SDK ignores extras)."""
    assert set(body) == set(CreateEmbeddingResponse.model_fields)
    assert set(body["usage"]) == set(Usage.model_fields)
    for item in body["data"]:
        assert set(item) == set(Embedding.model_fields)
    return CreateEmbeddingResponse.model_validate(body, strict=True)


def test_float_response_is_create_embedding_response():
    vectors = [np.array([0.25, -1.0, 3.5], dtype=np.float32), [1.0, 2.0, 3.0]]
    body = embedding_body(vectors, model="all-MiniLM-L6-v2", prompt_tokens=12)
    response = strict(json.loads(json.dumps(body)))
    assert response.object == "list" and response.model == "all-MiniLM-L6-v2"
    assert [d.index for d in response.data] == [0, 1]
    assert all(d.object == "embedding" for d in response.data)
    assert response.data[0].embedding == [0.25, -1.0, 3.5]
    assert response.usage.prompt_tokens == response.usage.total_tokens == 12


def test_base64_is_little_endian_float32_as_the_sdk_decodes_it():
    vector = np.array([0.1, -2.5, 1e-7, 3.0], dtype=np.float32)
    body = embedding_body([vector], model="m", prompt_tokens=4, encoding_format="base64")
    encoded = body["data"][0]["embedding"]
    assert isinstance(encoded, str)
    # The openai SDK: np.frombuffer(base64.b64decode(data), dtype="float32").tolist()
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert decoded.tolist() == vector.tolist()
    body["data"][0]["embedding"] = decoded.tolist()
    strict(body)
