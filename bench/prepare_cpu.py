"""Prepare's CPU per line, whole and by part: the serial step before a batch's workers start
(issue 17: at 40,000 lines it was 4 s of a 20 s run on 32 workers).

    python -m bench.prepare_cpu --lines 40000 --repeats 3            # PostgreSQL (test database)
    python -m bench.prepare_cpu --db sqlite --lines 40000

Uploads bench.scale's lines once (through the API, in process), then prepares a fresh batch of
that file ``--repeats`` times with ``prepare_batch`` and prints its CPU in ms per line (this
process's, and on PostgreSQL its backends' from /proc) and the wall time; then the parts one
by one on the same lines: parse_line, the custom_id/model checks, stored_body, sort_key,
engine_fields, estimate_tokens. CPU time, not wall time: the figures hold on a loaded
machine. Compare two versions by running both in turn (A/B/A/B), not with figures from another
sitting.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bench.scale import request_lines

PG_BASE = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _cpu_ms_per_line(fn: Callable[[], Any], num_lines: int) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1000 / num_lines


def _cpu_ms_per_line_without_gc(fn: Callable[[], Any], num_lines: int) -> float:
    """The parts keep their results alive, so the garbage collector's passes grow with each
    part: they would land on whichever part runs when one falls due."""
    gc.collect()
    gc.disable()
    try:
        return _cpu_ms_per_line(fn, num_lines)
    finally:
        gc.enable()


def parts(raw_lines: list[bytes], endpoint: str) -> dict[str, float]:
    """ms per line of each step prepare takes on a valid line, timed one step at a time, without
    the garbage collector (the whole figure has its share)."""
    from openai_format.engine_fields import engine_fields
    from openai_format.parse import CustomIdTracker, parse_line
    from service.lines import ModelTracker, estimate_tokens, sort_key, stored_body

    n = len(raw_lines)
    parsed: list[Any] = []
    result = {"parse_line": _cpu_ms_per_line_without_gc(lambda: parsed.extend(
        parse_line(raw, line_no=i, endpoint=endpoint) for i, raw in enumerate(raw_lines, 1)), n)}
    tracker, models = CustomIdTracker(), ModelTracker(None)
    result["custom_id+model checks"] = _cpu_ms_per_line_without_gc(lambda: [
        tracker.check(p.custom_id, line_no=p.line_no) or models.check(p) for p in parsed], n)
    for name, fn in (("stored_body", stored_body), ("sort_key", sort_key),
                     ("engine_fields", lambda p: engine_fields(p.body)),
                     ("estimate_tokens", estimate_tokens)):
        result[name] = _cpu_ms_per_line_without_gc(lambda fn=fn: [fn(p) for p in parsed], n)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=40000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--db", choices=("postgresql", "sqlite"), default="postgresql")
    args = parser.parse_args(argv)

    from fastapi.testclient import TestClient
    from sqlalchemy import event

    from api.app import build_context, create_app
    from service.db import Database, temporary_schema
    from service.keys import create_key
    from service.migrate import upgrade
    from service.queue import EmbeddedQueue
    from service.settings import Settings
    from service.storage import iter_lines
    from worker.prepare import prepare_batch

    data = request_lines(args.lines)
    endpoint = "/v1/chat/completions"
    with tempfile.TemporaryDirectory() as tmp, (
            temporary_schema(PG_BASE, "bx_bench_") if args.db == "postgresql"
            else _nullcontext(f"sqlite:///{tmp}/boxcar.db")) as db_url:
        settings = Settings(database_url=db_url, storage_url=f"{tmp}/storage",
                            max_file_lines=max(args.lines, 50000))
        db = Database(db_url)
        upgrade(db)
        ctx = build_context(settings, db=db, queue=EmbeddedQueue())
        with db.session() as session:
            key = create_key(session, tenant_name="bench").key
        client = TestClient(create_app(context=ctx), headers={"Authorization": f"Bearer {key}"})
        response = client.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("in.jsonl", data)})
        response.raise_for_status()
        file_id = response.json()["id"]
        # Prepare on a Database of its own, to read its PostgreSQL backends' CPU from /proc.
        prep_db, backend_pids = Database(db_url), set()
        if not prep_db.is_sqlite:
            event.listen(prep_db.engine, "connect", lambda conn, _: backend_pids.add(
                conn.info.backend_pid))
        whole, server, wall = [], [], []
        for _ in range(args.repeats):
            response = client.post("/v1/batches", json={
                "input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"})
            response.raise_for_status()
            batch_id = response.json()["id"]
            server_before, wall_start = _backends_cpu_s(backend_pids), time.monotonic()
            whole.append(_cpu_ms_per_line(lambda batch_id=batch_id: prepare_batch(
                prep_db, ctx.storage, batch_id, worker_id="bench",
                shard_size=settings.shard_size), args.lines))
            wall.append((time.monotonic() - wall_start) * 1000 / args.lines)
            server.append((_backends_cpu_s(backend_pids) - server_before) * 1000 / args.lines)
        for name, values in (("prepare_batch CPU", whole), ("its database backends' CPU", server),
                             ("wall", wall)):
            print(f"{name} ({args.db}, {args.lines} lines): "
                  + " ".join(f"{ms:.3f}" for ms in values)
                  + f" ms/line, median {statistics.median(values):.3f}")
        prep_db.dispose()
        raw_lines = list(iter_lines(ctx.storage, _storage_key(db, file_id)))
        by_part = parts(raw_lines, endpoint)
        for name, ms in by_part.items():
            print(f"  {name:<24} {ms:.4f} ms/line")
        print(f"  {'the rest':<24} {statistics.median(whole) - sum(by_part.values()):.4f} ms/line"
              " (rows, JSON text, COPY, the garbage collector)")
        client.close()
        db.dispose()
    return 0


def _backends_cpu_s(pids: set[int]) -> float:
    from bench.scale_probes import process_cpu_s

    return sum(process_cpu_s(pid) or 0.0 for pid in pids)


@contextmanager
def _nullcontext(value: str) -> Iterator[str]:
    yield value


def _storage_key(db: Any, file_id: str) -> str:
    from sqlalchemy import select

    from service.models import File

    with db.read_session() as session:
        return session.scalars(select(File.storage_key).where(File.id == file_id)).one()


if __name__ == "__main__":
    raise SystemExit(main())
