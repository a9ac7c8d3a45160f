"""What this worker publishes about the lines it holds: per batch, how many and when they will be
done (``metrics.forecast``), for the API's ``estimated_completion_at`` (``api.eta``).

``gather`` runs on the engine thread after a step, at most every ``interval`` seconds, and before
the first step of an idle engine's new lines (a prefill of seconds, during which the forecast would
otherwise still show the engine empty): it reads the engine's sequences (only that thread may) and
the line queue into plain ``LineProgress`` values. ``snapshot`` runs on the metrics thread when the
heartbeat publishes: it fits the step cost and runs the forecast there, off the engine's path, and
keeps the batches whose held lines it sees finishing after their deadline (``at_risk``: the drain
loop gives their next lines a more urgent engine priority, ``service.queue_order``).
"""

from __future__ import annotations

import time
from typing import Any

from metrics.forecast import LineProgress, StepCost, forecast
from openai_format.engine_fields import ignores_eos, max_output_tokens
from worker.drain import Drainer
from worker.items import LineWork


class Forecaster:
    def __init__(self, drainer: Drainer, step_cost: StepCost, *, seats: int,
                 max_model_len: int, interval: float = 0.5) -> None:
        self.drainer = drainer
        self.step_cost = step_cost
        self.seats = seats
        self.max_model_len = max_model_len
        self.interval = interval
        self._gathered_at = -1e18
        self._lines: tuple[float, list[LineProgress]] | None = None
        self._deadlines: dict[str, float] = {}  # batch id -> its expires_at, of held lines
        self._at_risk: frozenset[str] = frozenset()

    # -- the engine thread --------------------------------------------------------------------

    def gather(self, *, force: bool = False) -> None:
        """Read the held lines' progress, if ``interval`` has passed since the last read (or
        ``force``: lines just entered an idle engine)."""
        now = time.monotonic()
        if not force and now - self._gathered_at < self.interval:
            return
        self._gathered_at = now
        drainer = self.drainer
        in_engine = drainer.in_engine
        queued = drainer.queue.ordered()
        self._deadlines = {w.batch_id: w.deadline for w in (*in_engine.values(), *queued)
                           if w.batch_id is not None and w.deadline is not None}
        lines = []
        seen: set[str] = set()
        for seq in drainer.engine.progress():
            work = in_engine.get(seq.request_id)
            first = seq.request_id not in seen
            seen.add(seq.request_id)
            lines.append(LineProgress(
                batch_id=work.batch_id if work is not None else None, running=seq.running,
                prefill_tokens=max(seq.num_tokens - seq.num_computed_tokens - 1, 0),
                output_tokens=seq.num_output_tokens, max_tokens=seq.max_tokens,
                ignore_eos=seq.ignore_eos, counts_line=first))
        prompt = drainer.avg_prompt_tokens
        lines.extend(self._queued(work, prompt) for work in queued)
        self._lines = (time.time(), lines)  # one reference swap: the metrics thread reads it

    def _queued(self, work: LineWork, prompt: float) -> LineProgress:
        """A line not yet in the engine: its output budget as the engine will get it, from its
        engine fields (a row from before them counts as one without a max_tokens)."""
        fields = work.engine_fields
        max_tokens = None if fields is None else max_output_tokens(fields)
        room = max(int(self.max_model_len - prompt), 1)  # the engine's cap: the context
        return LineProgress(batch_id=work.batch_id, running=False, prefill_tokens=prompt,
                            output_tokens=0,
                            max_tokens=room if max_tokens is None else min(max_tokens, room),
                            ignore_eos=fields is not None and ignores_eos(fields))

    def at_risk(self, batch_id: str) -> bool:
        """Whether the last forecast saw ``batch_id``'s held lines end after its deadline."""
        return batch_id in self._at_risk

    # -- the metrics thread -------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any] | None:
        """``{"at", "seats", "seconds_left", "cost", "batches": {id: {"lines",
        "seconds_left"}}}``: the forecast as of ``at`` (unix seconds); None before the first
        step."""
        gathered = self._lines
        cost = self.step_cost.fit()
        if gathered is None or cost is None:
            return None
        at, lines = gathered
        batches, seconds_left = forecast(lines, seats=self.seats, cost=cost,
                                         lengths=self.drainer.output_lengths)
        deadlines = self._deadlines
        self._at_risk = frozenset(b for b, f in batches.items()
                                  if b in deadlines and at + f.seconds_left > deadlines[b])
        return {"at": at, "seats": self.seats, "seconds_left": round(seconds_left, 3),
                "cost": {"fixed": cost.fixed, "per_decode": cost.per_decode,
                         "per_prefill": cost.per_prefill},
                "batches": {b: {"lines": f.num_lines, "seconds_left": round(f.seconds_left, 3)}
                            for b, f in batches.items()}}
