"""Batch stages that one worker does at a time under a lease on the batch row: prepare
(validating -> in_progress, resumed where an earlier one stopped) and finalize (-> completed /
cancelled / expired). Batches come from broker messages, from the writer (a batch's shard just
finished) and from polling. Every scan also deletes expired files, ``service.expiry.DELETE_STEP``
at a time.

A stage that fails (object storage or the database is down) is retried by this worker with
exponential backoff, ``RETRY_FIRST_SECONDS`` doubling up to ``RETRY_MAX_SECONDS``, so it runs
again within seconds of the outage ending, and one failing batch never holds up the others.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import select

from service.db import Database, utcnow
from service.expiry import delete_expired
from service.loop import RoundLoop
from service.models import Batch
from service.served_models import configured_adapters, model_id, setting_aliases
from service.settings import Settings
from service.storage import ObjectStorage
from worker.finalize import finalizable_batches, finalize_batch
from worker.prepare import prepare_batch, to_prepare

log = logging.getLogger(__name__)

RETRY_FIRST_SECONDS = 1.0
RETRY_MAX_SECONDS = 8.0

T = TypeVar("T")


class Housekeeper(RoundLoop):
    round_name = "housekeeping round"

    def __init__(
        self,
        db: Database,
        storage: ObjectStorage,
        settings: Settings,
        *,
        worker_id: str,
        on_prepared: Callable[[list[str]], None],
        on_finalized: Callable[[], None],
        clock: Callable[[], dt.datetime] = utcnow,
    ) -> None:
        super().__init__(settings.poll_interval, idle_interval=settings.idle_poll_interval)
        self.db = db
        self.storage = storage
        self.settings = settings
        self.worker_id = worker_id
        self._on_prepared = on_prepared
        self._on_finalized = on_finalized
        self.clock = clock  # what "now" is for file expiry (tests move it)
        # What it prepares batches for (worker.prepare.to_prepare): every base model it knows
        # of, by all its names, and its own adapters, never another model's adapter.
        self.adapters = configured_adapters(settings)
        self.models = {model_id(settings.model, settings.served_model_name),
                       *setting_aliases(settings.model, settings.served_model_name),
                       *self.adapters}
        for model in settings.models:
            self.models |= {model_id(model), *setting_aliases(model)}
        self._candidates: set[str] = set()
        self._lock = threading.Lock()
        self._last_scan = 0.0
        self._busy: set[str] = set()  # batches a thread of this worker is working on now
        # (stage, batch) -> (failures in a row, monotonic time of the next try)
        self._backoff: dict[tuple[str, str], tuple[int, float]] = {}
        self._idle = False

    def batches_touched(self, batch_ids: set[str]) -> None:
        """These batches may be ready to finalize (a shard finished, a batch stopped)."""
        with self._lock:
            self._candidates |= batch_ids
        self._wake.set()

    def _attempt(self, stage: str, batch_id: str, run: Callable[[], T]) -> T | None:
        """Run one stage of ``batch_id`` unless another thread is on it or it is backing off;
        a failure schedules the retry (None is returned)."""
        with self._lock:
            failures, due = self._backoff.get((stage, batch_id), (0, 0.0))
            if batch_id in self._busy or time.monotonic() < due:
                return None
            self._busy.add(batch_id)
        try:
            result = run()
        except Exception as exc:
            failures += 1
            delay = min(RETRY_FIRST_SECONDS * 2 ** (failures - 1), RETRY_MAX_SECONDS)
            log.warning("%s of %s failed (%d in a row: %s: %s); retrying in %.0fs", stage,
                        batch_id, failures, type(exc).__name__, exc, delay)
            with self._lock:
                self._backoff[(stage, batch_id)] = (failures, time.monotonic() + delay)
                if stage == "finalize":  # a prepare is found again by its status
                    self._candidates.add(batch_id)
            return None
        finally:
            with self._lock:
                self._busy.discard(batch_id)
        with self._lock:
            self._backoff.pop((stage, batch_id), None)
        return result

    def _backing_off(self, stage: str, batch_id: str) -> bool:
        with self._lock:
            return time.monotonic() < self._backoff.get((stage, batch_id), (0, 0.0))[1]

    def prepare(self, batch_id: str) -> list[str] | None:
        """Prepare (or resume preparing) ``batch_id``; each chunk's shards are announced as it
        commits (``on_prepared``)."""
        shard_ids = self._attempt("prepare", batch_id, lambda: prepare_batch(
            self.db, self.storage, batch_id, worker_id=self.worker_id,
            shard_size=self.settings.shard_size, mixed_endpoints=self.settings.mixed_endpoints,
            adapters=self.adapters, models=self.models,
            max_embedding_inputs=self.settings.max_batch_embedding_inputs,
            on_shards=self._on_prepared))
        if shard_ids is not None:
            if not shard_ids:  # failed at prepare (final, its event is queued), or no new shard
                self._on_finalized()
            # Its shards may all be done already (their last writer found prepare unfinished):
            # finalize looks at it now rather than at the next scan.
            with self._lock:
                self._candidates.add(batch_id)
        return shard_ids

    def finalize(self, batch_id: str) -> str | None:
        outcome = self._attempt("finalize", batch_id, lambda: finalize_batch(
            self.db, self.storage, batch_id, worker_id=self.worker_id))
        if outcome is not None:
            self._on_finalized()
        return outcome

    def run_once(self, *, scan: bool) -> None:
        now = utcnow()
        with self.db.read_session() as session:
            waiting = session.scalars(
                select(Batch.id).where(
                    to_prepare(self.models),
                    Batch.lease_expires_at.is_(None) | (Batch.lease_expires_at < now)
                    | (Batch.lease_owner == self.worker_id))
                .order_by(Batch.pk).limit(5)
            ).all()
            found = set(finalizable_batches(session)) if scan else set()
        for batch_id in waiting:
            if not self._backing_off("prepare", batch_id):
                self.prepare(batch_id)
        with self._lock:
            candidates, self._candidates = self._candidates | found, set()
        self._idle = not waiting and not candidates
        for batch_id in sorted(candidates):
            if self._backing_off("finalize", batch_id):
                with self._lock:
                    self._candidates.add(batch_id)  # not yet: keep it for a later round
                continue
            self.finalize(batch_id)
        if scan:
            self.expire_files()

    def expire_files(self) -> int:
        """One bounded step of deleting expired files; a failure (storage down) is logged and
        the next scan tries again."""
        try:
            return delete_expired(self.db, self.storage, now=self.clock())
        except Exception as exc:
            log.warning("deleting expired files failed (%s: %s); the next scan retries",
                        type(exc).__name__, exc)
            return 0

    def is_idle(self) -> bool:
        with self._lock:
            return self._idle and not self._candidates and not self._backoff

    def run_round(self) -> bool:
        scan = time.monotonic() - self._last_scan >= self.settings.finalize_scan_interval
        if scan:
            self._last_scan = time.monotonic()
        self.run_once(scan=scan)
        return False
