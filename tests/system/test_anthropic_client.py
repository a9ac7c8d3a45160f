"""The official anthropic client against the live embedded service, with only base_url and
api_key set: a Message Batch created, polled to its end and its results streamed, on the real
engine and the tiny model (the API-level cases: tests/api/test_message_batches.py)."""

from __future__ import annotations

import anthropic

from tests.conftest_services import wait_for


def test_anthropic_client_embedded(embedded):
    client = anthropic.Anthropic(base_url=embedded.base_url, api_key=embedded.api_key,
                                 max_retries=0)
    requests = [{"custom_id": f"q-{i}", "params": {
        "max_tokens": 5, "system": "Shared instructions: be brief.",
        "messages": [{"role": "user", "content": f"Question {i}?"}]}} for i in range(4)]
    requests.append({"custom_id": "bad", "params": {"messages": [
        {"role": "user", "content": "no max_tokens"}]}})
    batch = client.messages.batches.create(requests=requests)
    done = wait_for(lambda: (b := client.messages.batches.retrieve(batch.id)
                             ).processing_status == "ended" and b, 120, 0.2, batch.id)
    assert (done.request_counts.succeeded, done.request_counts.errored) == (4, 1)
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert sorted(results) == sorted(r["custom_id"] for r in requests)
    for i in range(4):
        message = results[f"q-{i}"].message
        assert message.type == "message" and 1 <= message.usage.output_tokens <= 5
    # The shared system prompt's blocks are read from the prefix cache by the later requests.
    assert sum(results[f"q-{i}"].message.usage.cache_read_input_tokens for i in range(4)) > 0
    assert "params.max_tokens" in results["bad"].error.error.message
    assert client.messages.batches.list().data[0].id == batch.id
