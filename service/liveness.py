"""When a worker counts as live: one rule, used by every reader of the ``workers`` table (the
API's /metrics and ETA, /v1/models' worker counts, ``boxcar status``) and by the heartbeat that
keeps a worker inside it (``metrics.publisher``).

A worker is live while its last heartbeat is younger than ``stale_after(interval)``: five
snapshot intervals, and never under 15 s (a heartbeat may be late by a slow database, a GC
pause, a long step), so one missed heartbeat never drops a worker.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from service.db import utcnow
from service.models import WorkerStatus

STALE_INTERVALS = 5
STALE_MIN_S = 15.0


def stale_after(interval: float) -> float:
    """Seconds without a heartbeat after which a worker publishing every ``interval`` s is
    gone."""
    return max(STALE_MIN_S, STALE_INTERVALS * interval)


def live_since(interval: float, *, now: dt.datetime | None = None) -> dt.datetime:
    """The oldest heartbeat of a live worker, ``now``."""
    return (now or utcnow()) - dt.timedelta(seconds=stale_after(interval))


def beat_since(since: Any) -> ColumnElement[bool]:
    """The SQL condition on ``WorkerStatus`` rows of workers that beat at ``since`` or later (a
    value from ``live_since``, or a bound parameter that will carry one)."""
    return WorkerStatus.heartbeat_at >= since


def is_live(interval: float, *, now: dt.datetime | None = None) -> ColumnElement[bool]:
    """The SQL condition on ``WorkerStatus`` rows of live workers."""
    return beat_since(live_since(interval, now=now))


def live_workers(session: Session, *, interval: float,
                 now: dt.datetime | None = None) -> list[WorkerStatus]:
    """Workers whose heartbeat is recent, oldest first."""
    return list(session.scalars(
        select(WorkerStatus).where(is_live(interval, now=now)).order_by(WorkerStatus.started_at)
    ).all())
