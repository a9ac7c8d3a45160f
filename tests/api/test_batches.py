"""/v1/batches and /v1/jobs at the API level (no worker): shapes, validation, cancel, scoping."""

from __future__ import annotations

from fastapi.testclient import TestClient
from openai.types import Batch

from tests.api.test_files import upload
from tests.conftest_services import chat_line, jsonl, make_key
from tests.openai_shapes import strict

BATCH_FIELDS = {
    "id", "object", "endpoint", "errors", "input_file_id", "completion_window", "status",
    "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at",
    "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at",
    "request_counts", "usage", "metadata", "model",
}


def make_batch(client, lines=None, **extra):
    file_id = upload(client, jsonl(lines or [chat_line("a", "x"), chat_line("b", "y")])).json()[
        "id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h", **extra}
    return client.post("/v1/batches", json=body)


def test_create_batch_has_openai_shape(client, ctx):
    response = make_batch(client, metadata={"project": "x"})
    assert response.status_code == 200, response.text
    batch = response.json()
    assert BATCH_FIELDS <= set(batch)
    assert batch["object"] == "batch" and batch["status"] == "validating"
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    assert batch["metadata"] == {"project": "x"}
    assert batch["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    assert ctx.queue.batches == [batch["id"]]
    assert client.get(f"/v1/batches/{batch['id']}").json()["id"] == batch["id"]
    strict(Batch, batch)


def test_batch_request_errors(client):
    file_id = upload(client, jsonl([chat_line("a", "x")])).json()["id"]

    def create(**body):
        return client.post("/v1/batches", json={"input_file_id": file_id,
                                                "endpoint": "/v1/chat/completions",
                                                "completion_window": "24h", **body})

    bad_endpoint = create(endpoint="/v1/moderations")
    assert bad_endpoint.status_code == 400
    assert bad_endpoint.json()["error"]["param"] == "endpoint"
    assert create(completion_window="2h").status_code == 400
    assert create(input_file_id="file-missing").status_code == 404
    assert create(metadata={str(i): "v" for i in range(17)}).status_code == 400
    assert create(webhook_url="http://127.0.0.1:9/hook").status_code == 400
    assert create(webhook_url="ftp://example.com/").status_code == 400
    all_bad = upload(client, jsonl(["{nope", '{"custom_id": "z"}'])).json()["id"]
    response = create(input_file_id=all_bad)
    assert response.status_code == 400 and "no valid request lines" in response.json()["error"][
        "message"]
    missing_field = client.post("/v1/batches", json={"input_file_id": file_id})
    assert missing_field.status_code == 400
    assert missing_field.json()["error"]["param"] == "endpoint"


def test_inline_requests_become_a_file(client):
    response = client.post("/v1/batches", json={
        "endpoint": "/v1/chat/completions", "completion_window": "24h",
        "requests": [{"custom_id": "q1", "body": chat_line("q1", "hi")["body"]},
                     {"custom_id": "q2", "body": chat_line("q2", "yo")["body"]}],
    })
    assert response.status_code == 200, response.text
    file_id = response.json()["input_file_id"]
    content = client.get(f"/v1/files/{file_id}/content").text.splitlines()
    assert len(content) == 2 and '"custom_id": "q1"' in content[0]
    both = client.post("/v1/batches", json={"endpoint": "/v1/chat/completions",
                                            "input_file_id": file_id, "requests": []})
    assert both.status_code == 400


def test_list_and_cancel(client, ctx):
    ids = [make_batch(client).json()["id"] for _ in range(3)]
    listing = client.get("/v1/batches", params={"limit": 2}).json()
    assert [b["id"] for b in listing["data"]] == ids[:0:-1] and listing["has_more"]
    rest = client.get("/v1/batches", params={"after": ids[1]}).json()
    assert [b["id"] for b in rest["data"]] == [ids[0]] and not rest["has_more"]
    cancelled = client.post(f"/v1/batches/{ids[0]}/cancel").json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"]
    again = client.post(f"/v1/batches/{ids[0]}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelling"
    assert ctx.queue.batches[-1] == ids[0]


def test_batches_are_tenant_scoped(client, app, ctx):
    batch_id = make_batch(client).json()["id"]
    other = TestClient(app, headers={"Authorization": f"Bearer {make_key(ctx.db, 'other')}"})
    assert other.get(f"/v1/batches/{batch_id}").status_code == 404
    assert other.post(f"/v1/batches/{batch_id}/cancel").status_code == 404
    assert other.get("/v1/batches").json()["data"] == []


def test_jobs_validate_and_queue_a_priority_shard(client, ctx):
    response = client.post("/v1/jobs", json={
        "body": {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 3}, "priority": 5})
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["object"] == "job" and job["status"] == "queued"
    assert job["endpoint"] == "/v1/chat/completions"
    assert ctx.queue.shards == [(f"{job['id']}:0", True)]
    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"
    bad = client.post("/v1/jobs", json={"body": {"messages": [{"role": "user", "content": "x"}],
                                                 "temperature": 5}})
    assert bad.status_code == 400
    assert "temperature" in bad.json()["error"]["message"]
    completion = client.post("/v1/jobs", json={"body": {"prompt": "abc", "max_tokens": 2}})
    assert completion.json()["endpoint"] == "/v1/completions"
    assert client.get("/v1/jobs/job_nope").status_code == 404


def test_health_and_docs(client, app):
    anonymous = TestClient(app)
    assert anonymous.get("/healthz").json() == {"status": "ok"}
    ready = anonymous.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["database"] == "ok"
    assert anonymous.get("/docs").status_code == 200
    assert "/v1/batches" in anonymous.get("/openapi.json").json()["paths"]
