"""A batch's input lines as ``request_lines`` rows, parsed, and their insert.

Each non-blank line of the stored file is parsed by the same ``parse_line`` as at upload (and
the custom_id, model and embedding-input checks run again); a valid line becomes a pending row
with its stored body, engine fields and prefix sort key, a bad one a failed row with its error
and its custom_id. ``worker.prepare`` inserts them a chunk at a time.
"""

from __future__ import annotations

import datetime as dt
import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pydantic_core import to_json
from sqlalchemy import insert
from sqlalchemy.orm import Session

from openai_format.engine_fields import engine_fields
from openai_format.parse import CustomIdTracker, LineError, parse_line
from service import ids
from service.db import utcnow
from service.lines import (
    EmbeddingInputBudget,
    ModelTracker,
    enqueued_tokens,
    estimate_tokens,
    sort_key,
    stored_body,
)
from service.models import LINE_FAILED, LINE_PENDING, Batch, File, RequestLine
from service.storage import ObjectStorage, iter_lines

INSERT_CHUNK = 1000
MAX_BATCH_ERRORS = 100


def line_rows(
    storage: ObjectStorage, file: File, batch: Batch, errors: list[dict], *, mixed_endpoints: bool,
    estimates: list[int], json_value: Callable[[Mapping[str, Any]], Any], max_embedding_inputs: int,
    lora: str | None = None,
) -> Iterator[dict]:
    """The rows of the file's lines, in input order; ``estimates`` collects [prompt, output]
    token estimates of the valid ones, ``errors`` the first ``MAX_BATCH_ERRORS`` errors. The
    JSON columns hold ``json_value`` of their dicts."""
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
                   json_value(engine_fields(parsed.body, lora=lora)), None, None,
                   enqueued_tokens(parsed))


def _row(tenant_id: str, batch_id: str, line_no: int, endpoint: str, status: str,
         key: str, custom_id: str | None, body: Any, fields: Any, error: Any,
         finished_at: dt.datetime | None, tokens: int = 0) -> dict:
    """A line's row with every column prepare fills (``_COPY_COLUMNS``); ``assign_shards``
    sets ``position`` and ``shard_id`` of the valid ones."""
    return {"tenant_id": tenant_id, "batch_id": batch_id, "line_no": line_no,
            "endpoint": endpoint, "status": status, "sort_key": key,
            "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
            "custom_id": custom_id, "body": body, "engine_fields": fields,
            "error": error, "finished_at": finished_at, "position": None, "shard_id": None,
            "enqueued_tokens": tokens}


def assign_shards(rows: list[dict], *, batch_id: str, sizes: list[int], first_position: int,
                  first_shard: int) -> None:
    """Give the valid rows their run position and shard, in prompt-prefix order (lines sharing
    a prefix land in one shard and run together), positions from ``first_position`` and shards
    from index ``first_shard`` on, ``sizes`` lines each (``worker.shard_plan``; they add up to
    the valid rows)."""
    valid = sorted((r for r in rows if r["status"] == LINE_PENDING),
                   key=lambda r: (r["sort_key"], r["line_no"]))
    if sum(sizes) != len(valid):
        raise ValueError(f"shard sizes add up to {sum(sizes)}, not the {len(valid)} valid rows")
    shard_of = [k for k, size in enumerate(sizes) for _ in range(size)]
    for k, row in enumerate(valid):
        row["position"] = first_position + k
        row["shard_id"] = ids.shard_id(batch_id, first_shard + shard_of[k])


# The columns prepare fills (``line_rows`` gives every row all of them).
_COPY_COLUMNS = ("tenant_id", "batch_id", "line_no", "endpoint", "status", "sort_key",
                 "prompt_tokens", "completion_tokens", "cached_tokens", "custom_id", "body",
                 "engine_fields", "error", "finished_at", "position", "shard_id",
                 "enqueued_tokens")
_copy_values = operator.itemgetter(*_COPY_COLUMNS)


def json_text(value: Mapping[str, Any]) -> str:
    """On PostgreSQL the rows hold their JSON columns as text, ready for COPY: a row then holds
    no container, so the garbage collector stops walking 40,000 rows of nested dicts again and
    again while they pile up (a quarter of prepare's CPU at 40,000 lines). pydantic-core's
    encoder, not the json module's: a third of the cost (compact, UTF-8 as is; readers parse
    it; a lone surrogate, which it cannot encode, never gets this far: parse_line fails it)."""
    return to_json(value).decode()


def as_is(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return value


def copies(dialect: str) -> bool:
    """Whether rows go in with ``COPY`` (and hold their JSON as text, ``json_text``)."""
    return dialect == "postgresql"


def insert_lines(session: Session, rows: list[dict]) -> None:
    """Insert in input order (so a batch's pks follow its line numbers): on PostgreSQL one
    ``COPY`` in the session's transaction (a statement per line otherwise: most of prepare's
    time at 50k lines), elsewhere an executemany in chunks."""
    if copies(session.get_bind().dialect.name):
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
