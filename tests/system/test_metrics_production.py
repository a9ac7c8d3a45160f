"""Metrics on the production stack: a Celery worker process serves its own /metrics port and
publishes its engine's snapshot to PostgreSQL; the API's /metrics carries it (labelled by
worker) with the service's state; ``boxcar doctor`` and ``boxcar status`` read both."""

from __future__ import annotations

import json

import httpx

from api.status import collect
from cli import main as cli
from cli.doctor_commands import parse_exposition
from service.db import Database
from tests.conftest_services import chat_line, free_port, jsonl, wait_for


def test_worker_and_api_metrics(production, capsys):
    port = free_port()
    production.env["BOXCAR_WORKER_METRICS_PORT"] = str(port)
    production.env["BOXCAR_WORKER_METRICS_INTERVAL"] = "0.5"
    try:
        production.start_worker("metered")
    finally:
        del production.env["BOXCAR_WORKER_METRICS_PORT"]
        del production.env["BOXCAR_WORKER_METRICS_INTERVAL"]
    client = httpx.Client(base_url=production.base_url, timeout=30, follow_redirects=True,
                          headers={"Authorization": f"Bearer {production.api_key}"})
    lines = [chat_line(f"m-{i}", f"Say {i}", max_tokens=5, temperature=0) for i in range(12)]
    file_id = client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("m.jsonl", jsonl(lines))}).json()["id"]
    batch_id = client.post("/v1/batches", json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}).json()["id"]
    wait_for(lambda: client.get(f"/v1/batches/{batch_id}").json()["status"] == "completed",
             60, 0.1, "the batch")

    def api_snapshot() -> dict | None:
        snapshot = parse_exposition(client.get("/metrics").text)
        return snapshot if snapshot["counters"]["requests_finished"] >= 12 else None

    snapshot = wait_for(api_snapshot, 20, 0.2, "the worker's snapshot on the API")
    assert snapshot["counters"]["generation_tokens"] >= 12 * 5
    assert snapshot["config"]["max_num_seqs"] == 8
    text = client.get("/metrics").text
    assert 'worker="' in text and 'boxcar_batches{status="completed"}' in text

    own = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert "boxcar_time_to_first_token_seconds_bucket" in own
    assert 'boxcar_lines_finished_total{status="completed"} 12.0' in own  # process counters

    assert cli.main(["doctor", f"{production.base_url}/metrics", "--duration", "0",
                     "--json"]) == 0
    assert "findings" in json.loads(capsys.readouterr().out)

    db = Database(production.db_url)
    try:
        report = collect(db, interval=0.5)
    finally:
        db.dispose()
    [worker] = report["workers"]
    assert worker["heartbeat_age_s"] < 10
    assert report["batches"].get("completed", 0) >= 1
