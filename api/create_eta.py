"""A batch's estimate at create: ``estimated_completion_at`` in the create response, and what
happens when it passes the end of the completion window.

The batch has no lines yet (prepare makes them moments later), so its file stands for them: its
valid lines, its enqueued tokens (``service.lines.enqueued_tokens``, counted at upload), split
into prompt and output tokens a line as the first ``SAMPLE_LINES`` lines split them
(``service.lines.estimate_tokens``, read back from storage). Those per-line figures are the
batch's estimates until prepare sets its own, and ``api.eta`` runs the one estimate every poll
gets: the queue ahead of it in the engine order (``service.queue_order``), the workers' measured
step costs (their published forecasts), and the batch's own work. Null when no worker of its
model has stepped recently.

An estimate past ``expires_at`` gets a ``completion_window_at_risk`` warning in the create
response (``boxcar_warnings``) and one ``batch.at_risk`` webhook event; with
``BOXCAR_REFUSE_AT_RISK`` the batch fails its validation instead, ``completion_window_infeasible``
naming the estimate (as a batch over its token quota does: created, failed).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from api.eta import BatchEta, forecast, live_batch, live_batches
from openai_format.parse import BatchLine, parse_line
from service.counters import CounterDelta
from service.lines import estimate_tokens
from service.liveness import live_workers
from service.models import Batch, File
from service.storage import ObjectStorage, iter_lines

SAMPLE_LINES = 200
COMPLETION_WINDOW_AT_RISK = "completion_window_at_risk"
COMPLETION_WINDOW_INFEASIBLE = "completion_window_infeasible"


def line_estimates(storage: ObjectStorage, file: File) -> tuple[float, float]:
    """(prompt, output) tokens a valid line of ``file``: its enqueued tokens a line, split as
    its first ``SAMPLE_LINES`` valid lines split theirs."""
    num_valid = max(file.num_lines - file.num_errors, 1)
    prompt = output = 0
    sampled = 0
    for line_no, raw in enumerate(iter_lines(storage, file.storage_key), start=1):
        parsed = parse_line(raw, line_no=line_no)
        if isinstance(parsed, BatchLine):
            p, o = estimate_tokens(parsed)
            prompt, output, sampled = prompt + p, output + o, sampled + 1
            if sampled >= SAMPLE_LINES:
                break
    per_line = file.enqueued_tokens / num_valid
    if prompt + output <= 0:
        return per_line, 0.0
    share = prompt / (prompt + output)
    return per_line * share, per_line * (1.0 - share)


def create_estimate(session: Session, row: Batch, *, worker_metrics_interval: float,
                    now: float | None = None) -> BatchEta:
    """The estimate of ``row``, a batch being created (not yet in the session's view): the
    live batches and the live workers as every estimate reads them, with it among them."""
    now = time.time() if now is None else now
    live = [b for b in live_batches(session) if b.id != row.id]
    new = live_batch(row, CounterDelta())
    workers = live_workers(session, interval=worker_metrics_interval)
    return forecast([*live, new], [(w.model, w.metrics) for w in workers], now=now)[row.id]


@dataclass(frozen=True)
class AtRisk:
    """A batch's estimate at create passes its deadline."""

    estimated_completion_at: float
    deadline: float

    def message(self) -> str:
        def when(seconds: float) -> str:
            return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="seconds")

        late = self.estimated_completion_at - self.deadline
        return (f"The batch's estimated completion, {when(self.estimated_completion_at)}, is "
                f"{late:.0f} s past the end of its completion window, "
                f"{when(self.deadline)}, with the work queued ahead of it and the workers' "
                "pace: lines left open then expire. Use a longer completion_window, a higher "
                "priority, or fewer lines.")

    def warning(self) -> dict[str, Any]:
        return {"code": COMPLETION_WINDOW_AT_RISK, "message": self.message()}

    def error(self) -> dict[str, Any]:
        return {"code": COMPLETION_WINDOW_INFEASIBLE, "message": self.message(),
                "param": "completion_window", "line": None}


def at_risk(eta: BatchEta) -> AtRisk | None:
    if not eta.late or eta.estimated_completion_at is None or eta.deadline is None:
        return None
    return AtRisk(eta.estimated_completion_at, eta.deadline)
