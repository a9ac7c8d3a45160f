"""The official openai client against a live server, with only base_url and api_key set:
files.create, batches.create / retrieve / list / cancel, files.content. The same flow runs on
the embedded mode (SQLite, local folder) and on production (PostgreSQL, Redis + Celery,
SeaweedFS), with the real engine on a tiny model."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.conftest_services import chat_line, jsonl, wait_for
from tests.openai_shapes import check_line, error_of

TERMINAL = ("completed", "failed", "expired", "cancelled")


def wait_batch(client: openai.OpenAI, batch_id: str, timeout: float = 120):
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in TERMINAL and b,
                    timeout, 0.2, f"batch {batch_id}")


def run_openai_flow(base_url: str, api_key: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)
    good = [chat_line(f"chat-{i}", f"Shared instructions: be brief. Question {i}?",
                      max_tokens=6, temperature=0) for i in range(10)]
    good += [chat_line(f"text-{i}", f"Once upon a time {i}", max_tokens=5, ignore_eos=True)
             for i in range(3)]
    bad = ['{"custom_id": "no-json",', chat_line("chat-0", "duplicate"),
           chat_line("hot", "x", temperature=9)]
    data = jsonl(good[:4] + bad[:1] + good[4:9] + bad[1:] + good[9:])
    file = client.files.create(file=("requests.jsonl", data), purpose="batch")
    assert file.purpose == "batch" and file.bytes == len(data)
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"suite": "system"})
    assert batch.status in ("validating", "in_progress")
    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 16
    assert (done.request_counts.completed, done.request_counts.failed) == (13, 3)
    assert done.metadata == {"suite": "system"}
    assert done.usage.output_tokens == 10 * 6 + 3 * 5
    assert done.usage.input_tokens_details.cached_tokens > 0  # the shared instructions

    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    ids = [line["custom_id"] for line in output]
    assert sorted(ids) == sorted(line["custom_id"] for line in good)  # each exactly once
    by_id = {line["custom_id"]: line for line in output}
    chat = by_id["chat-3"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 6
    for line in output:
        check_line(line, "/v1/chat/completions")
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert [(e["custom_id"], error_of(e)["code"]) for e in errors] == [
        ("chat-0", "duplicate_custom_id"), ("hot", "invalid_value")]
    # The line without a custom_id is named by its line number in the batch's errors.
    assert [(e.line, e.code) for e in done.errors.data][:1] == [(5, "invalid_json")]

    listed = [b.id for b in client.batches.list(limit=10)]
    assert batch.id in listed

    # Cancel: a long batch stops within seconds and keeps what finished.
    long = [chat_line(f"long-{i}", f"Tell me about {i}", max_tokens=200, ignore_eos=True)
            for i in range(48)]
    long_file = client.files.create(file=("long.jsonl", jsonl(long)), purpose="batch")
    running = client.batches.create(input_file_id=long_file.id,
                                    endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(running.id).status == "in_progress", 60, 0.1,
             "the long batch to start")
    cancelling = client.batches.cancel(running.id)
    assert cancelling.status in ("cancelling", "cancelled")
    started = time.monotonic()
    cancelled = wait_batch(client, running.id, timeout=30)
    assert cancelled.status == "cancelled" and time.monotonic() - started < 15
    seen = []
    for file_id in (cancelled.output_file_id, cancelled.error_file_id):
        if file_id:
            seen += [json.loads(x)["custom_id"]
                     for x in client.files.content(file_id).text.splitlines()]
    assert sorted(seen) == sorted(line["custom_id"] for line in long)

    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_does_not_exist")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings",
                              completion_window="24h")


def test_openai_client_embedded(embedded):
    run_openai_flow(embedded.base_url, embedded.api_key)


def test_openai_client_production(production):
    production.start_worker("w1")
    run_openai_flow(production.base_url, production.api_key)


def test_openai_client_responses_and_expiry_embedded(embedded):
    """/v1/responses lines, expires_after and output_expires_after through the official
    client's own parameters."""
    client = openai.OpenAI(base_url=f"{embedded.base_url}/v1", api_key=embedded.api_key,
                           max_retries=0)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
              "body": {"input": f"Question {i}?", "instructions": "Be brief.",
                       "max_output_tokens": 4, "temperature": 0}} for i in range(3)]
    lines.append({"custom_id": "streamed", "method": "POST", "url": "/v1/responses",
                  "body": {"input": "x", "stream": True}})
    file = client.files.create(file=("responses.jsonl", jsonl(lines)), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert file.expires_at == file.created_at + 3600
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/responses", completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200})
    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    output_file = client.files.retrieve(done.output_file_id)
    assert output_file.expires_at == output_file.created_at + 7200
    for raw in client.files.content(done.output_file_id).text.splitlines():
        line = json.loads(raw)
        check_line(line, "/v1/responses")
        response = openai.types.responses.Response.model_validate(line["response"]["body"])
        assert response.id.startswith("resp_") and response.instructions == "Be brief."
        assert 1 <= response.usage.output_tokens <= 4 and response.output[0].type == "message"
    (error,) = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert error["custom_id"] == "streamed" and "body.stream" in error_of(error)["message"]
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("r.jsonl", jsonl(lines)), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 60})
