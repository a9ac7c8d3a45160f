"""``RoundLoop``: the loop of a worker's background threads (leases, housekeeping, webhooks,
the metrics heartbeat), written once.

A loop runs rounds until ``stop`` is set. A round that fails is logged and the loop goes on (one
bad round must not kill the worker). Between rounds it sleeps ``interval`` seconds, or less when
``wake()`` is called; a round that returns True did work and the next one follows at once.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class RoundLoop:
    round_name = "round"  # for the log line of a failed round

    def __init__(self, interval: float) -> None:
        self.interval = interval
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

    def run(self, stop: threading.Event) -> None:
        self._stop = stop
        while not stop.is_set():
            try:
                again = self.run_round()
            except Exception:
                log.exception("%s failed", self.round_name)
                again = False
            if not again:
                self._wake.wait(self.interval)
                self._wake.clear()
