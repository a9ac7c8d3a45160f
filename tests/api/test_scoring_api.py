"""/v1/rerank and /v1/score at the API: a batch for a generation model refused at create (an
embedding model serves them, by cosine), and jobs that infer the endpoint from the body."""

from __future__ import annotations

from tests.api.test_embeddings_api import announce


def _line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_rerank_refused_at_create_for_a_generation_model(client, ctx):
    announce(ctx, "tiny-chat", "generation")
    announce(ctx, "all-MiniLM-L6-v2", "embedding")
    line = _line("r", "/v1/rerank", {"model": "tiny-chat", "query": "q", "documents": ["d"]})
    refused = client.post("/v1/batches", json={"endpoint": "/v1/rerank",
                                               "completion_window": "24h", "requests": [line]})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("wrong_model_kind", "model")
    assert error["message"] == ("The model 'tiny-chat' generates text: it does not serve "
                                "/v1/rerank; name a cross-encoder or an embedding model.")
    line["body"]["model"] = "all-MiniLM-L6-v2"
    ok = client.post("/v1/batches", json={"endpoint": "/v1/rerank", "completion_window": "24h",
                                          "requests": [line]})
    assert ok.status_code == 200, ok.text
    job = client.post("/v1/jobs", json={"body": {"model": "all-MiniLM-L6-v2", "text_1": "a",
                                                 "text_2": ["b", "c"]}})
    assert job.status_code == 200, job.text
    assert job.json()["endpoint"] == "/v1/score"
    job = client.post("/v1/jobs", json={"body": {"model": "tiny-chat", "query": "a",
                                                 "documents": ["b"]}})
    assert job.status_code == 400 and job.json()["error"]["code"] == "wrong_model_kind"
