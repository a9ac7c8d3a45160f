"""When a live batch will be done: ``estimated_completion_at``, and whether that passes its
deadline.

The unit of work is a token the engine computes: a prompt token not served from the prefix cache,
or an output token. A batch's work left is its unfinished lines times the tokens per line: prompt
tokens times (1 - its prefix cache hit rate) plus output tokens. Per line, the batch's own
finished lines teach the figures once ``MIN_LEARNED_LINES`` are done; before that prepare's
estimates stand in (prompt characters / 4, ``max_tokens`` or ``DEFAULT_OUTPUT_TOKENS``;
``service.lines.estimate_tokens``). Live throughput is what the workers serving the model
computed over the last ``RATE_WINDOW_S`` seconds of their published timelines (prompt plus
generated tokens per second, over the seconds they were stepping). Work ahead follows the queue
order (``service.queue_order``): batches of a more urgent class run first, batches of the same
class share the workers with this one (each counts up to this batch's own work left), and less
urgent ones wait. So::

    eta = now + (ahead + shared + own) / throughput

Null while unknown: a batch still validating (no lines yet) or no worker has stepped recently.
One GROUP BY over the live batches' lines, cached ``CACHE_S`` seconds per process, serves
every poll: the cost does not grow with the number of pollers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from metrics.api_collector import live_workers
from service.models import FINALIZING, IN_PROGRESS, LINE_COMPLETED, LINE_OPEN, Batch, RequestLine
from service.queue_order import bulk_rank

MIN_LEARNED_LINES = 3
RATE_WINDOW_S = 30.0
CACHE_S = 2.0


@dataclass(frozen=True)
class BatchEta:
    estimated_completion_at: float | None
    deadline: float | None
    work_left: float  # tokens

    @property
    def late(self) -> bool:
        """The estimate passes the deadline."""
        return (self.estimated_completion_at is not None and self.deadline is not None
                and self.estimated_completion_at > self.deadline)


@dataclass(frozen=True)
class _Live:
    id: str
    model: str | None
    status: str
    rank: tuple[int, int]
    deadline: float | None
    work_left: float


def work_left(*, remaining: int, completed: int, input_tokens: int, output_tokens: int,
              cached_tokens: int, est_prompt: float, est_output: float) -> float:
    """Tokens left to compute for ``remaining`` unfinished lines (see the module docstring)."""
    if completed >= MIN_LEARNED_LINES:
        prompt = input_tokens / completed
        output = output_tokens / completed
        hit = cached_tokens / input_tokens if input_tokens else 0.0
    else:
        prompt, output, hit = est_prompt, est_output, 0.0
    return remaining * (prompt * (1.0 - hit) + output)


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


def _live_batches(session: Session) -> list[_Live]:
    batches = session.scalars(
        select(Batch).where(Batch.status.in_((IN_PROGRESS, FINALIZING)))).all()
    if not batches:
        return []
    done = case((RequestLine.status == LINE_COMPLETED, 1), else_=0)
    open_ = case((RequestLine.status.in_(LINE_OPEN), 1), else_=0)
    rows = {r[0]: r for r in session.execute(
        select(RequestLine.batch_id, func.coalesce(func.sum(open_), 0),
               func.coalesce(func.sum(done), 0),
               func.coalesce(func.sum(RequestLine.prompt_tokens), 0),
               func.coalesce(func.sum(RequestLine.completion_tokens), 0),
               func.coalesce(func.sum(RequestLine.cached_tokens), 0))
        .where(RequestLine.batch_id.in_([b.id for b in batches]))
        .group_by(RequestLine.batch_id)
    ).all()}
    live = []
    for b in batches:
        _, remaining, completed, inp, out, cached = rows.get(b.id, (b.id, 0, 0, 0, 0, 0))
        deadline = b.expires_at.timestamp() if b.expires_at else None
        live.append(_Live(b.id, b.model, b.status, bulk_rank(deadline, b.priority), deadline,
                          work_left(remaining=int(remaining), completed=int(completed),
                                    input_tokens=int(inp), output_tokens=int(out),
                                    cached_tokens=int(cached),
                                    est_prompt=b.est_prompt_tokens_per_line,
                                    est_output=b.est_output_tokens_per_line)))
    return live


def estimate(session: Session, *, worker_metrics_interval: float,
             now: float | None = None) -> dict[str, BatchEta]:
    """The estimate of every in-progress or finalizing batch, by id."""
    now = time.time() if now is None else now
    live = _live_batches(session)
    if not live:
        return {}
    workers = live_workers(session, interval=worker_metrics_interval)
    result: dict[str, BatchEta] = {}
    for b in live:
        if b.status == FINALIZING:
            result[b.id] = BatchEta(now, b.deadline, 0.0)
            continue
        serving = [w.metrics or {} for w in workers if w.model == b.model] or [
            w.metrics or {} for w in workers]
        rate = throughput(serving, now=now)
        if rate is None:
            result[b.id] = BatchEta(None, b.deadline, b.work_left)
            continue
        same_model = [o for o in live if o.id != b.id and o.model == b.model
                      and o.status == IN_PROGRESS]
        ahead = sum(o.work_left for o in same_model if o.rank < b.rank)
        shared = sum(min(o.work_left, b.work_left) for o in same_model if o.rank == b.rank)
        result[b.id] = BatchEta(now + (ahead + shared + b.work_left) / rate, b.deadline,
                                b.work_left)
    return result


class EtaCache:
    """``estimate`` at most once per ``CACHE_S`` seconds; every poll in between reads it."""

    def __init__(self, worker_metrics_interval: float, ttl: float = CACHE_S) -> None:
        self._interval = worker_metrics_interval
        self._ttl = ttl
        self._lock = threading.Lock()
        self._at = -1e18
        self._value: dict[str, BatchEta] = {}

    def get(self, session: Session) -> dict[str, BatchEta]:
        with self._lock:
            if time.monotonic() - self._at >= self._ttl:
                self._value = estimate(session, worker_metrics_interval=self._interval)
                self._at = time.monotonic()
            return self._value
