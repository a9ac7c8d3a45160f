"""A worker's step history kept across restarts, so that its forecast (``metrics.forecast``)
starts from what its own engine's steps cost, not from the fit's prior.

A fresh worker knows nothing of its steps: until its engine has run steps of many sizes, the
fit cannot tell the fixed part of a step from its per-decode part and falls back on a prior (a
decode costs what a prompt token does), which on a CPU is off by about two. A short batch's
estimate is made in those first seconds. So the worker saves the last ``SAVED_STEPS`` steps
(decodes, prompt tokens, seconds) to the object storage every ``SAVE_S`` seconds while it
steps, and once more when it stops; the next worker of the same engine on the same host loads
them at start (``StepCost.restore``). The key is a digest of the host, the model and the whole
engine configuration (threads, dtype, device, batch limits): another engine's steps cost
something else. Object storage rather than the heartbeat row: a worker that stops cleanly
deletes its row, and the storage outlives every worker in every mode (a folder embedded, S3 in
production).
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from metrics.forecast import StepCost
from service.storage import ObjectStorage, get_bytes, put_bytes

log = logging.getLogger(__name__)

SAVED_STEPS = 512
SAVE_S = 60.0
FORMAT_VERSION = 1


def history_key(*, model_name: str, engine_config: dict[str, Any],
                host: str | None = None) -> str:
    """The storage key of one engine's history: ``workers/step-history/<digest>.json``."""
    identity = json.dumps({"host": socket.gethostname() if host is None else host,
                           "model": model_name, "config": engine_config},
                          sort_keys=True, default=str)
    return f"workers/step-history/{hashlib.sha256(identity.encode()).hexdigest()[:24]}.json"


def parse_history(data: bytes) -> list[tuple[float, float, float]] | None:
    """The steps of a saved history, or None for one this version cannot read."""
    try:
        doc = json.loads(data)
        if doc.get("version") != FORMAT_VERSION:
            return None
        steps = [(float(d), float(p), float(s)) for d, p, s in doc["steps"]]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if any(min(step) < 0 for step in steps):
        return None
    return steps


class StepHistoryStore:
    """Loads and saves one ``StepCost``'s steps under ``key``; storage errors are logged, never
    raised (a forecast from the prior is worse, not broken)."""

    def __init__(self, storage: ObjectStorage, key: str, step_cost: StepCost, *,
                 save_s: float = SAVE_S, max_steps: int = SAVED_STEPS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.storage = storage
        self.key = key
        self.step_cost = step_cost
        self.save_s = save_s
        self.max_steps = max_steps
        self._clock = clock
        self._saved_at = clock()
        self._saved_observed = 0  # what this run observes is unsaved until saved

    def load(self) -> int:
        """Restore the saved steps into the step cost; how many there were."""
        try:
            if not self.storage.exists(self.key):
                return 0
            steps = parse_history(get_bytes(self.storage, self.key))
        except Exception:
            log.exception("could not read the step history %s", self.key)
            return 0
        if steps is None:
            log.warning("ignoring the step history %s: not a format this version reads", self.key)
            return 0
        self.step_cost.restore(steps)
        return len(steps)

    def maybe_save(self) -> bool:
        """Save if ``save_s`` has passed since the last save and steps were run since."""
        if self._clock() - self._saved_at < self.save_s:
            return False
        return self.save()

    def save(self) -> bool:
        """Save now, if this run observed steps since the last save; whether it saved."""
        observed = self.step_cost.num_observed
        self._saved_at = self._clock()
        if observed == self._saved_observed:
            return False
        steps = self.step_cost.history(self.max_steps)
        doc = {"version": FORMAT_VERSION,
               "steps": [[d, p, round(s, 6)] for d, p, s in steps]}
        try:
            put_bytes(self.storage, self.key, json.dumps(doc, separators=(",", ":")).encode())
        except Exception:
            log.exception("could not save the step history %s", self.key)
            return False
        self._saved_observed = observed
        return True
