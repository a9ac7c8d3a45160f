"""A worker's heartbeat: its engine metrics snapshot written to the database every few seconds.

Why the database: it is the one thing every process of every mode shares (SQLite embedded,
PostgreSQL in production), so the API aggregates all workers' engines for /metrics and the
dashboard without knowing where workers run, and ``boxcar status`` lists them. A row whose
heartbeat is older than ``service.liveness.stale_after`` is a dead worker: readers skip it, the
next worker to start deletes it. While nothing changes (an idle engine), the heartbeat backs off
from ``interval`` to a third of that staleness limit, so an idle worker stays listed at a
fraction of the writes.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import delete, func, select, update

from metrics.recorder import EngineRecorder
from metrics.step_history import StepHistoryStore
from service import served_models
from service.db import Database, utcnow
from service.liveness import stale_after
from service.loop import RoundLoop
from service.models import WorkerStatus

log = logging.getLogger(__name__)

# Rows of workers silent this long are deleted when another worker starts (SIGKILLed workers
# never delete their own).
PRUNE_AFTER = dt.timedelta(hours=1)


class MetricsPublisher(RoundLoop):
    round_name = "metrics heartbeat"

    def __init__(self, db: Database, recorder: EngineRecorder, *, worker_id: str,
                 model: str | None, interval: float,
                 forecast: Callable[[], dict[str, Any] | None] | None = None,
                 history: StepHistoryStore | None = None) -> None:
        super().__init__(interval, idle_interval=stale_after(interval) / 3)
        self.db = db
        self.recorder = recorder
        self.worker_id = worker_id
        self.model = model
        self._forecast = forecast  # the held lines' forecast (worker.forecaster), or none
        self.history = history  # the step history kept across restarts, saved every so often
        self._started_at = utcnow()
        self._last_counters: dict | None = None
        self._unchanged = False

    def run(self, stop: threading.Event) -> None:
        self._prune()
        super().run(stop)

    def run_round(self) -> bool:
        self.publish()
        return False

    def is_idle(self) -> bool:
        """The last snapshot's counters were those of the one before: nothing ran."""
        return self._unchanged

    def publish(self) -> None:
        self.recorder.tick()
        snapshot = self.recorder.snapshot()
        self._unchanged = snapshot.get("counters") == self._last_counters
        self._last_counters = snapshot.get("counters")
        if self._forecast is not None:
            try:
                snapshot["forecast"] = self._forecast()
            except Exception:  # the heartbeat must go out whatever the forecast does
                log.exception("could not forecast the held lines")
        # One UPDATE (the row exists after the first beat); an INSERT only when it does not.
        with self.db.session() as session:
            now = utcnow()
            found = session.execute(
                update(WorkerStatus).where(WorkerStatus.id == self.worker_id)
                .values(heartbeat_at=now, metrics=snapshot)
                .execution_options(synchronize_session=False)
            ).rowcount
            if not found:
                session.add(WorkerStatus(id=self.worker_id, model=self.model,
                                         started_at=self._started_at, heartbeat_at=now,
                                         metrics=snapshot))
        if self.history is not None:
            self.history.maybe_save()  # after the beat: a slow storage never delays it

    def remove(self) -> None:
        """A clean stop: the worker leaves the list at once, and its model's row records that
        it was seen until now (its heartbeat said so until this delete)."""
        try:
            with self.db.session() as session:
                session.execute(delete(WorkerStatus).where(WorkerStatus.id == self.worker_id))
                if self.model is not None:
                    served_models.worker_stopped(session, model=self.model)
        except Exception:
            log.exception("could not remove worker %s from the workers table", self.worker_id)

    def _prune(self) -> None:
        try:
            with self.db.session() as session:
                old = WorkerStatus.heartbeat_at < utcnow() - PRUNE_AFTER
                # Their heartbeats go: their models' rows keep when they were last seen.
                for model, last in session.execute(
                        select(WorkerStatus.model, func.max(WorkerStatus.heartbeat_at))
                        .where(old, WorkerStatus.model.is_not(None))
                        .group_by(WorkerStatus.model)).all():
                    served_models.worker_stopped(session, model=model, now=last)
                session.execute(delete(WorkerStatus).where(old))
        except Exception:
            log.exception("could not prune old worker rows")
