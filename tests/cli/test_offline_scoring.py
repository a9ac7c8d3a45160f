"""``boxcar run`` with /v1/rerank and /v1/score lines on a tiny random BERT cross-encoder: the
same pipeline as the worker, scores equal to sentence-transformers' ``CrossEncoder``, an error
line naming the field for a pair past the model's length, and an embeddings line refused by
the cross-encoder."""

from __future__ import annotations

import json

import pytest

from cli.offline import run_batch_file
from engine import EngineConfig, LLMEngine
from tests.engine.test_cross_encoder import make_cross_encoder

QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the river bank", "money in the bank"]


def run(engine, tmp_path, name: str, lines: list[tuple[str, str, dict]]):
    """(summary, output bodies, error bodies) of one ``boxcar run`` over ``lines``."""
    source = tmp_path / f"{name}.jsonl"
    source.write_text("".join(json.dumps({"custom_id": c, "method": "POST", "url": url,
                                          "body": body}) + "\n" for c, url, body in lines))
    out, err = tmp_path / f"{name}-out.jsonl", tmp_path / f"{name}-err.jsonl"
    summary = run_batch_file(engine, source, out, errors_path=err, progress=False)

    def bodies(path):
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return {r["custom_id"]: r["response"]["body"] for r in rows}

    return summary, bodies(out), {c: b["error"] for c, b in bodies(err).items()}


def test_boxcar_run_reranks_and_scores(tmp_path):
    from sentence_transformers import CrossEncoder

    path = make_cross_encoder(tmp_path / "ce")
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    reference = CrossEncoder(str(path), device="cpu")

    summary, out, errors = run(engine, tmp_path, "rerank", [
        ("r", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}),
        ("long", "/v1/rerank", {"query": "a", "documents": ["the " * 200]})])
    assert (summary.num_ok, summary.num_failed) == (1, 1)
    expected = reference.predict([(QUERY, d) for d in DOCUMENTS])
    results = out["r"]["results"]
    assert [r["index"] for r in results] == list(expected.argsort()[::-1][:2])
    for r in results:
        assert r["relevance_score"] == pytest.approx(float(expected[r["index"]]), abs=1e-5)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    assert out["r"]["usage"]["prompt_tokens"] == summary.num_prompt_tokens
    assert errors["long"]["code"] == "context_length_exceeded"
    assert errors["long"]["param"] == "documents"
    assert errors["long"]["message"].startswith("body.documents[0] (paired with body.query): "
                                                "input is 204 tokens")

    summary, out, _ = run(engine, tmp_path, "score", [
        ("s", "/v1/score", {"text_1": "bank", "text_2": DOCUMENTS})])
    expected = reference.predict([("bank", d) for d in DOCUMENTS])
    assert [d["score"] for d in out["s"]["data"]] == pytest.approx(expected.tolist(), abs=1e-5)

    summary, _, errors = run(engine, tmp_path, "emb", [("e", "/v1/embeddings", {"input": "x"})])
    assert summary.num_failed == 1 and errors["e"]["code"] == "wrong_model_kind"
    assert "is a cross-encoder" in errors["e"]["message"]
