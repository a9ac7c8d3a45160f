"""Validating -> in_progress: a batch's input file becomes request lines and shards, a chunk at
a time.

One worker does it under a lease on the batch row. The file is read and parsed line by line
(``worker.prepare_rows``) and committed in chunks of whole shards: each chunk's transaction
inserts its lines (each once, in input order, already in its shard; bad ones as failed lines
with their error and their custom_id), its shards, its share of the batch's counters, and moves
the batch's cursor (``Batch.prepared_lines``, the last line number committed) with a
compare-and-set that also checks the lease. The first chunk with valid lines turns the batch
``in_progress``, so its shards are claimable as soon as it commits: workers start a fraction of
a second after create, not after the whole file. The last chunk sets ``Batch.prepared_at`` and
the batch's final figures (total, errors, token estimates, the quota's hold); until then
finalize leaves the batch alone (``prepare_unfinished``), however many of its shards are done.

A prepare that stops half way (the worker dies, storage or the database fails) leaves its
committed chunks; the next one (this worker's retry, or another's once the lease runs out)
reads the file again from the start, to rebuild the custom_id check and the batch's figures,
and inserts only the lines after the cursor: every line exactly once. Chunk boundaries depend
only on the shards already committed (``chunk_shards``) and the shards' sizes only on the input
file's line count (``worker.shard_plan``: full shards, then a tail of shrinking ones, so a
batch's workers run dry together), so a resumed prepare cuts the same shards as one that never
stopped.

Shards follow prompt-prefix order within a chunk: its valid lines are sorted by (sort key, line
number) in memory before the insert, so no UPDATE and no database sort follow.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, case, func, insert, select, update
from sqlalchemy.orm import Session

from openai_format.embeddings import MAX_BATCH_EMBEDDING_INPUTS
from service import counters, ids
from service.counters import CounterDelta
from service.db import Database, utcnow
from service.models import (
    CANCELLING,
    FAILED,
    IN_PROGRESS,
    LINE_PENDING,
    SHARD_PENDING,
    VALIDATING,
    Batch,
    File,
    RequestLine,
    ServedModel,
    Shard,
)
from service.objects import batch_object
from service.storage import ObjectStorage
from service.webhooks import queue_event
from worker.prepare_rows import as_is, assign_shards, copies, insert_lines, json_text, line_rows
from worker.shard_plan import ShardPlan

log = logging.getLogger(__name__)

# Renewed at every chunk's commit (a chunk takes well under a second), so a dead preparer's
# batch is resumed by another worker within this, not after a whole file's time.
PREPARE_LEASE_SECONDS = 30.0
# A chunk is this many shards at first: its lines are parsed and committed in a fraction of a
# second (1,024 lines at 256 a shard), so the first workers start that soon after create.
FIRST_CHUNK_SHARDS = 4
# Then as many shards as are already committed (4, 4, 8, 16, 32, 32...), up to this: a 50,000
# line batch is ten commits, not fifty; a prompt-prefix group spans up to a chunk; a crash
# loses one chunk's work at most.
MAX_CHUNK_SHARDS = 32


# The statuses of a batch being prepared: cancelled meanwhile, it is prepared to the end all
# the same (finalize then cancels every line, as OpenAI's error file lists them).
_PREPARING = (VALIDATING, IN_PROGRESS, CANCELLING)


class PrepareLeaseLost(Exception):
    """The batch's cursor or lease moved under this prepare: another worker took it over."""


def chunk_shards(num_shards: int) -> int:
    """The shards of the next chunk once ``num_shards`` are committed."""
    return max(FIRST_CHUNK_SHARDS, min(MAX_CHUNK_SHARDS, num_shards))


def prepare_unfinished() -> ColumnElement[bool]:
    """Batches whose prepare committed a chunk but not its last: to be resumed, and not to be
    finalized (their open lines are not all there yet) unless their window ends first."""
    return (Batch.status.in_(_PREPARING) & (Batch.prepared_lines > 0)
            & Batch.prepared_at.is_(None))


def is_unfinished(status: str, prepared_lines: int, prepared_at: dt.datetime | None) -> bool:
    """``prepare_unfinished`` of a batch row's values."""
    return status in _PREPARING and prepared_lines > 0 and prepared_at is None


def to_prepare(models: Collection[str] | None = None) -> ColumnElement[bool]:
    """Batches a prepare should start (validating) or resume (unfinished). With ``models`` (the
    base models a worker knows of and its own adapters), only batches on one of them or on a
    model a worker announced: not an adapter that other workers serve (``prepare_batch``)."""
    found = (Batch.status.in_(_PREPARING) & Batch.prepared_at.is_(None)
             & ((Batch.status == VALIDATING) | (Batch.prepared_lines > 0)))
    if models is not None:
        found = found & (Batch.model.is_(None) | Batch.model.in_(list(models))
                         | Batch.model.in_(select(ServedModel.id)))
    return found


def claim_batch_lease(
    session: Session, batch_id: str, *, statuses: tuple[str, ...], worker_id: str,
    seconds: float, now: dt.datetime | None = None,
    where: ColumnElement[bool] | None = None,
) -> bool:
    """Take the batch row's lease (for prepare or finalize) if it is free and the status (and
    ``where``) fits.

    A worker may take back a lease it holds: its retry after a failed attempt (storage or the
    database was down) need not wait for the lease to run out. ``Housekeeper`` keeps two of
    its own threads off one batch."""
    now = now or utcnow()
    query = update(Batch).where(
        Batch.id == batch_id, Batch.status.in_(statuses),
        (Batch.lease_expires_at.is_(None)) | (Batch.lease_expires_at < now)
        | (Batch.lease_owner == worker_id))
    if where is not None:
        query = query.where(where)
    return session.execute(
        query.values(lease_owner=worker_id, lease_expires_at=now + dt.timedelta(seconds=seconds))
        .execution_options(synchronize_session=False)
    ).rowcount == 1


def prepare_batch(
    db: Database, storage: ObjectStorage, batch_id: str, *, worker_id: str, shard_size: int,
    mixed_endpoints: bool = False, adapters: dict[str, str] | None = None,
    max_embedding_inputs: int = MAX_BATCH_EMBEDDING_INPUTS,
    on_shards: Callable[[list[str]], None] = lambda shard_ids: None,
    models: Collection[str] | None = None,
) -> list[str] | None:
    """Turn a validating batch into lines and shards, or finish an unfinished prepare. Returns
    the shard ids this call created, or None when the batch was not this worker's to prepare
    (prepared, or leased by another). ``on_shards`` gets each chunk's shard ids once they are
    committed (claimable unless the batch was cancelled meanwhile).

    ``mixed_endpoints``: lines may name either endpoint; otherwise (the default) a line whose
    url is not the batch's endpoint is an error line, as with OpenAI.

    ``adapters``: the LoRA adapters served (id -> base model id,
    ``service.served_models.configured_adapters``): a batch on one goes to its base model's
    queue and its lines run under the adapter.

    ``models``: the base models this worker knows of (the deployment's and its own, by all
    their names) and its adapters; with them it leaves alone a batch on any other name, an
    adapter of another model's workers (``to_prepare``). Only a worker that serves an adapter
    can prepare for it: another would queue its shards under the adapter's name, which no
    worker consumes, and its lines without the adapter."""
    with db.session() as session:
        if not claim_batch_lease(session, batch_id, statuses=_PREPARING, worker_id=worker_id,
                                 seconds=PREPARE_LEASE_SECONDS, where=to_prepare(models)):
            return None
    try:
        return _Prepare(db, storage, batch_id, worker_id=worker_id, shard_size=shard_size,
                        mixed_endpoints=mixed_endpoints, adapters=adapters or {},
                        max_embedding_inputs=max_embedding_inputs, on_shards=on_shards).run()
    except Exception:
        log.exception("preparing %s failed", batch_id)
        with db.session() as session:
            session.execute(update(Batch).where(Batch.id == batch_id,
                                                Batch.lease_owner == worker_id)
                            .values(lease_owner=None, lease_expires_at=None))
        raise


@dataclass
class _Totals:
    """What prepare has read of the file so far, the lines before its cursor included: the
    batch's figures are those of all its lines, however many runs inserted them."""

    errors: list[dict] = field(default_factory=list)
    estimates: list[int] = field(default_factory=lambda: [0, 0])  # [prompt, output] tokens
    num_valid: int = 0
    num_failed: int = 0
    enqueued_tokens: int = 0

    def count(self, row: dict) -> None:
        if row["status"] == LINE_PENDING:
            self.num_valid += 1
        else:
            self.num_failed += 1
        self.enqueued_tokens += row["enqueued_tokens"]

    def values(self) -> dict:
        """The batch row's figures so far."""
        num_valid = max(self.num_valid, 1)
        return {"errors": self.errors or None,
                "est_prompt_tokens_per_line": self.estimates[0] / num_valid,
                "est_output_tokens_per_line": self.estimates[1] / num_valid}


class _Prepare:
    """One run of prepare over a batch whose lease it holds: from the batch's cursor to the
    end of its file."""

    def __init__(self, db: Database, storage: ObjectStorage, batch_id: str, *, worker_id: str,
                 shard_size: int, mixed_endpoints: bool, adapters: dict[str, str],
                 max_embedding_inputs: int, on_shards: Callable[[list[str]], None]) -> None:
        self.db = db
        self.storage = storage
        self.batch_id = batch_id
        self.worker_id = worker_id
        self.shard_size = shard_size
        self.mixed_endpoints = mixed_endpoints
        self.adapters = adapters
        self.max_embedding_inputs = max_embedding_inputs
        self.on_shards = on_shards
        self.totals = _Totals()

    def run(self) -> list[str]:
        with self.db.read_session() as session:
            batch = session.scalars(select(Batch).where(Batch.id == self.batch_id)).one()
            file = session.scalars(select(File).where(File.id == batch.input_file_id)).one()
            self.num_shards = session.scalar(  # committed by an earlier run (ix_shards_batch)
                select(func.count()).select_from(Shard).where(Shard.batch_id == batch.id)) or 0
        self.batch, self.cursor = batch, batch.prepared_lines
        # From the file's count, not from what this run has read: a resumed prepare cuts the
        # same shards.
        self.plan = ShardPlan(file.num_lines - file.num_errors, self.shard_size)
        self.model = self.adapters.get(batch.model, batch.model) if batch.model else None
        if file.deleted_at is not None:
            error = {"code": "invalid_file", "param": "input_file_id", "line": None,
                     "message": f"input file {file.id} was deleted"}
            with self.db.session() as session:
                if self.num_shards:
                    self._end_at_cursor(session, error)
                else:
                    self._fail(session, [error], num_failed=self._num_committed(session))
            return []
        totals = self.totals
        rows = line_rows(
            self.storage, file, batch, totals.errors, mixed_endpoints=self.mixed_endpoints,
            estimates=totals.estimates, max_embedding_inputs=self.max_embedding_inputs,
            lora=batch.model if batch.model in self.adapters else None,
            json_value=json_text if copies(self.db.engine.dialect.name) else as_is)
        created: list[str] = []
        chunk: list[dict] = []
        chunk_valid = 0
        for row in rows:
            totals.count(row)
            if row["line_no"] <= self.cursor:  # committed by an earlier run
                continue
            chunk.append(row)
            if row["status"] == LINE_PENDING:
                chunk_valid += 1
                if chunk_valid == self.plan.lines(self.num_shards,
                                                  chunk_shards(self.num_shards)):
                    created += self._commit(chunk, num_valid=chunk_valid, last=False)
                    chunk, chunk_valid = [], 0
        created += self._commit(chunk, num_valid=chunk_valid, last=True)
        return created

    def _commit(self, rows: list[dict], *, num_valid: int, last: bool) -> list[str]:
        """One chunk's transaction: its lines, shards and counters, and the batch's cursor;
        then its shards are announced. Returns their ids."""
        batch, totals, now = self.batch, self.totals, utcnow()
        sizes = self.plan.cut(self.num_shards, num_valid)
        assign_shards(rows, batch_id=batch.id, sizes=sizes,
                      first_position=totals.num_valid - num_valid, first_shard=self.num_shards)
        shard_ids = [ids.shard_id(batch.id, self.num_shards + k) for k in range(len(sizes))]
        cursor = rows[-1]["line_no"] if rows else self.cursor
        values = {"prepared_lines": cursor, **totals.values(),
                  "lease_expires_at": now + dt.timedelta(seconds=PREPARE_LEASE_SECONDS)}
        if shard_ids:  # claimable from this commit on (unless it was cancelled meanwhile)
            starts = Batch.status == VALIDATING
            values |= {"status": case((starts, IN_PROGRESS), else_=Batch.status),
                       "in_progress_at": case((starts, now), else_=Batch.in_progress_at)}
        if last:
            values |= {"prepared_at": now, "lease_owner": None, "lease_expires_at": None,
                       "num_total": totals.num_valid + totals.num_failed,
                       # The quota's hold, from the file's count to its valid lines' exact sum.
                       "enqueued_tokens": totals.enqueued_tokens}
        with self.db.session() as session:
            # The cursor first: a preparer whose lease was taken over stops here, and the
            # batch row stays locked (against another preparer) until the chunk commits.
            moved = session.execute(
                update(Batch).where(Batch.id == batch.id, Batch.lease_owner == self.worker_id,
                                    Batch.prepared_lines == self.cursor)
                .values(**values).execution_options(synchronize_session=False)).rowcount
            if moved != 1:
                raise PrepareLeaseLost(f"batch {batch.id}: its prepare was taken over after "
                                       f"line {self.cursor}")
            if rows:
                insert_lines(session, rows)
            counters.add(session, {batch.id: CounterDelta(
                num_open=num_valid, num_failed=len(rows) - num_valid)}, slot=0)
            if shard_ids:
                session.execute(insert(Shard), [
                    {"id": sid, "tenant_id": batch.tenant_id, "batch_id": batch.id,
                     "job_id": None, "model": self.model, "priority": batch.priority,
                     "status": SHARD_PENDING, "attempts": 0, "num_lines": size,
                     "created_at": now}
                    for sid, size in zip(shard_ids, sizes, strict=True)])
            if last and totals.num_valid == 0:
                self._fail(session, totals.errors or [
                    {"code": "empty_file", "message": "no request lines", "param": None,
                     "line": None}], num_failed=totals.num_failed)
        self.cursor = cursor
        self.num_shards += len(shard_ids)
        if last and totals.num_valid:
            log.info("batch %s: %d lines (%d with errors) in %d shards", batch.id,
                     totals.num_valid + totals.num_failed, totals.num_failed, self.num_shards)
        if shard_ids:
            self.on_shards(shard_ids)
        return shard_ids

    def _num_committed(self, session: Session) -> int:
        """The lines committed so far (the counters count each once, ``service.counters``)."""
        sums = counters.sums(session, [self.batch_id]).get(self.batch_id, CounterDelta())
        return sums.num_open + sums.num_completed + sums.num_failed

    def _end_at_cursor(self, session: Session, error: dict) -> None:
        """The input file was deleted half way: the batch runs the lines committed so far."""
        batch = self.batch
        tokens = session.scalar(select(func.sum(RequestLine.enqueued_tokens))
                                .where(RequestLine.batch_id == batch.id)) or 0
        moved = session.execute(
            update(Batch).where(Batch.id == batch.id, Batch.lease_owner == self.worker_id,
                                Batch.prepared_lines == self.cursor)
            .values(prepared_at=utcnow(), lease_owner=None, lease_expires_at=None,
                    num_total=self._num_committed(session), enqueued_tokens=tokens,
                    errors=[*(batch.errors or []), {**error, "message": error["message"]
                            + f" while it was prepared: lines after {self.cursor} not read"}])
            .execution_options(synchronize_session=False)).rowcount
        if moved != 1:
            raise PrepareLeaseLost(f"batch {batch.id}: its prepare was taken over")
        log.warning("batch %s: its input file was deleted half way; it runs its first %d lines",
                    batch.id, self.cursor)

    def _fail(self, session: Session, errors: list[dict], *, num_failed: int = 0) -> None:
        now = utcnow()
        batch = session.scalars(select(Batch).where(Batch.id == self.batch_id)).one()
        batch.num_total = batch.num_failed = num_failed
        batch.status = FAILED
        batch.failed_at = batch.prepared_at = now
        batch.errors = errors
        batch.lease_owner = None
        batch.lease_expires_at = None
        session.flush()
        queue_event(session, tenant_id=batch.tenant_id, event_type="batch.failed",
                    object_id=batch.id, data=batch_object(batch), object_url=batch.webhook_url)
