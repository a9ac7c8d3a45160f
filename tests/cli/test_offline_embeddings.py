"""``boxcar run`` with /v1/embeddings lines on a tiny random BERT: the same pipeline as the
worker, one output line per good line (OpenAI's CreateEmbeddingResponse, float and base64), an
error line per bad one with its field named, and a chat line refused by the embedding model."""

from __future__ import annotations

import base64
import json

import numpy as np
from openai.types import CreateEmbeddingResponse

from cli.offline import run_batch_file
from engine import EngineConfig, LLMEngine
from tests.engine.test_embeddings import MEAN_NORMALIZE, make_bert


def _line(custom_id: str, body: dict, url: str = "/v1/embeddings") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_boxcar_run_embeds(tmp_path):
    path = make_bert(tmp_path / "bert", st_files=MEAN_NORMALIZE)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    lines = [_line("a", {"input": ["hello", "world"]}),
             _line("b", {"input": [[5, 6, 7]], "encoding_format": "base64", "dimensions": 16}),
             _line("c", {"input": "x", "dimensions": 20}),
             _line("d", {"input": [list(range(3, 150))]}),
             _line("e", {"input": [[1, 10**6]]})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    summary = run_batch_file(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl",
                             errors_path=tmp_path / "err.jsonl", progress=False)
    assert (summary.num_ok, summary.num_failed) == (2, 3)
    out = {json.loads(x)["custom_id"]: json.loads(x)["response"]["body"]
           for x in (tmp_path / "out.jsonl").read_text().splitlines()}
    CreateEmbeddingResponse.model_validate(out["a"], strict=True)
    assert [len(d["embedding"]) for d in out["a"]["data"]] == [64, 64]
    vector = np.frombuffer(base64.b64decode(out["b"]["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (16,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-5
    assert out["b"]["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    errors = {json.loads(x)["custom_id"]: json.loads(x)["response"]["body"]["error"]
              for x in (tmp_path / "err.jsonl").read_text().splitlines()}
    assert errors["c"]["param"] == "dimensions" and "one of [16, 32]" in errors["c"]["message"]
    assert errors["d"]["code"] == "context_length_exceeded"
    assert "maximum input length is 100 tokens" in errors["d"]["message"]
    assert "outside the model's vocabulary" in errors["e"]["message"]

    chat = tmp_path / "chat.jsonl"
    chat.write_text(_line("g", {"messages": [{"role": "user", "content": "hi"}]},
                          url="/v1/chat/completions") + "\n")
    summary = run_batch_file(engine, chat, tmp_path / "chat-out.jsonl", progress=False)
    assert summary.num_failed == 1
    error = json.loads((tmp_path / "chat-out.jsonl").read_text())["response"]["body"]["error"]
    assert error["code"] == "wrong_model_kind" and "embedding model" in error["message"]
