"""Files that expire: OpenAI's ``expires_after {anchor: "created_at", seconds}`` on an upload and
``output_expires_after`` on a batch (its output and error files), and the housekeeping step
that deletes expired files from object storage and the database.

An expired file is gone for the API at once (not listed, not retrievable, its content a 404:
``not_expired``); ``delete_expired`` then removes its bytes and its row, a bounded number of
files a call, each in its own short transaction, so it never holds a lock the API waits on.
The row stays (its bytes gone, ``deleted_at`` set, ``line_errors`` dropped) while a batch names
it as its input: the batch object keeps pointing at it.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, exists, select, update
from sqlalchemy.sql.elements import ColumnElement

from service.db import Database, utcnow
from service.models import Batch, File
from service.storage import ObjectStorage

log = logging.getLogger(__name__)

# OpenAI's bounds on expires_after.seconds and output_expires_after.seconds.
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 86400
ANCHOR = "created_at"
# Files a housekeeping call deletes at most: each is a storage call and a short transaction.
DELETE_STEP = 100


class ExpiresAfterError(ValueError):
    """An ``expires_after`` the API refuses; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ExpiresAfter:
    seconds: int


def parse_expires_after(anchor: Any, seconds: Any, *, field: str) -> ExpiresAfter:
    """Check an ``{anchor, seconds}`` pair as OpenAI does (``seconds`` may come as form text)."""
    if anchor != ANCHOR:
        raise ExpiresAfterError(f"{field}.anchor must be {ANCHOR!r}, got {anchor!r}",
                                f"{field}.anchor")
    if isinstance(seconds, str) and seconds.strip().isdigit():
        seconds = int(seconds)
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise ExpiresAfterError(f"{field}.seconds must be an integer, got {seconds!r}",
                                f"{field}.seconds")
    check_seconds(seconds, field=f"{field}.seconds")
    return ExpiresAfter(seconds)


def check_seconds(seconds: int, *, field: str) -> int:
    if not MIN_EXPIRES_AFTER_S <= seconds <= MAX_EXPIRES_AFTER_S:
        raise ExpiresAfterError(
            f"{field} must be between {MIN_EXPIRES_AFTER_S} (1 hour) and "
            f"{MAX_EXPIRES_AFTER_S} (30 days), got {seconds}", field)
    return seconds


def expires_at(created_at: dt.datetime, seconds: int | None) -> dt.datetime | None:
    return None if seconds is None else created_at + dt.timedelta(seconds=seconds)


def not_expired(now: dt.datetime) -> ColumnElement[bool]:
    """The files the API still shows: not deleted, not past their expiry."""
    return File.deleted_at.is_(None) & (File.expires_at.is_(None) | (File.expires_at > now))


def delete_expired(db: Database, storage: ObjectStorage, *, now: dt.datetime | None = None,
                   limit: int = DELETE_STEP) -> int:
    """Delete up to ``limit`` expired files (bytes, then row); returns how many. Safe to run in
    several workers at once: a storage delete of a missing object is harmless, and the row's
    delete is conditional on it still being there."""
    now = now or utcnow()
    with db.read_session() as session:
        found = session.execute(
            select(File.id, File.storage_key)
            .where(File.deleted_at.is_(None), File.expires_at <= now)
            .order_by(File.expires_at).limit(limit)
        ).all()
    for file_id, storage_key in found:
        storage.delete(storage_key)
        with db.session() as session:
            named = session.scalar(select(exists().where(Batch.input_file_id == file_id)))
            if named:
                session.execute(update(File).where(File.id == file_id,
                                                   File.deleted_at.is_(None))
                                .values(deleted_at=now, line_errors=None)
                                .execution_options(synchronize_session=False))
            else:
                session.execute(delete(File).where(File.id == file_id)
                                .execution_options(synchronize_session=False))
        log.info("file %s expired: deleted", file_id)
    return len(found)
