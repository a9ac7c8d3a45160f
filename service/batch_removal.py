"""Deleting a finished batch: its rows (lines, shards, counters, the batch) and its files
(Anthropic's Message Batches API has a delete; OpenAI's Batches API has none)."""

from __future__ import annotations

from sqlalchemy import delete, update
from sqlalchemy.orm import Session

from service.db import utcnow
from service.models import BATCH_TERMINAL, Batch, BatchCounter, File, RequestLine, Shard


class BatchNotEnded(Exception):
    """The batch is still running: cancel it and wait for it to end first."""


def delete_batch(session: Session, *, batch: Batch) -> list[str]:
    """Delete ``batch`` (terminal, else ``BatchNotEnded``) with its lines, shards and counters,
    and mark its input, output and error files deleted; the storage keys of those files, for
    the caller to delete once the transaction commits."""
    if batch.status not in BATCH_TERMINAL:
        raise BatchNotEnded(f"batch {batch.id} is {batch.status}")
    file_ids = [f for f in (batch.input_file_id, batch.output_file_id, batch.error_file_id) if f]
    files = session.query(File).filter(File.id.in_(file_ids), File.deleted_at.is_(None)).all()
    keys = [f.storage_key for f in files]
    for table in (RequestLine, Shard, BatchCounter):
        session.execute(delete(table).where(table.batch_id == batch.id))
    session.delete(batch)
    session.flush()  # the batch row goes before the input file row it names is changed
    if files:
        session.execute(update(File).where(File.id.in_([f.id for f in files]))
                        .values(deleted_at=utcnow(), line_errors=None))
    return keys
