"""``RoundLoop``: the loop of a worker's background threads (leases, housekeeping, webhooks,
the metrics heartbeat), written once.

A loop runs rounds until ``stop`` is set. A round that fails is logged and the loop goes on (one
bad round must not kill the worker). Between rounds it sleeps ``interval`` seconds, or less when
``wake()`` is called; a round that returns True did work and the next one follows at once.

An idle loop (``is_idle()``: nothing held, nothing found) backs off: each idle round doubles the
sleep, up to ``idle_interval``, so an idle worker costs the database a few transactions a
minute instead of several a second; ``wake()`` (a broker message, new work) resets it at once.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class RoundLoop:
    round_name = "round"  # for the log line of a failed round

    def __init__(self, interval: float, *, idle_interval: float | None = None) -> None:
        self.interval = interval
        self.idle_interval = max(interval, idle_interval if idle_interval is not None
                                 else interval)
        self.sleep = interval  # the next sleep between rounds
        self.num_rounds = 0  # rounds run, failed ones too (a test waits for a fresh round)
        self._wake = threading.Event()
        self._stop = threading.Event()  # replaced by run()'s event

    def wake(self) -> None:
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run_round(self) -> bool:
        """One round; True when another should follow without sleeping."""
        raise NotImplementedError

    def is_idle(self) -> bool:
        """Whether the last round found nothing to do and holds nothing (it may back off)."""
        return False

    def run(self, stop: threading.Event) -> None:
        self._stop = stop
        while not stop.is_set():
            try:
                again = self.run_round()
            except Exception:
                log.exception("%s failed", self.round_name)
                again = False
            self.num_rounds += 1
            if not again:
                idle = self.is_idle()
                woken = self._wake.wait(self.sleep if idle else self.interval)
                self._wake.clear()
                self.sleep = (min(self.sleep * 2, self.idle_interval) if idle and not woken
                              else self.interval)
