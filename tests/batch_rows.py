"""Batches and their shards written straight into a database, for tests that read them back
(``boxcar status``'s readers): a batch of 4 lines a shard, its shards in the given states, a
running shard leased to ``owner`` for 30 s; and a database with something in every part of the
status report (``fill_every_part``)."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from typing import Any

from service.counters import CounterDelta, add
from service.db import Database, utcnow
from service.keys import create_key
from service.models import (
    CANCELLING,
    COMPLETED,
    FINALIZING,
    IN_PROGRESS,
    JOB_COMPLETED,
    JOB_IN_PROGRESS,
    JOB_QUEUED,
    SHARD_DONE,
    SHARD_PENDING,
    SHARD_RUNNING,
    VALIDATING,
    Batch,
    File,
    Job,
    Shard,
    WebhookDelivery,
    WorkerStatus,
)


def add_batch(db: Database, tenant_id: str, *, status: str, shards: list[str],
              owner: str = "host:1", **batch_fields: Any) -> str:
    """The new batch's id; ``batch_fields`` are more of the batch row's columns."""
    batch_id = f"batch_{uuid.uuid4().hex[:12]}"
    now = utcnow()
    with db.session() as session:
        file = File(id=f"file-{uuid.uuid4().hex[:12]}", tenant_id=tenant_id, purpose="batch",
                    filename="x.jsonl", bytes=1, storage_key="k", num_lines=4 * len(shards))
        session.add(file)
        session.flush()
        session.add(Batch(id=batch_id, tenant_id=tenant_id, endpoint="/v1/chat/completions",
                          input_file_id=file.id, completion_window="24h", status=status,
                          num_total=4 * len(shards), created_at=now,
                          expires_at=now + dt.timedelta(hours=1), **batch_fields))
        session.flush()
        for i, shard_status in enumerate(shards):
            running = shard_status == SHARD_RUNNING
            session.add(Shard(id=f"{batch_id}:{i}", tenant_id=tenant_id, batch_id=batch_id,
                              status=shard_status, num_lines=4,
                              lease_owner=owner if running else None,
                              lease_expires_at=now + dt.timedelta(seconds=30) if running
                              else None))
    return batch_id


def add_status_batch(db: Database, tenant_id: str, *, status: str, shards: list[str],
                     model: str = "m", prepared: bool = True, enqueued_tokens: int = 0) -> str:
    """``add_batch`` with what the ETAs and held tokens read: the model, prepared or not,
    tokens held, estimates a line."""
    return add_batch(
        db, tenant_id, status=status, shards=shards, model=model,
        prepared_at=utcnow() if prepared else None, enqueued_tokens=enqueued_tokens,
        est_prompt_tokens_per_line=100.0, est_output_tokens_per_line=50.0)


def tenant(db: Database, name: str) -> str:
    with db.session() as session:
        return create_key(session, tenant_name=name).tenant_id


def fill_every_part(db: Database) -> dict[str, str]:
    """Something in every part of ``boxcar status``'s report (batches in every unfinished
    state, counters, jobs, a webhook delivery, two live workers and a gone one); the ids of
    the batches by their role."""
    acme, globex = tenant(db, "acme"), tenant(db, "globex")
    add_status_batch(db, acme, status=COMPLETED, shards=[SHARD_DONE] * 3)
    running = add_status_batch(db, acme, status=IN_PROGRESS, enqueued_tokens=5_000,
                               shards=[SHARD_DONE, SHARD_RUNNING, SHARD_PENDING, SHARD_PENDING])
    preparing = add_status_batch(db, globex, status=IN_PROGRESS, prepared=False,
                                 model="other", enqueued_tokens=700, shards=[SHARD_PENDING])
    ending = add_status_batch(db, globex, status=FINALIZING, shards=[SHARD_DONE])
    add_status_batch(db, acme, status=VALIDATING, shards=[], enqueued_tokens=300)
    add_status_batch(db, globex, status=CANCELLING, shards=[SHARD_RUNNING], enqueued_tokens=40)
    with db.session() as session:
        add(session, {running: CounterDelta(num_open=16), preparing: CounterDelta(num_open=1),
                      ending: CounterDelta(num_completed=4, input_tokens=40,
                                           output_tokens=8)}, slot=0)
        add(session, {running: CounterDelta.closed("completed", prompt_tokens=30,
                                                   completion_tokens=7,
                                                   released_tokens=90)}, slot=3)
        for i, (status, tokens) in enumerate([(JOB_QUEUED, 11), (JOB_IN_PROGRESS, 13),
                                              (JOB_COMPLETED, 17)]):
            session.add(Job(id=f"job_{i}", tenant_id=globex, endpoint="/v1/chat/completions",
                            model="m", status=status, enqueued_tokens=tokens))
        session.add(WebhookDelivery(id="wh_1", tenant_id=acme, event_type="batch.completed",
                                    object_id="batch_x", url="http://hook", payload="{}"))
        forecast = {"at": time.time(), "seats": 4, "seconds_left": 3.0,
                    "cost": {"fixed": 0.1, "per_decode": 0.01, "per_prefill": 0.001},
                    "batches": {running: {"lines": 2, "seconds_left": 3.0}}}
        timeline = [{"t": time.time() - 1, "steps": 3, "generation_tokens_per_s": 80.0,
                     "prompt_tokens_per_s": 20.0}]
        session.add_all([
            WorkerStatus(id="host:1", model="m", heartbeat_at=utcnow(),
                         metrics={"gauges": {"running": 2, "waiting": 1, "kv_usage": 0.5},
                                  "timeline": timeline, "forecast": forecast}),
            WorkerStatus(id="host:2", model="other", heartbeat_at=utcnow(),
                         metrics={"timeline": timeline}),
            WorkerStatus(id="host:3", model="m", metrics=None,  # gone: no recent heartbeat
                         heartbeat_at=utcnow() - dt.timedelta(hours=1))])
    return {"running": running, "preparing": preparing, "ending": ending}
