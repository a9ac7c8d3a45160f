"""Enqueued-token quotas per tenant and model (service.quotas): OpenAI's token_limit_exceeded at
batch validation, 429 with Retry-After for jobs, a key's own limit, /metrics and ``boxcar
status``, and race-free reservations between two API processes (PostgreSQL)."""

from __future__ import annotations

import json
import threading

from fastapi.testclient import TestClient
from openai.types import Batch as BatchObject
from prometheus_client import generate_latest

import service.quotas as quotas
from api.app import build_context, create_app
from api.metrics import metrics_registry
from api.status import collect
from cli.status import format_status
from openai_format.parse import parse_line
from service.keys import create_key
from service.lines import enqueued_tokens
from service.settings import Settings
from tests.api.conftest import RecordingQueue
from tests.conftest_services import chat_line, jsonl, migrated
from tests.openai_shapes import strict

MODEL = "SmolLM2-135M-Instruct"


def tokens_of(lines: list[dict]) -> int:
    return sum(enqueued_tokens(parse_line(json.dumps(x), line_no=1)) for x in lines)


def lines_of(n: int, prefix: str) -> list[dict]:
    return [chat_line(f"{prefix}{i}", "a question " * 3, max_tokens=20) for i in range(n)]


def make_client(ctx, **key) -> TestClient:
    with ctx.db.session() as session:
        secret = create_key(session, tenant_name="acme", **key).key
    return TestClient(create_app(context=ctx), headers={"Authorization": f"Bearer {secret}"})


def create(client, lines: list[dict]):
    file_id = client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("in.jsonl", jsonl(lines))}).json()["id"]
    return client.post("/v1/batches", json={"input_file_id": file_id, "completion_window": "24h",
                                            "endpoint": "/v1/chat/completions"})


def context(settings: Settings, **overrides):
    return build_context(settings.model_copy(update=overrides),
                         db=migrated(settings.database_url), queue=RecordingQueue())


def test_a_batch_over_the_limit_fails_validation_with_openais_error(settings):
    first, second = lines_of(3, "a"), lines_of(3, "b")
    need = tokens_of(first)
    ctx = context(settings, max_enqueued_tokens=need + tokens_of(second) - 1)
    client = make_client(ctx)
    ok = create(client, first)
    assert ok.status_code == 200 and ok.json()["status"] == "validating"
    over = create(client, second)
    assert over.status_code == 200, over.text
    batch = over.json()
    strict(BatchObject, batch)
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    error = batch["errors"]["data"][0]
    assert error["code"] == "token_limit_exceeded"
    limit = need + tokens_of(second) - 1
    assert f"the limit is {limit:,} enqueued tokens, {need:,} are enqueued" in error["message"]
    assert f"needs {tokens_of(second):,} more" in error["message"]
    assert client.get(f"/v1/batches/{batch['id']}").json()["status"] == "failed"
    with ctx.db.read_session() as session:
        held = quotas.enqueued(session)
    assert list(held.values()) == [need]  # the failed batch holds nothing


def test_a_job_over_the_limit_gets_429_with_retry_after(settings):
    ctx = context(settings, max_enqueued_tokens=30, quota_retry_after=17)
    client = make_client(ctx)
    body = {"body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}}
    assert client.post("/v1/jobs", json=body).status_code == 200
    refused = client.post("/v1/jobs", json={"body": {**body["body"], "max_tokens": 25}})
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "17"
    error = refused.json()["error"]
    assert error["code"] == "token_limit_exceeded" and error["type"] == "rate_limit_error"
    assert "the limit is 30 enqueued tokens" in error["message"]


def test_a_keys_own_limit_wins_over_the_deployments(settings):
    lines = lines_of(2, "k")
    ctx = context(settings, max_enqueued_tokens=10**9)
    tight = make_client(ctx, max_enqueued_tokens=tokens_of(lines) - 1)
    assert create(tight, lines).json()["status"] == "failed"
    roomy = make_client(context(settings, max_enqueued_tokens=1),
                        max_enqueued_tokens=tokens_of(lines))
    assert create(roomy, lines).json()["status"] == "validating"
    unlimited = make_client(context(settings, max_enqueued_tokens=None))
    assert create(unlimited, lines_of(50, "u")).json()["status"] == "validating"


def test_metrics_and_status_show_what_tenants_hold(settings):
    lines = lines_of(4, "m")
    ctx = context(settings, max_enqueued_tokens=10_000)
    client = make_client(ctx)
    assert create(client, lines).json()["status"] == "validating"
    page = generate_latest(metrics_registry(ctx.db, 2.0, 10_000)).decode()
    assert f'boxcar_enqueued_tokens{{model="{MODEL}",tenant="acme"}} {float(tokens_of(lines))}' \
        in page
    assert "boxcar_enqueued_tokens_limit 10000.0" in page
    report = collect(ctx.db, interval=2.0, max_enqueued_tokens=10_000)
    assert report["enqueued_tokens"] == [{"tenant": "acme", "model": MODEL,
                                          "tokens": tokens_of(lines), "limit": 10_000}]
    assert f"acme  {MODEL}  {tokens_of(lines):,} of 10,000" in format_status(report)


def test_two_api_processes_creating_at_once_cannot_both_pass(pg_url, tmp_path, monkeypatch):
    """Two API processes (two contexts, each its own connection pool) create a batch each for
    one tenant at once; together they pass the limit, so exactly one is refused. Each waits,
    after it has read what is enqueued, until the other has read too (or 2 s): without the
    tenant row lock both would read the same sum and both pass."""
    settings = Settings(database_url=pg_url, storage_url=str(tmp_path / "storage"),
                        completion_windows=["24h"])
    a_lines, b_lines = lines_of(3, "a"), lines_of(3, "b")
    limit = tokens_of(a_lines) + tokens_of(b_lines) - 1
    ctxs = [context(settings, max_enqueued_tokens=limit) for _ in range(2)]
    with ctxs[0].db.session() as session:
        secret = create_key(session, tenant_name="acme").key
    clients = [TestClient(create_app(context=c), headers={"Authorization": f"Bearer {secret}"})
               for c in ctxs]
    files = [c.post("/v1/files", data={"purpose": "batch"},
                    files={"file": ("in.jsonl", jsonl(lines))}).json()["id"]
             for c, lines in zip(clients, (a_lines, b_lines), strict=True)]
    both_read = threading.Barrier(2, timeout=2.0)
    original = quotas.enqueued

    def enqueued_then_wait(session, **kwargs):
        found = original(session, **kwargs)
        if kwargs.get("model") is not None:  # reserve's read
            try:
                both_read.wait()
            except threading.BrokenBarrierError:
                pass
        return found

    monkeypatch.setattr(quotas, "enqueued", enqueued_then_wait)
    results: list[dict] = [{}, {}]

    def post(i: int) -> None:
        results[i] = clients[i].post("/v1/batches", json={
            "input_file_id": files[i], "completion_window": "24h",
            "endpoint": "/v1/chat/completions"}).json()

    threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    statuses = sorted(r["status"] for r in results)
    assert statuses == ["failed", "validating"], results
    failed = next(r for r in results if r["status"] == "failed")
    assert failed["errors"]["data"][0]["code"] == "token_limit_exceeded"
    with ctxs[0].db.read_session() as session:
        assert sum(original(session).values()) <= limit
    for c in ctxs:
        c.db.dispose()
