"""A database or object storage that is down is a 503 with Retry-After, never a 500 with a trace
(the fault tests in tests/system/test_faults.py do the same against real servers)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import build_context, create_app
from service.db import Database
from tests.api.conftest import RecordingQueue
from tests.conftest_services import chat_line, jsonl

AUTH = {"Authorization": "Bearer bx-some-key-that-is-long-enough"}


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/files", None),
    ("GET", "/v1/batches/batch_x", None),
    ("POST", "/v1/batches", {"input_file_id": "file-x", "endpoint": "/v1/chat/completions"}),
    ("POST", "/v1/jobs", {"body": {"messages": [{"role": "user", "content": "hi"}]}}),
    ("GET", "/v1/webhook_endpoints", None),
])
def test_database_down_is_503(settings, method, path, body):
    down = Database("postgresql+psycopg://postgres@127.0.0.1:1/none?connect_timeout=2")
    ctx = build_context(settings, db=down, queue=RecordingQueue())
    with TestClient(create_app(context=ctx), raise_server_exceptions=False) as client:
        response = client.request(method, path, json=body, headers=AUTH)
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "5"
        error = response.json()["error"]
        assert error["code"] == "database_unavailable"
        assert error["type"] == "service_unavailable_error"
        assert "Traceback" not in response.text and "psycopg" not in response.text
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["database"] != "ok"
    down.dispose()


def test_storage_down_on_download_is_503_not_a_cut_body(client, ctx, monkeypatch):
    file_id = client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("a.jsonl", jsonl([chat_line("a", "hi")]))}).json()["id"]

    def refuse(key, chunk_size=1 << 20):
        from botocore.exceptions import EndpointConnectionError

        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1/")
        yield b""  # a generator, like the real one: it fails on the first chunk

    monkeypatch.setattr(ctx.storage, "iter_chunks", refuse)
    response = client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "object_storage_unavailable"
    assert response.headers["retry-after"]


def test_database_lost_during_the_create_estimate_is_503(client, ctx, monkeypatch):
    # Found by the chaos run (bench/chaos.py): the estimate swallowed the database's error, and
    # the create's next statement on the broken session answered a 500.
    from sqlalchemy.exc import OperationalError

    file_id = client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("a.jsonl", jsonl([chat_line("a", "hi")]))}).json()["id"]

    def lost(*args, **kwargs):
        raise OperationalError("SELECT workers", {}, Exception("server closed the connection"))

    monkeypatch.setattr("api.routes.batches.create_estimate", lost)
    response = client.post("/v1/batches", json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "database_unavailable"
    assert client.get("/v1/batches").json()["data"] == []  # nothing half-created
