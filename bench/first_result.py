"""Time from a batch's create to its first result (issue 31: prepare was one serial transaction,
2.4-7.3 s at 40,000 lines, and no worker started until it committed).

    python -m bench.first_result --lines 50000 --repeats 3

A database of its own on the PostgreSQL server (created, migrated, dropped at the end), the API
in process and one worker in process (bench.scale's paced fake engine, 100 lines a second, on
the embedded queue, as ``boxcar serve`` runs them). Each repeat uploads nothing new: it creates
a batch of the one uploaded file and, from the moment the create returns, polls the batch's
counters (O(1), ``service.counters``) every few milliseconds for the times its first shards
were claimable (the batch ``in_progress``), its first line had a result, and its prepare had
committed its last line; then it cancels the batch and waits for it to end before the next.

To compare with the code before chunked prepare, run this file against that checkout (it uses
only what both have): ``git archive <rev> | tar -x -C /tmp/old && cp bench/first_result.py
/tmp/old/bench/ && cd /tmp/old && python -m bench.first_result``. Wall times: run both on an
idle machine, A/B/A/B, and print the load with them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid

from bench.scale import request_lines

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
POLL_S = 0.005


def _run(db_url: str, *, num_lines: int, repeats: int,
         lines_per_s: float | None) -> list[dict]:
    from fastapi.testclient import TestClient
    from sqlalchemy import select

    from api.app import build_context, create_app
    from engine.testing.fake_engine import FakeEngine
    from service import counters
    from service.db import Database
    from service.keys import create_key
    from service.migrate import upgrade
    from service.models import BATCH_TERMINAL, IN_PROGRESS, Batch
    from service.queue import EmbeddedQueue
    from service.settings import Settings
    from worker.process import WorkerService

    # Before 0009_chunked_prepare a batch is prepared in one transaction: done when in progress.
    chunked = "prepared_at" in Batch.__table__.c
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(database_url=db_url, storage_url=f"{tmp}/storage",
                            max_file_lines=max(num_lines, 50000), poll_interval=0.05)
        db = Database(db_url)
        upgrade(db)
        queue = EmbeddedQueue()
        ctx = build_context(settings, db=db, queue=queue)
        with db.session() as session:
            key = create_key(session, tenant_name="bench").key
        client = TestClient(create_app(context=ctx), headers={"Authorization": f"Bearer {key}"})
        response = client.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("in.jsonl", request_lines(num_lines))})
        response.raise_for_status()
        file_id = response.json()["id"]
        worker = WorkerService(settings, engine=FakeEngine.paced(lines_per_s), db=Database(db_url),
                               storage=ctx.storage, queue=queue).start()
        try:
            for _ in range(repeats):
                response = client.post("/v1/batches", json={
                    "input_file_id": file_id, "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"})
                response.raise_for_status()
                start = time.monotonic()
                batch_id = response.json()["id"]
                times: dict[str, float] = {}
                columns = [Batch.status] + ([Batch.prepared_at] if chunked else [])
                while len(times) < 3 and time.monotonic() - start < 120:
                    with db.read_session() as session:
                        row = session.execute(select(*columns).where(Batch.id == batch_id)).one()
                        sums = counters.sums(session, [batch_id]).get(batch_id)
                    now = time.monotonic() - start
                    if row.status == IN_PROGRESS:
                        times.setdefault("claimable", now)
                        if not chunked or row.prepared_at is not None:
                            times.setdefault("prepared", now)
                    if sums is not None and sums.num_completed > 0:
                        times.setdefault("first_result", now)
                    time.sleep(POLL_S)
                results.append(times)
                client.post(f"/v1/batches/{batch_id}/cancel").raise_for_status()
                deadline = time.monotonic() + 120
                while client.get(f"/v1/batches/{batch_id}").json()["status"] not in BATCH_TERMINAL:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"batch {batch_id} did not end after its cancel")
                    time.sleep(0.05)
        finally:
            worker.stop()
            client.close()
            db.dispose()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=50000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lines-per-s", type=float, default=100.0,
                        help="the paced engine's pace; 0: instant (a line ends in its first "
                        "step: the control plane's time alone)")
    parser.add_argument("--server", default=SERVER, help="the PostgreSQL server's URL (any "
                        "database on it: this creates its own)")
    args = parser.parse_args(argv)

    from sqlalchemy import create_engine, make_url, text

    name = f"bx_first_{uuid.uuid4().hex[:8]}"
    admin = create_engine(args.server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        url = make_url(args.server).set(database=name).render_as_string(hide_password=False)
        print(f"load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        results = _run(url, num_lines=args.lines, repeats=args.repeats,
                       lines_per_s=args.lines_per_s or None)
        print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    for label in ("claimable", "first_result", "prepared"):
        values = [r[label] for r in results if label in r]
        print(f"create -> {label:<13} ({args.lines} lines): "
              + " ".join(f"{v:.2f}" for v in values)
              + (f" s, median {statistics.median(values):.2f} s" if values else " (never)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
