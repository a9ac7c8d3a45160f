"""Batch stages that one worker does at a time under a lease on the batch row: prepare
(validating -> in_progress) and finalize (-> completed / cancelled / expired). Batches come from
broker messages, from the writer (a batch's shard just finished) and from polling."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import select

from api.db import Database, utcnow
from api.models import VALIDATING, Batch
from api.settings import Settings
from api.storage import ObjectStorage
from worker.finalize import finalizable_batches, finalize_batch
from worker.prepare import prepare_batch

log = logging.getLogger(__name__)


class Housekeeper:
    def __init__(
        self,
        db: Database,
        storage: ObjectStorage,
        settings: Settings,
        *,
        worker_id: str,
        on_prepared: Callable[[list[str]], None],
        on_finalized: Callable[[], None],
    ) -> None:
        self.db = db
        self.storage = storage
        self.settings = settings
        self.worker_id = worker_id
        self._on_prepared = on_prepared
        self._on_finalized = on_finalized
        self._candidates: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def wake(self) -> None:
        self._wake.set()

    def batches_touched(self, batch_ids: set[str]) -> None:
        """These batches may be ready to finalize (a shard finished, a batch stopped)."""
        with self._lock:
            self._candidates |= batch_ids
        self._wake.set()

    def prepare(self, batch_id: str) -> list[str] | None:
        shard_ids = prepare_batch(self.db, self.storage, batch_id, worker_id=self.worker_id,
                                  shard_size=self.settings.shard_size,
                                  mixed_endpoints=self.settings.mixed_endpoints)
        if shard_ids:
            self._on_prepared(shard_ids)
        return shard_ids

    def finalize(self, batch_id: str) -> str | None:
        outcome = finalize_batch(self.db, self.storage, batch_id, worker_id=self.worker_id)
        if outcome is not None:
            self._on_finalized()
        return outcome

    def run_once(self, *, scan: bool) -> None:
        now = utcnow()
        with self.db.read_session() as session:
            waiting = session.scalars(
                select(Batch.id).where(
                    Batch.status == VALIDATING,
                    Batch.lease_expires_at.is_(None) | (Batch.lease_expires_at < now))
                .order_by(Batch.pk).limit(5)
            ).all()
            found = set(finalizable_batches(session)) if scan else set()
        for batch_id in waiting:
            self.prepare(batch_id)
        with self._lock:
            candidates, self._candidates = self._candidates | found, set()
        for batch_id in sorted(candidates):
            self.finalize(batch_id)

    def run(self, stop: threading.Event) -> None:
        last_scan = 0.0
        while not stop.is_set():
            try:
                scan = time.monotonic() - last_scan >= self.settings.finalize_scan_interval
                if scan:
                    last_scan = time.monotonic()
                self.run_once(scan=scan)
            except Exception:
                log.exception("housekeeping round failed")
            self._wake.wait(self.settings.poll_interval)
            self._wake.clear()
