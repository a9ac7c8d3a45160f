"""Validating -> in_progress: a batch's input file becomes request lines and shards.

One worker does it under a lease on the batch row, in one transaction: the lines, each written
once, in input order and already in its shard (bad ones become failed lines at once, with their
error and their custom_id), the shards, the batch's counters and the status. Shards follow
prompt-prefix order: the valid lines are sorted by (sort key, line number) in memory before the
insert (a file holds at most ``max_file_lines``), so no UPDATE and no database sort follow. A
worker that dies half way leaves nothing behind; the lease runs out and another worker starts
over.
"""

from __future__ import annotations

import datetime as dt
import logging
import operator
from collections.abc import Callable, Iterator
from typing import Any

from pydantic_core import to_json
from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from openai_format.embeddings import MAX_BATCH_EMBEDDING_INPUTS
from openai_format.parse import CustomIdTracker, LineError, parse_line
from openai_format.sampling import line_engine_fields
from service import counters, ids
from service.counters import CounterDelta
from service.db import Database, utcnow
from service.lines import (
    EmbeddingInputBudget,
    ModelTracker,
    enqueued_tokens,
    estimate_tokens,
    sort_key,
    stored_body,
)
from service.models import (
    CANCELLING,
    FAILED,
    IN_PROGRESS,
    LINE_FAILED,
    LINE_PENDING,
    VALIDATING,
    Batch,
    File,
    RequestLine,
    Shard,
)
from service.objects import batch_object
from service.storage import ObjectStorage, iter_lines
from service.webhooks import queue_event

log = logging.getLogger(__name__)

PREPARE_LEASE_SECONDS = 120.0
INSERT_CHUNK = 1000
MAX_BATCH_ERRORS = 100


def claim_batch_lease(
    session: Session, batch_id: str, *, statuses: tuple[str, ...], worker_id: str,
    seconds: float, now: dt.datetime | None = None,
) -> bool:
    """Take the batch row's lease (for prepare or finalize) if it is free and the status fits.

    A worker may take back a lease it holds: its retry after a failed attempt (storage or the
    database was down) need not wait for the lease to run out. ``Housekeeper`` keeps two of
    its own threads off one batch."""
    now = now or utcnow()
    return session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_(statuses),
               (Batch.lease_expires_at.is_(None)) | (Batch.lease_expires_at < now)
               | (Batch.lease_owner == worker_id))
        .values(lease_owner=worker_id, lease_expires_at=now + dt.timedelta(seconds=seconds))
        .execution_options(synchronize_session=False)
    ).rowcount == 1


def _line_rows(
    storage: ObjectStorage, file: File, batch: Batch, errors: list[dict], *, mixed_endpoints: bool,
    estimates: list[int], json_value: Callable[[dict], Any], max_embedding_inputs: int,
    lora: str | None = None,
) -> Iterator[dict]:
    """The rows of the file's lines; ``estimates`` collects [prompt, output] token estimates
    of the valid ones. The JSON columns hold ``json_value`` of their dicts."""
    tracker = CustomIdTracker()
    # The upload's check again: the file's model (its lines' first), else the batch's.
    models = ModelTracker(file.model or batch.model)
    inputs = EmbeddingInputBudget(max_embedding_inputs)
    tenant_id, batch_id = batch.tenant_id, batch.id
    for line_no, raw in enumerate(iter_lines(storage, file.storage_key), start=1):
        if not raw.strip():
            continue
        parsed = parse_line(raw, line_no=line_no,
                            endpoint=None if mixed_endpoints else batch.endpoint)
        if not isinstance(parsed, LineError):
            parsed = (tracker.check(parsed.custom_id, line_no=line_no) or models.check(parsed)
                      or inputs.check(parsed) or parsed)
        if isinstance(parsed, LineError):
            if len(errors) < MAX_BATCH_ERRORS:
                errors.append({"code": parsed.code, "message": parsed.message, "param": None,
                               "line": line_no})
            # A failed line keeps its custom_id (a repeated one too: the unique index leaves
            # failed lines out), for its error-file line.
            yield _row(tenant_id, batch_id, line_no, batch.endpoint, LINE_FAILED, "",
                       parsed.custom_id, None, None,
                       json_value({"code": parsed.code, "message": parsed.message}), utcnow())
            continue
        prompt_tokens, output_tokens = estimate_tokens(parsed)
        estimates[0] += prompt_tokens
        estimates[1] += output_tokens
        yield _row(tenant_id, batch_id, line_no, parsed.url, LINE_PENDING, sort_key(parsed),
                   parsed.custom_id, json_value(stored_body(parsed)),
                   json_value(line_engine_fields(parsed.body, lora)), None, None,
                   enqueued_tokens(parsed))


def _row(tenant_id: str, batch_id: str, line_no: int, endpoint: str, status: str,
         key: str, custom_id: str | None, body: Any, fields: Any, error: Any,
         finished_at: dt.datetime | None, tokens: int = 0) -> dict:
    """A line's row with every column prepare fills (``_COPY_COLUMNS``); ``_assign_shards``
    sets ``position`` and ``shard_id`` of the valid ones."""
    return {"tenant_id": tenant_id, "batch_id": batch_id, "line_no": line_no,
            "endpoint": endpoint, "status": status, "sort_key": key,
            "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
            "custom_id": custom_id, "body": body, "engine_fields": fields,
            "error": error, "finished_at": finished_at, "position": None, "shard_id": None,
            "enqueued_tokens": tokens}


def _assign_shards(rows: list[dict], *, batch_id: str, shard_size: int) -> int:
    """Give the valid rows their run position and shard, in prompt-prefix order (lines sharing
    a prefix land in one shard and run together); returns the number of shards."""
    valid = sorted((r for r in rows if r["status"] == LINE_PENDING),
                   key=lambda r: (r["sort_key"], r["line_no"]))
    for position, row in enumerate(valid):
        row["position"] = position
        row["shard_id"] = ids.shard_id(batch_id, position // shard_size)
    return -(-len(valid) // shard_size)


# The columns prepare fills (``_line_rows`` gives every row all of them).
_COPY_COLUMNS = ("tenant_id", "batch_id", "line_no", "endpoint", "status", "sort_key",
                 "prompt_tokens", "completion_tokens", "cached_tokens", "custom_id", "body",
                 "engine_fields", "error", "finished_at", "position", "shard_id",
                 "enqueued_tokens")
_copy_values = operator.itemgetter(*_COPY_COLUMNS)


def _json_text(value: dict) -> str:
    """On PostgreSQL the rows hold their JSON columns as text, ready for COPY: a row then holds
    no container, so the garbage collector stops walking 40,000 rows of nested dicts again and
    again while they pile up (a quarter of prepare's CPU at 40,000 lines). pydantic-core's
    encoder, not the json module's: a third of the cost (compact, UTF-8 as is; readers parse
    it; a lone surrogate, which it cannot encode, never gets this far: parse_line fails it)."""
    return to_json(value).decode()


def _copies(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def _as_is(value: dict) -> dict:
    return value


def _insert_lines(session: Session, rows: list[dict]) -> None:
    """Insert in input order (so a batch's pks follow its line numbers): on PostgreSQL one
    ``COPY`` in the session's transaction (a statement per line otherwise: most of prepare's
    time at 50k lines), elsewhere an executemany in chunks."""
    if _copies(session):
        _copy_lines(session, rows)
        return
    for start in range(0, len(rows), INSERT_CHUNK):
        session.execute(insert(RequestLine), rows[start:start + INSERT_CHUNK])


def _copy_lines(session: Session, rows: list[dict]) -> None:
    conn = session.connection().connection.driver_connection  # psycopg's, in this transaction
    assert conn is not None
    with conn.cursor() as cursor:
        with cursor.copy(f"COPY {RequestLine.__tablename__} ({', '.join(_COPY_COLUMNS)}) "
                         "FROM STDIN") as copy:
            for row in rows:
                copy.write_row(_copy_values(row))


def prepare_batch(
    db: Database, storage: ObjectStorage, batch_id: str, *, worker_id: str, shard_size: int,
    mixed_endpoints: bool = False, adapters: dict[str, str] | None = None,
    max_embedding_inputs: int = MAX_BATCH_EMBEDDING_INPUTS,
) -> list[str] | None:
    """Turn a validating batch into lines and shards. Returns the new shard ids, or None when
    the batch was not this worker's to prepare (not validating, or leased by another).

    ``mixed_endpoints``: lines may name either endpoint; otherwise (the default) a line whose
    url is not the batch's endpoint is an error line, as with OpenAI.

    ``adapters``: the LoRA adapters served (id -> base model id,
    ``service.served_models.configured_adapters``): a batch on one goes to its base model's
    queue and its lines run under the adapter."""
    with db.session() as session:
        if not claim_batch_lease(session, batch_id, statuses=(VALIDATING,), worker_id=worker_id,
                                 seconds=PREPARE_LEASE_SECONDS):
            return None
    try:
        return _prepare(db, storage, batch_id, shard_size=shard_size,
                        mixed_endpoints=mixed_endpoints, adapters=adapters or {},
                        max_embedding_inputs=max_embedding_inputs)
    except Exception:
        log.exception("preparing %s failed", batch_id)
        with db.session() as session:
            session.execute(update(Batch).where(Batch.id == batch_id,
                                                Batch.lease_owner == worker_id)
                            .values(lease_owner=None, lease_expires_at=None))
        raise


def _prepare(
    db: Database, storage: ObjectStorage, batch_id: str, *, shard_size: int,
    mixed_endpoints: bool, adapters: dict[str, str], max_embedding_inputs: int,
) -> list[str]:
    with db.session() as session:
        batch = session.scalars(select(Batch).where(Batch.id == batch_id)).one()
        file = session.scalars(select(File).where(File.id == batch.input_file_id)).one()
        now = utcnow()
        if file.deleted_at is not None:
            _fail(session, batch, [{"code": "invalid_file", "param": "input_file_id",
                                    "line": None, "message": f"input file {file.id} was deleted"}])
            return []
        errors: list[dict] = []
        estimates = [0, 0]
        lora = batch.model if batch.model in adapters else None
        rows = list(_line_rows(storage, file, batch, errors, mixed_endpoints=mixed_endpoints,
                               estimates=estimates, lora=lora,
                               max_embedding_inputs=max_embedding_inputs,
                               json_value=_json_text if _copies(session) else _as_is))
        num_shards = _assign_shards(rows, batch_id=batch.id, shard_size=shard_size)
        num_failed = sum(1 for r in rows if r["status"] == LINE_FAILED)
        num_valid = len(rows) - num_failed
        _insert_lines(session, rows)
        counters.add(session, {batch.id: CounterDelta(num_open=num_valid, num_failed=num_failed)},
                     slot=0)
        if num_valid == 0:
            _fail(session, batch, errors or [{"code": "empty_file", "message": "no request lines",
                                              "param": None, "line": None}],
                  num_failed=num_failed)
            return []
        shard_ids = [ids.shard_id(batch.id, k) for k in range(num_shards)]
        session.execute(insert(Shard), [
            {"id": sid, "tenant_id": batch.tenant_id, "batch_id": batch.id, "job_id": None,
             "model": adapters.get(batch.model, batch.model) if batch.model else batch.model,
             "priority": batch.priority, "status": "pending", "attempts": 0,
             "num_lines": min(shard_size, num_valid - k * shard_size), "created_at": now}
            for k, sid in enumerate(shard_ids)
        ])
        values = {"errors": errors or None, "num_total": num_valid + num_failed,
                  "lease_owner": None, "lease_expires_at": None,
                  "est_prompt_tokens_per_line": estimates[0] / num_valid,
                  "est_output_tokens_per_line": estimates[1] / num_valid,
                  # The quota's hold, from the file's count to its valid lines' exact sum.
                  "enqueued_tokens": sum(r["enqueued_tokens"] for r in rows)}
        started = session.execute(
            update(Batch).where(Batch.id == batch.id, Batch.status == VALIDATING)
            .values(status=IN_PROGRESS, in_progress_at=now, **values)
            .execution_options(synchronize_session=False)
        ).rowcount
        if not started:  # cancelled while validating: finalize settles the lines
            session.execute(update(Batch).where(Batch.id == batch.id).values(**values)
                            .execution_options(synchronize_session=False))
        log.info("batch %s: %d lines (%d with errors) in %d shards%s", batch.id,
                 num_valid + num_failed, num_failed, num_shards,
                 "" if started else f" ({CANCELLING} meanwhile)")
        return shard_ids


def _fail(session: Session, batch: Batch, errors: list[dict], *, num_failed: int = 0) -> None:
    now = utcnow()
    batch.num_total = batch.num_failed = num_failed
    batch.status = FAILED
    batch.failed_at = now
    batch.errors = errors
    batch.lease_owner = None
    batch.lease_expires_at = None
    session.flush()
    queue_event(session, tenant_id=batch.tenant_id, event_type="batch.failed",
                object_id=batch.id, data=batch_object(batch), object_url=batch.webhook_url)
