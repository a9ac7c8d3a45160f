"""A batch's live counters (``BatchCounter`` rows): changed in the transaction that changes the
lines they count, summed when a batch's status is read or its end is decided.

A writer adds to the slot of its worker id (``slot_of``), so the workers of one batch touch
different rows and do not queue on one lock; a reader sums one row per worker that wrote to the
batch (and prepare's), however many lines the batch has. ``recount`` rebuilds a batch's slots
from its lines (finalize's check that the counters and the lines agree).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass, fields
from functools import cache
from typing import Any

from sqlalchemy import bindparam, case, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.models import LINE_COMPLETED, LINE_OPEN, BatchCounter, RequestLine


@dataclass(frozen=True)
class CounterDelta:
    """A change to a batch's counters (lines closed: ``num_open`` negative)."""

    num_open: int = 0
    num_completed: int = 0
    num_failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    # Enqueued tokens the closed lines gave back to their tenant's quota (service.quotas).
    released_tokens: int = 0

    def __add__(self, other: CounterDelta) -> CounterDelta:
        # Spelled out: the result writer adds one per line (0.8 us; the loop over fields()
        # this replaces took 1.9).
        return CounterDelta(
            self.num_open + other.num_open, self.num_completed + other.num_completed,
            self.num_failed + other.num_failed, self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens, self.cached_tokens + other.cached_tokens,
            self.released_tokens + other.released_tokens)

    @classmethod
    def closed(cls, status: str, *, prompt_tokens: int = 0, completion_tokens: int = 0,
               cached_tokens: int = 0, released_tokens: int = 0) -> CounterDelta:
        """One open line that became final with ``status``, giving back ``released_tokens``
        (its ``RequestLine.enqueued_tokens``)."""
        completed = status == LINE_COMPLETED
        return cls(-1, int(completed), int(not completed), prompt_tokens, completion_tokens,
                   cached_tokens, released_tokens)


_COLUMNS = tuple(f.name for f in fields(CounterDelta))


@dataclass(frozen=True)
class LineTotals:
    """Counts and usage of a batch's lines."""

    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


def slot_of(worker_id: str) -> int:
    """A worker's own counter row: its id's CRC-32, in the 31 bits of the integer column. Two
    workers collide once in ~2 billion pairs (then they share a row: slower, still correct).
    16 slots (crc32 % 16) put 32 workers two to a row: their result writes queued on each
    other's counter upsert until commit (``Lock:transactionid`` in bench.scale's waits)."""
    return zlib.crc32(worker_id.encode()) & 0x7FFFFFFF


@cache
def _upsert(dialect: str) -> Any:
    """The counter upsert, built once per dialect (both spell it INSERT ... ON CONFLICT DO
    UPDATE) with its values as bound parameters: a result write runs it every transaction, and
    building the statement anew cost more CPU than running it."""
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    stmt = insert(BatchCounter).values(
        batch_id=bindparam("batch_id"), slot=bindparam("slot"),
        **{name: bindparam(name) for name in _COLUMNS})
    return stmt.on_conflict_do_update(
        index_elements=[BatchCounter.batch_id, BatchCounter.slot],
        set_={name: getattr(BatchCounter, name) + getattr(stmt.excluded, name)
              for name in _COLUMNS})


def add(session: Session, deltas: dict[str, CounterDelta], *, slot: int) -> None:
    """Add ``deltas`` (batch id -> change) to ``slot`` of each batch. Batches are taken in id
    order, so two writers that touch the same batches lock their rows in the same order."""
    stmt = _upsert(session.get_bind().dialect.name)
    for batch_id in sorted(deltas):
        delta = deltas[batch_id]
        if delta == CounterDelta():
            continue
        session.execute(stmt, {"batch_id": batch_id, "slot": slot,
                               **{name: getattr(delta, name) for name in _COLUMNS}})


@cache
def _sums_statement() -> Any:
    # Built once: a status poll runs it, and building it (eight sums) cost more of the API's
    # time than running it.
    return (select(BatchCounter.batch_id, *(func.sum(getattr(BatchCounter, n)) for n in _COLUMNS))
            .where(BatchCounter.batch_id.in_(bindparam("batch_ids", expanding=True)))
            .group_by(BatchCounter.batch_id))


def sums_of_one(batch_id: Any) -> Any:
    """The summed counters of the one batch ``batch_id`` (a bound parameter) as a subquery with
    a ``batch_id`` column and one per ``CounterDelta`` field, to join to its ``Batch`` row: a
    status poll reads the batch and its counters in one statement. The filter is inside the
    subquery, so it reads that batch's slots only (no dialect pushes a join's key into a
    grouped subquery)."""
    return sums_where(BatchCounter.batch_id == batch_id)


def sums_where(condition: Any) -> Any:
    """``sums_of_one``'s subquery over the counter rows ``condition`` selects (a condition on
    ``BatchCounter.batch_id``: one batch, or ``any_`` of an array of them)."""
    return (select(BatchCounter.batch_id,
                   *(func.sum(getattr(BatchCounter, n)).label(n) for n in _COLUMNS))
            .where(condition)
            .group_by(BatchCounter.batch_id).subquery("counter_sums"))


def sums_columns(subquery: Any) -> list[Any]:
    """The summed columns of a ``sums_of_one`` subquery, in ``CounterDelta``'s field order."""
    return [subquery.c[name] for name in _COLUMNS]


def delta_of(values: Iterable[Any]) -> CounterDelta:
    """A ``CounterDelta`` from the summed columns in field order (None: no rows, zero)."""
    return CounterDelta(*(int(v or 0) for v in values))


def sums(session: Session, batch_ids: Iterable[str]) -> dict[str, CounterDelta]:
    """The summed counters of ``batch_ids`` (a batch without rows is absent)."""
    ids = list(batch_ids)
    if not ids:
        return {}
    rows = session.execute(_sums_statement(), {"batch_ids": ids}).all()
    return {row[0]: delta_of(row[1:]) for row in rows}


def num_open(session: Session, batch_id: str) -> int:
    return sums(session, [batch_id]).get(batch_id, CounterDelta()).num_open


def totals(session: Session, batches: Iterable[tuple[str, int]]) -> dict[str, LineTotals]:
    """Live totals of ``(batch id, num_total)`` pairs: counts and usage from the counters."""
    pairs = list(batches)
    found = sums(session, (batch_id for batch_id, _ in pairs))
    return {batch_id: as_totals(total, found.get(batch_id, CounterDelta()))
            for batch_id, total in pairs}


def as_totals(total: int, c: CounterDelta) -> LineTotals:
    """A batch's live totals from its summed counters and its ``num_total``."""
    return LineTotals(total, c.num_completed, c.num_failed, c.input_tokens, c.output_tokens,
                      c.cached_tokens)


def from_lines(session: Session, batch_id: str) -> CounterDelta:
    """What the counters of ``batch_id`` should say, counted from its lines."""
    is_open = RequestLine.status.in_(LINE_OPEN)
    row = session.execute(
        select(
            func.coalesce(func.sum(case((is_open, 1), else_=0)), 0),
            func.coalesce(func.sum(case((RequestLine.status == LINE_COMPLETED, 1), else_=0)), 0),
            func.coalesce(func.sum(case((is_open, 0), (RequestLine.status == LINE_COMPLETED, 0),
                                        else_=1)), 0),
            func.coalesce(func.sum(RequestLine.prompt_tokens), 0),
            func.coalesce(func.sum(RequestLine.completion_tokens), 0),
            func.coalesce(func.sum(RequestLine.cached_tokens), 0),
            func.coalesce(func.sum(case((is_open, 0), else_=RequestLine.enqueued_tokens)), 0),
        ).where(RequestLine.batch_id == batch_id)
    ).one()
    return CounterDelta(*(int(v) for v in row))


def recount(session: Session, batch_id: str) -> CounterDelta:
    """Replace the counters of ``batch_id`` by its lines' figures; returns them."""
    truth = from_lines(session, batch_id)
    session.execute(delete(BatchCounter).where(BatchCounter.batch_id == batch_id))
    add(session, {batch_id: truth}, slot=0)
    return truth
