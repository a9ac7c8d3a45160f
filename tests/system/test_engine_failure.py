"""A worker whose engine breaks mid-batch (step() raises, as on a CUDA error) exits non-zero at
once for its supervisor, handing its shards back first: a second worker takes them over without
waiting for the leases to run out, and every custom_id comes out exactly once."""

from __future__ import annotations

import json
import time

import httpx
from sqlalchemy import create_engine, text

from tests.conftest_services import chat_line, jsonl, wait_for
from worker.process import EXIT_ENGINE_FAILED


def test_broken_engine_exits_the_worker_and_another_takes_over(production):
    client = httpx.Client(base_url=production.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {production.api_key}"})
    doomed = production.start_worker("broken", module="tests.system.faulty_worker",
                                     env={"BOXCAR_TEST_STEPS_BEFORE_FAILURE": "120"})
    lines = [chat_line(f"f-{i:03d}", f"Item {i}: describe it", max_tokens=48, ignore_eos=True,
                       temperature=0) for i in range(120)]
    file_id = client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("f.jsonl", jsonl(lines))}).json()["id"]
    batch_id = client.post("/v1/batches", json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}).json()["id"]

    code = wait_for(lambda: doomed.poll(), 120, 0.1, "the broken worker to exit")
    production.workers.pop("broken")
    log = production.log_of("broken")
    assert code == EXIT_ENGINE_FAILED, log[-3000:]
    assert "CUDA error" in log and "handing its shards back" in log
    engine = create_engine(production.db_url)
    with engine.connect() as conn:
        running = conn.execute(text(
            "SELECT count(*) FROM shards WHERE batch_id = :b AND status = 'running'"),
            {"b": batch_id}).scalar()
        failed = conn.execute(text(
            "SELECT count(*) FROM request_lines WHERE batch_id = :b AND status = 'failed'"),
            {"b": batch_id}).scalar()
    assert running == 0  # handed back at exit, not left to expire
    assert failed == 0  # the engine's fault fails no line
    done_at_exit = client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"]
    assert done_at_exit < 120

    exited_at = time.monotonic()
    production.start_worker("rescuer")
    done = wait_for(lambda: (b := client.get(f"/v1/batches/{batch_id}").json())["status"]
                    in ("completed", "failed") and b, 180, 0.2, "the rescuer to finish")
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 120, "completed": 120, "failed": 0}
    output = [json.loads(x) for x in
              client.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()]
    ids = [line["custom_id"] for line in output]
    assert len(ids) == len(set(ids)) == 120
    assert set(ids) == {line["custom_id"] for line in lines}
    with engine.connect() as conn:
        writers = conn.execute(text(
            "SELECT count(DISTINCT worker_id) FROM request_lines WHERE batch_id = :b"),
            {"b": batch_id}).scalar()
    engine.dispose()
    assert writers == (2 if done_at_exit else 1)
    print(f"engine broke with {done_at_exit}/120 lines done; the rescuer finished "
          f"{time.monotonic() - exited_at:.1f}s after the exit")
