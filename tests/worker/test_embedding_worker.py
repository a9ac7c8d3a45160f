"""A worker on an embedding engine (the one fake with ``is_embedding`` set, behind the worker's
``MeteredEngine``): it announces its model as an embedding model, so chat work for it is refused
at create; an embeddings batch completes with one CreateEmbeddingResponse a line (float,
base64, Matryoshka ``dimensions``), and an input the engine cannot take fails its line alone."""

from __future__ import annotations

import base64
import struct

from engine.testing.fake_engine import EMBEDDING_SIZE, FakeEngine
from tests.conftest_services import chat_line, wait_for

EMB = "/v1/embeddings"


def _line(custom_id: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": EMB, "body": body}


def test_an_embedding_worker_serves_embeddings_lines(make_stack, sqlite_url):
    stack = make_stack(sqlite_url)
    worker = stack.add_worker(FakeEngine(is_embedding=True, max_model_len=64))
    assert worker.engine.is_embedding  # the MeteredEngine says what the engine says
    models = wait_for(lambda: (m := stack.client.get("/v1/models").json()["data"])
                      and m[0].get("kind") == "embedding" and m, 10, 0.05, "the announce")
    assert models[0]["kind"] == "embedding"
    refused = stack.client.post("/v1/batches", json={
        "endpoint": "/v1/chat/completions", "completion_window": "24h",
        "requests": [chat_line("c", "hi")]})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "wrong_model_kind"

    batch = stack.create_batch([
        _line("one", {"input": "hello"}),
        _line("two", {"input": [[5, 6], [7, 8, 9]], "dimensions": 4}),
        _line("b64", {"input": "hello", "encoding_format": "base64"}),
        _line("long", {"input": "x" * 65}),
    ], endpoint=EMB)
    done = stack.wait_status(batch["id"], "completed")
    assert done["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    output = {line["custom_id"]: line["response"]["body"]
              for line in stack.lines_of(done["output_file_id"])}
    one = output["one"]["data"][0]["embedding"]
    assert len(one) == EMBEDDING_SIZE and abs(sum(x * x for x in one) - 1) < 1e-5
    assert output["one"]["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    assert [len(d["embedding"]) for d in output["two"]["data"]] == [4, 4]
    assert output["two"]["usage"]["prompt_tokens"] == 5
    raw = base64.b64decode(output["b64"]["data"][0]["embedding"])
    floats = struct.unpack(f"<{EMBEDDING_SIZE}f", raw)
    assert max(abs(a - b) for a, b in zip(floats, one, strict=True)) < 1e-6
    (error,) = stack.lines_of(done["error_file_id"])
    assert error["custom_id"] == "long" and error["response"]["status_code"] == 400
    body = error["response"]["body"]["error"]
    assert body["code"] == "context_length_exceeded" and body["param"] == "input"
    assert body["message"] == ("body.input[0]: input is 65 tokens; this model's maximum input "
                               "length is 64 tokens")
