"""/v1/embeddings at the API: file lines and inline batches accepted, a batch's 50,000-input
limit (configurable) as line errors while the rest stays, the model's kind in /v1/models, and
a chat batch or job for an embedding model (or the reverse) refused at create with the reason."""

from __future__ import annotations

import pytest

from service import served_models
from service.served_models import EMBEDDING, GENERATION
from tests.api.test_files import upload
from tests.conftest_services import chat_line, jsonl

EMBEDDINGS = "/v1/embeddings"
DEFAULT = "SmolLM2-135M-Instruct"  # the settings' configured model (no kind until announced)


def embedding_line(custom_id: str, value, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": EMBEDDINGS,
            "body": {"input": value, **body}}


def announce(ctx, model: str, kind: str | None) -> None:
    with ctx.db.session() as session:
        served_models.announce(session, model=model, aliases=[], kind=kind,
                               model_ttl=ctx.settings.model_ttl)


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"max_batch_embedding_inputs": 5})


def test_upload_counts_a_batch_s_embedding_inputs(client):
    lines = [embedding_line("a", ["x", "y"]), embedding_line("b", "one"),
             embedding_line("c", ["p", "q", "r"]), embedding_line("d", [[1, 2], [3]]),
             embedding_line("e", "")]
    file = upload(client, jsonl(lines)).json()
    assert (file["line_count"], file["error_count"]) == (5, 2)
    errors = {e["custom_id"]: e for e in file["line_errors"]}
    # a (2) and b (1) fit; c (3) would make 6 > 5; d (2) makes 5: fits; e is an empty string.
    assert set(errors) == {"c", "e"}, errors
    assert errors["c"]["code"] == "too_many_inputs"
    assert "past 5 embedding inputs" in errors["c"]["message"]
    assert errors["e"]["code"] == "invalid_value"


def test_models_show_their_kind(client, ctx):
    announce(ctx, "all-MiniLM-L6-v2", EMBEDDING)
    announce(ctx, "tiny-chat", GENERATION)
    kinds = {m["id"]: m["kind"] for m in client.get("/v1/models").json()["data"]}
    assert kinds == {DEFAULT: None, "all-MiniLM-L6-v2": "embedding", "tiny-chat": "generation"}


def test_wrong_kind_refused_at_create(client, ctx):
    announce(ctx, "all-MiniLM-L6-v2", EMBEDDING)
    announce(ctx, "tiny-chat", GENERATION)
    chat_file = upload(client, jsonl([chat_line("a", "x", model="all-MiniLM-L6-v2")])).json()
    refused = client.post("/v1/batches", json={"input_file_id": chat_file["id"],
                                               "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "wrong_model_kind" and error["param"] == "model"
    assert "embedding model" in error["message"] and EMBEDDINGS in error["message"]

    inline = client.post("/v1/batches", json={
        "endpoint": EMBEDDINGS, "completion_window": "24h",
        "requests": [embedding_line("e1", "hello", model="tiny-chat")]})
    assert inline.status_code == 400 and inline.json()["error"]["code"] == "wrong_model_kind"
    assert "generates text" in inline.json()["error"]["message"]

    ok = client.post("/v1/batches", json={
        "endpoint": EMBEDDINGS, "completion_window": "24h",
        "requests": [embedding_line("e1", "hello", model="all-MiniLM-L6-v2"),
                     embedding_line("e2", [[5, 6]], model="all-MiniLM-L6-v2")]})
    assert ok.status_code == 200, ok.text
    assert ok.json()["endpoint"] == EMBEDDINGS and ok.json()["model"] == "all-MiniLM-L6-v2"


def test_jobs_infer_the_embeddings_endpoint(client, ctx):
    announce(ctx, "all-MiniLM-L6-v2", EMBEDDING)
    job = client.post("/v1/jobs", json={"body": {"model": "all-MiniLM-L6-v2",
                                                 "input": ["a", "b"]}})
    assert job.status_code == 200, job.text
    assert job.json()["endpoint"] == EMBEDDINGS
    chat = client.post("/v1/jobs", json={"body": {
        "model": "all-MiniLM-L6-v2", "messages": [{"role": "user", "content": "hi"}]}})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "wrong_model_kind"
    bad = client.post("/v1/jobs", json={"body": {"model": "all-MiniLM-L6-v2",
                                                 "input": ["a"] * 2049}})
    assert bad.status_code == 400 and "at most 2048 inputs" in bad.json()["error"]["message"]
