"""A worker killed with SIGKILL in the middle of a batch: a second worker takes its shards over
once their leases run out (seconds, not the broker's visibility timeout) and the batch completes
with every custom_id exactly once."""

from __future__ import annotations

import json
import time

import httpx
from sqlalchemy import create_engine, text

from tests.conftest_services import chat_line, jsonl, wait_for


def test_sigkilled_worker_loses_nothing_and_repeats_nothing(production):
    client = httpx.Client(base_url=production.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {production.api_key}"})
    production.start_worker("doomed")
    lines = [chat_line(f"k-{i:03d}", f"Item {i}: describe it", max_tokens=48, ignore_eos=True,
                       temperature=0) for i in range(160)]
    file_id = client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("k.jsonl", jsonl(lines))}).json()["id"]
    batch_id = client.post("/v1/batches", json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}).json()["id"]

    def progress() -> dict:
        return client.get(f"/v1/batches/{batch_id}").json()

    wait_for(lambda: progress()["request_counts"]["completed"] >= 16, 60, 0.05,
             "the doomed worker to finish some lines")
    production.kill_worker("doomed")
    at_kill = progress()
    assert at_kill["status"] == "in_progress"
    assert at_kill["request_counts"]["completed"] < 160, "the batch finished before the kill"
    killed_at = time.monotonic()

    production.start_worker("rescuer")
    done = wait_for(lambda: (b := progress())["status"] in ("completed", "failed") and b, 120,
                    0.2, "the rescuer to finish the batch")
    took = time.monotonic() - killed_at
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 160, "completed": 160, "failed": 0}
    output = [json.loads(x) for x in
              client.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()]
    ids = [line["custom_id"] for line in output]
    assert len(ids) == len(set(ids)) == 160
    assert set(ids) == {line["custom_id"] for line in lines}
    assert done["error_file_id"] is None

    engine = create_engine(production.db_url)
    with engine.connect() as conn:
        by_worker = dict(conn.execute(text(
            "SELECT split_part(worker_id, ':', 2), count(*) FROM request_lines "
            "GROUP BY worker_id")).all())
        retried = conn.execute(text("SELECT count(*) FROM shards WHERE attempts > 1")).scalar()
    engine.dispose()
    assert len(by_worker) == 2, by_worker  # both workers wrote results, none twice
    assert retried >= 1
    print(f"taken over and finished {took:.1f}s after the kill "
          f"({at_kill['request_counts']['completed']} lines were done at the kill)")
