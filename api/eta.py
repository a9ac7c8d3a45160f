"""When a live batch will be done: ``estimated_completion_at``, and whether that passes its
deadline.

Most of the answer comes from the workers. Each one forecasts, for the lines it holds (in its
engine and in its line queue), when each batch's share will be done, from what only it knows: every
sequence's computed and generated tokens, the order its lines will enter the engine, and what its
own steps cost (``metrics.forecast``, published with its heartbeat; a restarted worker starts from
its engine's earlier steps, ``metrics.step_history``). A batch whose lines are all held is done
when the last worker holding some says so, and never before now.

Lines no worker holds yet (shards still pending) run after the workers' held work, at the pace
the workers' step costs give for a full engine. Per line: its prompt tokens times (1 - its prefix
cache hit rate) and its output tokens, from the batch's own finished lines once
``MIN_LEARNED_LINES`` are done, before that prepare's estimates (prompt characters / 4,
``max_tokens`` or ``DEFAULT_OUTPUT_TOKENS``; ``service.lines.estimate_tokens``). Work ahead
follows the queue order (``service.queue_order``): pending lines of batches of a more urgent
class run first, those of the same class share the workers with this one (each counts up to this
batch's own), and less urgent ones wait.

Workers that publish no forecast (an engine that cannot report its sequences) leave the older
estimate: the tokens left (the same per-line figures times the open lines, plus the work ahead)
over the tokens per second the workers computed in the last ``RATE_WINDOW_S`` seconds of their
timelines.

A batch still validating has no lines yet: its file's line count and its estimates at create
(``api.create_eta``) stand for them, and it queues as an in-progress batch would. Null while
unknown: no worker has stepped recently.
A batch's open lines, finished lines and usage come from its counter rows (``service.counters``)
(while its prepare still commits chunks, the open lines are the file's lines not finished),
so a read costs a few rows per live batch whatever the batches' sizes; it is cached ``CACHE_S``
seconds per process and serves every poll: the cost does not grow with the number of pollers.
Two kinds of value are known to be about to change, and a poll of that batch gets a new one
after ``SOON_S`` instead: none for a batch that went in progress after the value was made, and
a provisional one (no worker held any of its lines while a worker of its model had free seats:
that worker claims them within moments and publishes its forecast of them). On a batch of
seconds, the first value served for ``CACHE_S`` was most of its life.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from metrics.cost import Cost
from service import counters
from service.counters import CounterDelta
from service.liveness import live_workers
from service.models import FINALIZING, IN_PROGRESS, VALIDATING, Batch
from service.queue_order import bulk_rank

log = logging.getLogger(__name__)

MIN_LEARNED_LINES = 3
RATE_WINDOW_S = 30.0
CACHE_S = 2.0
SOON_S = 0.25  # the age at which a missing or provisional value is made again (EtaCache)
MAX_STALE_S = 10.0  # older than this, a poll computes the estimate itself (EtaCache)


@dataclass(frozen=True)
class BatchEta:
    estimated_completion_at: float | None
    deadline: float | None
    work_left: float  # tokens
    # Made while no worker held any of its lines and a worker of its model had free seats: a
    # forecast of them is moments away (EtaCache makes the next value sooner).
    provisional: bool = False

    @property
    def late(self) -> bool:
        """The estimate passes the deadline."""
        return (self.estimated_completion_at is not None and self.deadline is not None
                and self.estimated_completion_at > self.deadline)


@dataclass(frozen=True)
class LiveBatch:
    """What the estimate needs of one in-progress or finalizing batch (``live_batch``)."""

    id: str
    model: str | None
    status: str
    rank: tuple[int, int]
    deadline: float | None
    remaining: int  # open lines
    prompt: float  # tokens a line computes for its prompt (prefix hits excluded)
    output: float  # tokens a line generates

    @property
    def work_left(self) -> float:
        return self.remaining * (self.prompt + self.output)


def per_line(*, completed: int, input_tokens: int, output_tokens: int, cached_tokens: int,
             est_prompt: float, est_output: float) -> tuple[float, float]:
    """(prompt tokens to compute, output tokens) of one unfinished line (module docstring)."""
    if completed >= MIN_LEARNED_LINES:
        hit = cached_tokens / input_tokens if input_tokens else 0.0
        return input_tokens / completed * (1.0 - hit), output_tokens / completed
    return est_prompt, est_output


def work_left(*, remaining: int, completed: int, input_tokens: int, output_tokens: int,
              cached_tokens: int, est_prompt: float, est_output: float) -> float:
    """Tokens left to compute for ``remaining`` unfinished lines (see the module docstring)."""
    prompt, output = per_line(completed=completed, input_tokens=input_tokens,
                              output_tokens=output_tokens, cached_tokens=cached_tokens,
                              est_prompt=est_prompt, est_output=est_output)
    return remaining * (prompt + output)


def throughput(snapshots: list[dict[str, Any]], *, now: float) -> float | None:
    """Tokens per second the workers computed recently (summed over workers), or None."""
    total, seen = 0.0, False
    for snap in snapshots:
        points = [p for p in snap.get("timeline", [])
                  if p.get("steps") and p.get("t", 0) >= now - RATE_WINDOW_S]
        if not points:
            continue
        seen = True
        total += sum(p.get("generation_tokens_per_s", 0.0) + p.get("prompt_tokens_per_s", 0.0)
                     for p in points) / len(points)
    return total if seen and total > 0 else None


@dataclass(frozen=True)
class WorkerForecast:
    """One worker's published forecast (``worker.forecaster.Forecaster.snapshot``)."""

    at: float  # unix seconds the forecast counts from
    seats: int
    seconds_left: float  # until every line it holds is done
    cost: Cost
    batches: dict[str, tuple[int, float]]  # batch id -> (lines held, seconds until done)

    @classmethod
    def parse(cls, snapshot: dict[str, Any]) -> WorkerForecast | None:
        """None when the snapshot has none (or one this version cannot read)."""
        data = snapshot.get("forecast")
        if not isinstance(data, dict):
            return None
        try:
            cost = data["cost"]
            return cls(float(data["at"]), max(int(data["seats"]), 1),
                       float(data["seconds_left"]),
                       Cost(float(cost["fixed"]), float(cost["per_decode"]),
                            float(cost["per_prefill"])),
                       {b: (int(v["lines"]), float(v["seconds_left"]))
                        for b, v in data["batches"].items()})
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    @property
    def has_room(self) -> bool:
        """It holds fewer batch lines than its engine has seats: it claims more at once."""
        return sum(lines for lines, _ in self.batches.values()) < self.seats

    def line_seconds(self, prompt: float, output: float) -> float:
        """A line's share of a full engine's time: its prompt and decodes, and its seat's
        share of each step's fixed cost."""
        cost = self.cost
        return (cost.per_prefill * prompt
                + (cost.per_decode + cost.fixed / self.seats) * output)


def _pool_seconds(forecasts: list[WorkerForecast], lines: float, prompt: float,
                  output: float) -> float:
    """Seconds for the workers together to run ``lines`` lines of this size."""
    rate = sum(1.0 / max(f.line_seconds(prompt, output), 1e-9) for f in forecasts)
    return lines / rate


def _from_forecasts(b: LiveBatch, live: list[LiveBatch], forecasts: list[WorkerForecast],
                    now: float) -> float:
    def held(batch: LiveBatch) -> int:
        return sum(f.batches[batch.id][0] for f in forecasts if batch.id in f.batches)

    ends = [f.at + f.batches[b.id][1] for f in forecasts if b.id in f.batches]
    # A forecast's end that has passed while its lines are still open (a step ran longer than
    # forecast, and the next forecast comes after it) is late, not done: never in the past.
    held_end = max([*ends, now])
    pending = b.remaining - held(b)
    if pending <= 0:
        return held_end
    # Pending lines are claimed as the workers' held work drains: they start after it.
    start = max(now, sum(f.at + f.seconds_left for f in forecasts) / len(forecasts))
    own = _pool_seconds(forecasts, pending, b.prompt, b.output)
    queued = 0.0
    for o in live:
        if (o.id == b.id or o.model != b.model or o.status not in QUEUED_STATUSES
                or o.rank > b.rank):
            continue
        seconds = _pool_seconds(forecasts, max(o.remaining - held(o), 0), o.prompt, o.output)
        queued += seconds if o.rank < b.rank else min(seconds, own)
    return max(held_end, start + queued + own)


# Batches whose open lines wait for the workers: a validating batch's lines are about to.
QUEUED_STATUSES = (VALIDATING, IN_PROGRESS)
LIVE_STATUSES = (*QUEUED_STATUSES, FINALIZING)  # the batches ``estimate`` estimates


class BatchFields(Protocol):
    """What ``live_batch`` reads of a batch: a ``Batch`` row, or a status read's row."""

    id: str
    model: str | None
    status: str
    priority: int
    expires_at: dt.datetime | None
    prepared_at: dt.datetime | None
    num_total: int
    est_prompt_tokens_per_line: float
    est_output_tokens_per_line: float


def live_batch(b: BatchFields, sums: CounterDelta) -> LiveBatch:
    """A live batch from its row and its counters' sums (``service.counters``): its open
    lines, finished lines and usage, never its lines."""
    deadline = b.expires_at.timestamp() if b.expires_at else None
    prompt, output = per_line(completed=sums.num_completed, input_tokens=sums.input_tokens,
                              output_tokens=sums.output_tokens,
                              cached_tokens=sums.cached_tokens,
                              est_prompt=b.est_prompt_tokens_per_line,
                              est_output=b.est_output_tokens_per_line)
    remaining = sums.num_open
    if b.prepared_at is None:  # prepare still committing chunks: the file's lines count
        remaining = max(remaining, b.num_total - sums.num_completed - sums.num_failed)
    return LiveBatch(b.id, b.model, b.status, bulk_rank(deadline, b.priority), deadline,
                     remaining, prompt, output)


def live_batches(session: Session) -> list[LiveBatch]:
    """Every batch in progress or finalizing, read with its counters' sums (a row per worker
    that ran it)."""
    batches = session.scalars(select(Batch).where(Batch.status.in_(LIVE_STATUSES))).all()
    if not batches:
        return []
    found = counters.sums(session, [b.id for b in batches])
    return [live_batch(b, found.get(b.id, CounterDelta())) for b in batches]


def forecast(live: list[LiveBatch], workers: Sequence[tuple[str | None, dict[str, Any] | None]],
             *, now: float) -> dict[str, BatchEta]:
    """The estimate of each of ``live`` from the live workers' (model, metrics snapshot),
    computed, nothing read."""
    result: dict[str, BatchEta] = {}
    for b in live:
        if b.status == FINALIZING:
            result[b.id] = BatchEta(now, b.deadline, 0.0)
            continue
        own_model = [metrics or {} for model, metrics in workers if model == b.model]
        serving = own_model or [metrics or {} for _, metrics in workers]
        forecasts = [f for snap in serving if (f := WorkerForecast.parse(snap)) is not None]
        if forecasts:
            provisional = (bool(own_model) and b.remaining > 0
                           and not any(b.id in f.batches for f in forecasts)
                           and any(f.has_room for f in forecasts))
            result[b.id] = BatchEta(_from_forecasts(b, live, forecasts, now), b.deadline,
                                    b.work_left, provisional)
            continue
        rate = throughput(serving, now=now)
        if rate is None:
            result[b.id] = BatchEta(None, b.deadline, b.work_left)
            continue
        same_model = [o for o in live if o.id != b.id and o.model == b.model
                      and o.status in QUEUED_STATUSES]
        ahead = sum(o.work_left for o in same_model if o.rank < b.rank)
        shared = sum(min(o.work_left, b.work_left) for o in same_model if o.rank == b.rank)
        result[b.id] = BatchEta(now + (ahead + shared + b.work_left) / rate, b.deadline,
                                b.work_left)
    return result


def estimate(session: Session, *, worker_metrics_interval: float,
             now: float | None = None) -> dict[str, BatchEta]:
    """The estimate of every in-progress or finalizing batch, by id."""
    now = time.time() if now is None else now
    live = live_batches(session)
    if not live:
        return {}
    workers = live_workers(session, interval=worker_metrics_interval)
    return forecast(live, [(w.model, w.metrics) for w in workers], now=now)


class EtaCache:
    """``estimate`` at most once per ``ttl`` seconds; every poll in between reads it. A poll
    that names its batch (``batch_id``, a batch in progress or finalizing) and finds its value
    missing or provisional takes it as old once it is ``soon`` seconds old (module docstring).

    With ``refresh_session`` (a factory of read sessions: the API's), a poll that finds the
    value older than ``ttl`` is answered with it at once and one thread of the cache's own
    computes the next: a poll never waits for ``estimate`` (tens of milliseconds of reads and
    worker snapshots on a busy machine, every ``ttl``, on whichever poll came then) unless
    the value is older than ``max_stale`` (the first poll, or the first after a quiet spell).
    Without it the poll that finds the value old computes the next one itself."""

    def __init__(self, worker_metrics_interval: float, ttl: float = CACHE_S, *,
                 clock: Callable[[], float] = time.monotonic,
                 refresh_session: Callable[[], AbstractContextManager[Session]] | None = None,
                 max_stale: float = MAX_STALE_S, soon: float = SOON_S) -> None:
        self._interval = worker_metrics_interval
        self._ttl = ttl
        self._soon = min(soon, ttl)
        self._clock = clock
        self._refresh_session = refresh_session
        self._max_stale = max(max_stale, ttl)
        self._lock = threading.Lock()
        self._at = -1e18
        self._value: dict[str, BatchEta] = {}
        self._refreshing = False

    def get_nowait(self, batch_id: str | None = None) -> dict[str, BatchEta] | None:
        """The value when ``get`` would not compute it on the caller's thread (it may start
        the refresh thread); None when it would: the caller then calls ``get`` on a thread
        of its own (an event loop must not wait on ``estimate``)."""
        with self._lock:
            return self._current(batch_id)

    def get(self, session: Session, batch_id: str | None = None) -> dict[str, BatchEta]:
        with self._lock:
            found = self._current(batch_id)
            if found is None:
                self._store(estimate(session, worker_metrics_interval=self._interval))
                found = self._value
            return found

    def _current(self, batch_id: str | None) -> dict[str, BatchEta] | None:
        """Under the lock: the value if it will do (starting a refresh when it is old)."""
        age = self._clock() - self._at
        ttl = self._ttl
        if batch_id is not None:
            eta = self._value.get(batch_id)
            if eta is None or eta.provisional:
                ttl = self._soon
        if age < ttl:
            return self._value
        if self._refresh_session is None or age >= self._max_stale:
            return None
        if not self._refreshing:
            self._refreshing = True
            threading.Thread(target=self._refresh, name="eta-refresh", daemon=True).start()
        return self._value

    def _store(self, value: dict[str, BatchEta]) -> None:
        self._value, self._at = value, self._clock()

    def _refresh(self) -> None:
        assert self._refresh_session is not None
        try:
            with self._refresh_session() as session:
                value = estimate(session, worker_metrics_interval=self._interval)
            with self._lock:
                self._store(value)
        except Exception:  # the old value stays; a poll past max_stale computes it itself
            log.exception("refreshing the ETAs failed")
        finally:
            with self._lock:
                self._refreshing = False
