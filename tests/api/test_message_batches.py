"""Anthropic's Message Batches API through the official ``anthropic`` client (only base_url
changed; its types validate every response): create, poll, results, cancel, list, delete, and
bad input with Anthropic's error shape naming the field. The batch runs on the tiny model."""

from __future__ import annotations

import json

import anthropic
import pytest
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse
from fastapi.testclient import TestClient

from service.served_models import default_model
from service.settings import Settings
from tests.api.conftest import api_settings
from tests.api.test_bad_input_corpus import tiny_worker  # noqa: F401 - a fixture
from tests.conftest_services import wait_for
from worker.finalize import finalize_batch
from worker.prepare import prepare_batch

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 8},
                                           "unit": {"enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture
def settings(any_db_url, tmp_path) -> Settings:
    """The API tests' settings, on SQLite and on PostgreSQL."""
    return api_settings(any_db_url, tmp_path)


@pytest.fixture
def client(app, key):
    """The anthropic client on the app (its HTTP client the app's test client, which sends no
    key of its own: the anthropic client's x-api-key is the one)."""
    with TestClient(app) as http:
        yield anthropic.Anthropic(base_url="http://testserver", api_key=key, http_client=http,
                                  max_retries=0)


def params(text: str = "Hello", **extra) -> dict:
    return {"max_tokens": 4, "messages": [{"role": "user", "content": text}], **extra}


def wait_ended(client: anthropic.Anthropic, batch_id: str) -> MessageBatch:
    return wait_for(lambda: (b := client.messages.batches.retrieve(batch_id)
                             ).processing_status == "ended" and b, 120, 0.1, batch_id)


def test_a_batch_runs_and_streams_its_results(client, settings, tiny_worker):  # noqa: F811
    model = default_model(settings)
    batch = client.messages.batches.create(requests=[
        {"custom_id": "plain", "params": params(
            model=model, temperature=0.5, top_k=5, stop_sequences=["\n\n"],
            metadata={"user_id": "u"})},
        {"custom_id": "system", "params": params(
            "Weather?", model=model, system=[{"type": "text", "text": "Be brief."}])},
        {"custom_id": "tool", "params": {
            "model": model, "max_tokens": 200, "tools": [WEATHER], "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Paris?"}]}]}},
        {"custom_id": "tool-turn", "params": {
            "model": model, "max_tokens": 3, "tools": [WEATHER], "messages": [
                {"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                   "name": "get_weather",
                                                   "input": {"city": "Paris", "unit": "c"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": "21 C"}]}],
            "tool_choice": {"type": "none"}}},
        {"custom_id": "no-max-tokens", "params": {"model": model, "messages": [
            {"role": "user", "content": "x"}]}},
        {"custom_id": "image", "params": params(model=model, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])},
    ])
    assert batch.type == "message_batch" and batch.processing_status == "in_progress"
    assert batch.results_url is None and batch.request_counts.processing == 6
    assert (batch.expires_at - batch.created_at).total_seconds() == 24 * 3600
    done = wait_ended(client, batch.id)
    assert done.ended_at is not None and done.cancel_initiated_at is None
    counts = done.request_counts
    assert (counts.succeeded, counts.errored, counts.processing) == (4, 2, 0)
    assert done.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")

    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert all(isinstance(r, MessageBatchIndividualResponse)
               for r in client.messages.batches.results(batch.id))
    assert set(results) == {"plain", "system", "tool", "tool-turn", "no-max-tokens", "image"}
    plain = results["plain"]
    assert plain.type == "succeeded"
    message = plain.message
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == model
    assert message.content[0].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert 1 <= message.usage.output_tokens <= 4 and message.usage.input_tokens > 0
    assert message.usage.cache_creation_input_tokens == 0
    assert message.usage.cache_read_input_tokens is not None
    tool = results["tool"].message
    assert tool.stop_reason == "tool_use"
    (call,) = [block for block in tool.content if block.type == "tool_use"]
    assert call.name == "get_weather" and set(call.input) == {"city", "unit"}
    assert results["tool-turn"].type == "succeeded"
    missing = results["no-max-tokens"]
    assert missing.type == "errored" and missing.error.error.type == "invalid_request_error"
    assert "params.max_tokens is required" in missing.error.error.message
    image = results["image"]
    assert image.type == "errored"
    assert "params.messages[0].content[0].type 'image'" in image.error.error.message


def test_cancel_list_and_delete(client, ctx):
    created = [client.messages.batches.create(requests=[
        {"custom_id": f"r{i}", "params": params()}]) for i in range(5)]
    ids = [b.id for b in created]

    page = client.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    assert [b.id for b in client.messages.batches.list(limit=2)] == ids[::-1]  # auto-paging
    newer = client.messages.batches.list(before_id=ids[1], limit=10)
    assert [b.id for b in newer.data] == ids[:1:-1] and not newer.has_more
    older = client.messages.batches.list(after_id=ids[2], limit=10)
    assert [b.id for b in older.data] == ids[1::-1]

    cancelling = client.messages.batches.cancel(ids[0])
    assert cancelling.processing_status == "canceling" and cancelling.cancel_initiated_at
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.batches.delete(ids[0])
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "cancel it" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.AnthropicError, match="results_url"):
        client.messages.batches.results(ids[0])  # no results_url before it ends

    assert finalize_batch(ctx.db, ctx.storage, ids[0], worker_id="test") == "cancelled"
    ended = client.messages.batches.retrieve(ids[0])
    assert ended.processing_status == "ended" and ended.request_counts.canceled == 1
    (line,) = client.messages.batches.results(ids[0])
    assert line.custom_id == "r0" and line.result.type == "canceled"

    deleted = client.messages.batches.delete(ids[0])
    assert (deleted.id, deleted.type) == (ids[0], "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError) as gone:
        client.messages.batches.retrieve(ids[0])
    assert gone.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": f"No such message batch: '{ids[0]}'"}}
    assert ids[0] not in [b.id for b in client.messages.batches.list(limit=100)]


@pytest.mark.parametrize(("requests", "field"), [
    ([{"custom_id": "a", "params": params()}, {"custom_id": "a", "params": params()}],
     "requests.1.custom_id"),
    ([{"custom_id": "has space", "params": params()}], "requests.0.custom_id"),
    ([{"custom_id": "x" * 65, "params": params()}], "requests.0.custom_id"),
    ([{"custom_id": "a"}], "requests.0.params"),
    ([], "requests"),
])
def test_a_bad_create_is_refused_naming_the_field(client, requests, field):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.batches.create(requests=requests)
    body = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(f"{field}:"), body


def test_the_same_keys_and_anthropics_auth(app, key):
    with TestClient(app) as http:
        wrong = anthropic.Anthropic(base_url="http://testserver", api_key="nope",
                                    http_client=http, max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as refused:
            wrong.messages.batches.list()
        assert refused.value.body["error"]["type"] == "authentication_error"
        # The OpenAI routes take x-api-key too; an OpenAI batch is no Message Batch.
        headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
        made = http.post("/v1/batches", headers=headers, json={
            "endpoint": "/v1/chat/completions", "requests": [
                {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}]}}]})
        assert made.status_code == 200, made.text
        missing = http.get(f"/v1/messages/batches/{made.json()['id']}", headers=headers)
        assert missing.status_code == 404 and missing.json()["type"] == "error"


def test_a_messages_job_and_an_openai_batch_of_messages_lines(app, key, settings,
                                                              tiny_worker):  # noqa: F811
    """A /v1/messages body also runs as a job and as a line of an OpenAI batch: the same
    pipeline answers with the same Message."""
    with TestClient(app, headers={"Authorization": f"Bearer {key}"}) as http:
        job = http.post("/v1/jobs", json={"endpoint": "/v1/messages", "body": params()}).json()
        done = wait_for(lambda: (j := http.get(f"/v1/jobs/{job['id']}").json())["status"]
                        in ("completed", "failed") and j, 60, 0.1, "the job")
        assert done["status"] == "completed", done
        assert anthropic.types.Message.model_validate(done["result"]).usage.output_tokens <= 4
        batch = http.post("/v1/batches", json={"endpoint": "/v1/messages", "requests": [
            {"custom_id": "m", "url": "/v1/messages", "body": params()}]}).json()
        ended = wait_for(lambda: (b := http.get(f"/v1/batches/{batch['id']}").json())["status"]
                         == "completed" and b, 60, 0.1, "the batch")
        (line,) = http.get(f"/v1/files/{ended['output_file_id']}/content").text.splitlines()
        body = json.loads(line)["response"]["body"]
        message = anthropic.types.Message.model_validate(body)
        assert message.type == "message"


def test_a_batch_of_only_bad_requests_ends_with_each_errored(client, ctx):
    batch = client.messages.batches.create(requests=[
        {"custom_id": "no-max", "params": {"messages": [{"role": "user", "content": "x"}]}},
        {"custom_id": "hot", "params": params(temperature=3)}])
    prepare_batch(ctx.db, ctx.storage, batch.id, worker_id="test", shard_size=4)
    ended = client.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended" and ended.request_counts.errored == 2
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert "params.max_tokens is required" in results["no-max"].error.error.message
    assert "params.temperature must be between 0 and 1" in results["hot"].error.error.message


def test_a_create_past_the_byte_limit_is_413(client, monkeypatch):
    monkeypatch.setattr("api.routes.message_batches.MAX_MESSAGE_BATCH_BYTES", 1000)
    with pytest.raises(anthropic.APIStatusError) as refused:
        client.messages.batches.create(requests=[
            {"custom_id": f"r{i}", "params": params("x" * 100)} for i in range(20)])
    assert refused.value.status_code == 413
    assert refused.value.body["error"]["type"] == "request_too_large"
