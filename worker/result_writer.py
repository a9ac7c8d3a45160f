"""Results to the database as lines finish, off the engine's thread.

Every write is conditional on the line still being open, so when two workers ran the same line
(a lease that expired under a slow worker) the first result stays and the second is a no-op: the
open lines among a write's are locked first (in pk order), and only those are written and
counted in their batches' counters (``service.counters``, this worker's slot, at the end of the
transaction, so the counter row is held only until the commit). A shard whose last line is
written is marked done in the same transaction; single jobs get their status and their webhook
events there too. After the commit, a batch whose open-line count reached zero is handed to
finalize once (``on_batches_drained``), instead of a finalize attempt per finished shard.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from sqlalchemy import bindparam, or_, select, update
from sqlalchemy.orm import Session

from service import counters
from service.counters import CounterDelta
from service.db import Database, utcnow
from service.models import (
    JOB_COMPLETED,
    JOB_FAILED,
    JOB_IN_PROGRESS,
    JOB_QUEUED,
    LINE_COMPLETED,
    LINE_OPEN,
    Job,
    RequestLine,
)
from service.objects import job_object
from service.webhooks import queue_event
from worker.claims import finish_shard
from worker.items import HeldShards, LineResult

log = logging.getLogger(__name__)

_lines = RequestLine.__table__
_WRITE_LINE = (
    update(_lines)
    # Spelled out: an IN list cannot be used with executemany.
    .where(_lines.c.pk == bindparam("b_pk"),
           or_(*(_lines.c.status == status for status in LINE_OPEN)))
    .values(
        status=bindparam("b_status"), response=bindparam("b_response"),
        error=bindparam("b_error"), request_id=bindparam("b_request_id"),
        prompt_tokens=bindparam("b_prompt_tokens"),
        completion_tokens=bindparam("b_completion_tokens"),
        cached_tokens=bindparam("b_cached_tokens"), worker_id=bindparam("b_worker_id"),
        finished_at=bindparam("b_finished_at"),
    )
)


def write_results(session: Session, results: list[LineResult], *, worker_id: str) -> set[str]:
    """Write final line results (first writer wins), count them in their batches' counters and
    settle the single jobs among them; returns the batches whose lines were closed."""
    if not results:
        return set()
    first: dict[int, LineResult] = {}
    for result in results:
        first.setdefault(result.work.line_pk, result)
    # Each open line's share of its tenant's quota, read from the row it locks: what its close
    # gives back (service.quotas).
    still_open = dict(session.execute(
        select(RequestLine.pk, RequestLine.enqueued_tokens)
        .where(RequestLine.pk.in_(sorted(first)), RequestLine.status.in_(LINE_OPEN))
        .order_by(RequestLine.pk)
        .with_for_update()
    ).tuples().all())
    todo = [r for pk, r in first.items() if pk in still_open]
    if not todo:
        return set()
    now = utcnow()
    session.execute(_WRITE_LINE, [
        {
            "b_pk": r.work.line_pk, "b_status": r.status, "b_response": r.response,
            "b_error": r.error, "b_request_id": r.request_id, "b_prompt_tokens": r.prompt_tokens,
            "b_completion_tokens": r.completion_tokens, "b_cached_tokens": r.cached_tokens,
            "b_worker_id": worker_id, "b_finished_at": now,
        }
        for r in todo
    ])
    deltas: dict[str, CounterDelta] = {}
    for result in todo:
        if result.work.job_id is not None:
            settle_job(session, result.work.job_id)
        batch_id = result.work.batch_id
        if batch_id is not None:
            deltas[batch_id] = deltas.get(batch_id, CounterDelta()) + CounterDelta.closed(
                result.status, prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens, cached_tokens=result.cached_tokens,
                released_tokens=still_open[result.work.line_pk])
    counters.add(session, deltas, slot=counters.slot_of(worker_id))
    return set(deltas)


def settle_job(session: Session, job_id: str) -> None:
    line = session.scalars(select(RequestLine).where(RequestLine.job_id == job_id)).first()
    if line is None or line.status in LINE_OPEN:
        return
    completed = line.status == LINE_COMPLETED
    now = utcnow()
    won = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_((JOB_QUEUED, JOB_IN_PROGRESS)))
        .values(status=JOB_COMPLETED if completed else JOB_FAILED,
                completed_at=now if completed else None, failed_at=None if completed else now)
        .execution_options(synchronize_session=False)
    ).rowcount
    if won != 1:
        return
    job = session.scalars(select(Job).where(Job.id == job_id)).one()
    session.refresh(job)
    queue_event(
        session, tenant_id=job.tenant_id, event_type="job.completed" if completed else "job.failed",
        object_id=job.id, data=job_object(job, line), object_url=job.webhook_url,
    )


class ResultWriter:
    """A thread that writes results in small transactions (up to ``max_batch`` lines or
    ``max_delay`` seconds of results each), marks finished shards done and hands drained
    batches (no line left open) to finalize."""

    def __init__(
        self,
        db: Database,
        held: HeldShards,
        *,
        worker_id: str,
        on_batches_drained: Callable[[set[str]], None] = lambda batch_ids: None,
        on_jobs_settled: Callable[[], None] = lambda: None,
        max_batch: int = 256,
        max_delay: float = 0.02,
    ) -> None:
        self._db = db
        self._held = held
        self._worker_id = worker_id
        self._on_batches_drained = on_batches_drained
        self._on_jobs_settled = on_jobs_settled  # their webhook events are queued
        self._max_batch = max_batch
        self._max_delay = max_delay
        self._queue: queue.Queue[LineResult | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="boxcar-writer", daemon=True)
        self._pending = 0
        self._idle = threading.Condition()
        self.num_written = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, result: LineResult) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(result)

    def stop(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every submitted result is written."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            results = [first]
            while len(results) < self._max_batch:
                try:
                    item = self._queue.get(timeout=self._max_delay)
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                results.append(item)
            self._write(results)

    def _write(self, results: list[LineResult]) -> None:
        done_shards: list[str] = []
        unheld = False  # a line of a shard this worker no longer holds (its lease was lost)
        for result in results:
            unheld = unheld or result.work.shard_id not in self._held
            if self._held.line_done(result.work.shard_id, result.work.line_pk):
                done_shards.append(result.work.shard_id)
        closed: set[str] = set()
        for attempt in range(5):
            try:
                with self._db.session() as session:
                    closed = write_results(session, results, worker_id=self._worker_id)
                    for shard_id in done_shards:
                        finish_shard(session, shard_id, worker_id=self._worker_id)
                break
            except Exception:
                log.exception("writing %d results failed (attempt %d)", len(results), attempt + 1)
                threading.Event().wait(0.5 * (attempt + 1))
        finished = self._held.remove(done_shards)
        self.num_written += len(results)
        with self._idle:
            self._pending -= len(results)
            self._idle.notify_all()
        # The last line of a batch finishes a shard of it (or lands after a lost lease): only
        # then can its open count have reached zero. Read after the commit, so of two writers
        # closing a batch's last lines at once, the later one sees zero.
        if any(r.work.job_id is not None for r in results):
            self._on_jobs_settled()
        maybe_drained = closed & ({s.batch_id for s in finished} if not unheld else closed)
        if maybe_drained:
            self._hand_drained(maybe_drained)

    def _hand_drained(self, batch_ids: set[str]) -> None:
        try:
            with self._db.read_session() as session:
                left = counters.sums(session, batch_ids)
        except Exception:
            log.exception("reading the counters of %s failed; the finalize scan will find them",
                          sorted(batch_ids))
            return
        drained = {b for b in batch_ids if b not in left or left[b].num_open <= 0}
        if drained:
            self._on_batches_drained(drained)
