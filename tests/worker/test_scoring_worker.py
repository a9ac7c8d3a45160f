"""A worker on a cross-encoder (the fake with ``cross_encoder`` set): it announces its model as a
``cross_encoder``, so chat and embeddings work for it is refused at create; a rerank batch and a
score batch (and a batch mixing both, where mixed endpoints are on) complete with one response a
line, and a pair the model cannot take fails its line alone with its field named."""

from __future__ import annotations

from engine.testing.fake_engine import FakeEngine
from tests.api.test_embeddings_api import embedding_line
from tests.conftest_services import chat_line, wait_for


def _line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_a_cross_encoder_worker_serves_rerank_and_score_lines(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, mixed_endpoints=True)
    stack.add_worker(FakeEngine(cross_encoder=True, max_model_len=16))
    wait_for(lambda: (m := stack.client.get("/v1/models").json()["data"])
             and m[0].get("kind") == "cross_encoder", 10, 0.05, "the announce")
    for endpoint, line in (("/v1/chat/completions", chat_line("c", "hi")),
                           ("/v1/embeddings", embedding_line("e", "hi"))):
        refused = stack.client.post("/v1/batches", json={
            "endpoint": endpoint, "completion_window": "24h", "requests": [line]})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("wrong_model_kind", "model")
        assert "is a cross-encoder: it serves /v1/rerank, /v1/score only" in error["message"]

    rerank = stack.create_batch([
        _line("r1", "/v1/rerank", {"query": "abc", "documents": ["abd", "xyz", "cab"],
                                   "top_n": 2}),
        _line("r2", "/v1/rerank", {"query": "ab", "documents": ["b"],
                                   "return_documents": False}),
        _line("long", "/v1/rerank", {"query": "abcdefgh", "documents": ["a", "x" * 10]}),
        _line("s1", "/v1/score", {"text_1": "ab", "text_2": ["ba", "zz"]}),
    ], endpoint="/v1/rerank")
    done = stack.wait_status(rerank["id"], "completed")
    assert done["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    output = {line["custom_id"]: line["response"]["body"]
              for line in stack.lines_of(done["output_file_id"])}
    assert output["r1"]["results"] == [
        {"index": 2, "relevance_score": 1.0, "document": {"text": "cab"}},
        {"index": 0, "relevance_score": 0.5, "document": {"text": "abd"}}]
    assert output["r1"]["usage"] == {"prompt_tokens": 15, "total_tokens": 15}
    assert output["r2"]["results"] == [{"index": 0, "relevance_score": 0.0}]
    assert [d["score"] for d in output["s1"]["data"]] == [1.0, 0.0]
    (error,) = stack.lines_of(done["error_file_id"])
    assert error["custom_id"] == "long" and error["response"]["status_code"] == 400
    body = error["response"]["body"]["error"]
    assert (body["code"], body["param"]) == ("context_length_exceeded", "documents")
    assert body["message"] == ("body.documents[1] (paired with body.query): input is 17 tokens; "
                               "this model's maximum input length is 16 tokens")
    # r1 15, r2 2 ("ab" and "b" less its first token), s1 3 + 3; nothing generated.
    assert (done["usage"]["input_tokens"], done["usage"]["output_tokens"]) == (23, 0)

    score = stack.create_batch([_line("s", "/v1/score", {"text_1": ["ab", "xy"],
                                                        "text_2": ["ba", "zz"]})],
                               endpoint="/v1/score")
    done = stack.wait_status(score["id"], "completed")
    (line,) = stack.lines_of(done["output_file_id"])
    assert [d["score"] for d in line["response"]["body"]["data"]] == [1.0, 0.0]

