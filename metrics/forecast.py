"""A worker's forecast of when the lines it holds finish, per batch (``api.eta`` reads it).

The worker knows what the API cannot: which lines are in its engine, how many tokens each has
computed and generated, which wait in its line queue and in what order, and how long its own
steps take. So it forecasts, and publishes the result with its metrics snapshot (the heartbeat
path, no per-line database writes); the API adds only the lines no worker holds yet.

Three parts:

* ``StepCost``: the seconds one engine step costs (its time plus the gap to the next),
  ``fixed + per_decode * decodes + per_prefill * prefill tokens``, fitted by least squares over
  the last ``STEP_HISTORY`` steps, then scaled to the steps of the last ``RECENT_S`` seconds
  (other load on the machine slows every part of a step alike). A per-token throughput alone
  cannot see that a batch's tail runs at a few sequences a step, each step costing its fixed
  part.
* ``OutputLengths``: how many tokens a line that may stop early (no ``ignore_eos``) will
  generate, learned from the lines this worker finished: the mean of the finished lengths
  longer than what the line has already generated, capped at its ``max_tokens``. A line that
  ignores EOS generates exactly ``max_tokens``.
* ``forecast``: the engine's seats (``max_num_seqs``) handed out in engine order (running
  sequences keep theirs, then the engine's waiting queue, then the worker's line queue); a line
  holds its seat for the tokens it has left, one a step. A batch is done at the step its last
  line ends; its time is the cost of the steps up to then, each step's decodes counted by the
  seats busy in it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from metrics.cost import Cost

STEP_HISTORY = 2048
# The level is taken from the steps of the last RECENT_S seconds (at least MIN_RECENT_STEPS):
# on a shared machine the load moves within a batch's life, and the forecast should follow it
# within seconds, not a few dozen steps (which, at seconds a step, lag by minutes).
RECENT_S = 10.0
MIN_RECENT_STEPS = 4
PRIOR_STEPS = 1
# Finished lengths remembered per worker (sorted, for the conditional mean).
MAX_LENGTHS = 4096


@dataclass(frozen=True)
class LineProgress:
    """One line a worker holds, as the forecast sees it."""

    batch_id: str | None  # None: a single job (it takes a seat, no batch waits on it)
    running: bool  # holds an engine seat now
    prefill_tokens: float  # tokens to compute before its next output token
    output_tokens: int  # generated so far
    max_tokens: int
    ignore_eos: bool
    counts_line: bool = True  # False for the 2nd..nth sequence of an n > 1 line


class StepCost:
    """The fitted ``Cost`` of this worker's steps; thread-safe (the engine thread observes,
    the metrics thread fits).

    ``restore`` puts steps of an earlier run of the same engine (``metrics.step_history``) in
    front of this run's: they give the fit the shape of a step (how it grows with its decodes
    and prompt tokens) from the first forecast on, where a fresh worker has only the prior;
    the level (the machine's load now) comes from this run's steps as soon as there are
    ``MIN_RECENT_STEPS``."""

    def __init__(self, history: int = STEP_HISTORY, recent_s: float = RECENT_S) -> None:
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=history)
        # time.monotonic() at each step's end; -inf for a restored step (never recent)
        self._ends: deque[float] = deque(maxlen=history)
        self._recent_s = recent_s
        self._num_observed = 0

    def observe(self, seconds: float, *, num_decode: float, num_prefill: float,
                at: float | None = None) -> None:
        with self._lock:
            self._steps.append((num_decode, num_prefill, seconds))
            self._ends.append(time.monotonic() if at is None else at)
            self._num_observed += 1

    def restore(self, steps: Iterable[tuple[float, float, float]]) -> None:
        """Put ``(decodes, prefill tokens, seconds)`` of an earlier run before this run's
        steps (oldest first), as far as the history has room."""
        with self._lock:
            room = (self._steps.maxlen or 0) - len(self._steps)
            earlier = list(steps)[-room:] if room > 0 else []
            self._steps.extendleft(reversed(earlier))
            self._ends.extendleft([-np.inf] * len(earlier))

    def history(self, max_steps: int) -> list[tuple[float, float, float]]:
        """The last ``max_steps`` steps as ``(decodes, prefill tokens, seconds)``, oldest
        first (restored ones included): what ``restore`` takes."""
        with self._lock:
            return list(self._steps)[-max_steps:] if max_steps > 0 else []

    @property
    def num_observed(self) -> int:
        """Steps observed by this run (restored ones not counted)."""
        with self._lock:
            return self._num_observed

    def fit(self) -> Cost | None:
        """None until a step has been seen."""
        with self._lock:
            steps = np.array(self._steps, dtype=np.float64).reshape(-1, 3)
            ends = np.array(self._ends, dtype=np.float64)
        if not len(steps):
            return None
        decode, prefill, seconds = steps[:, 0], steps[:, 1], steps[:, 2]
        design = np.stack([np.ones_like(decode), decode, prefill], axis=1)
        # The prior: a decode costs what a prompt token does (one row through the same
        # matrices), worth PRIOR_STEPS steps of evidence at the largest decode count seen.
        # Without it, steps that all hold the same number of decodes (a job's, then a batch's
        # plateau) cannot tell the fixed part from the per-decode part, and the tail of a batch
        # is extrapolated from a guess.
        weight = np.sqrt(PRIOR_STEPS) * max(float(decode.max()), 1.0)
        prior = np.array([[0.0, weight, -weight]])
        coef = _non_negative_lstsq(np.vstack([design, prior]), np.append(seconds, 0.0))
        # Restored steps end at -inf: recent only while this run has none of its own.
        num_recent = max(int((ends >= ends[-1] - self._recent_s).sum()), MIN_RECENT_STEPS)
        recent = slice(-num_recent, None)
        predicted = float((design[recent] @ coef).sum())
        if predicted > 0:
            coef = coef * float(seconds[recent].sum()) / predicted
        return Cost(*(float(c) for c in coef))

    def __len__(self) -> int:
        with self._lock:
            return len(self._steps)


def _non_negative_lstsq(design: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares with each negative coefficient held at zero (a cost is never below zero;
    a negative one comes from noise in a narrow spread of step sizes). Columns are scaled to
    unit size so that a direction the steps do not vary in gets a least-norm share."""
    keep = np.ones(design.shape[1], dtype=bool)
    coef = np.zeros(design.shape[1])
    while keep.any():
        sub = design[:, keep]
        scale = np.maximum(np.abs(sub).max(axis=0), 1e-12)
        part = np.linalg.lstsq(sub / scale, seconds, rcond=None)[0] / scale
        if np.all(part >= 0):
            coef[keep] = part
            break
        keep[np.flatnonzero(keep)[np.argmin(part)]] = False
    return coef


class OutputLengths:
    """Output lengths of finished lines that could stop early; thread-safe."""

    def __init__(self, capacity: int = MAX_LENGTHS) -> None:
        self._lock = threading.Lock()
        self._order: deque[int] = deque()
        self._sorted: list[int] = []
        self._capacity = capacity

    def observe(self, num_tokens: int) -> None:
        with self._lock:
            self._order.append(num_tokens)
            bisect.insort(self._sorted, num_tokens)
            if len(self._order) > self._capacity:
                del self._sorted[bisect.bisect_left(self._sorted, self._order.popleft())]

    def expected_left(self, line: LineProgress) -> float:
        """Tokens ``line`` has left to generate (at least one: it has not finished)."""
        return self.table().expected_left(line)

    def table(self) -> LengthTable:
        """The lengths seen so far, fixed, to answer many lines' ``expected_left``."""
        with self._lock:
            return LengthTable(list(self._sorted))

    def __len__(self) -> int:
        with self._lock:
            return len(self._sorted)


class LengthTable:
    """Sorted output lengths and their running sums: a line's expected tokens left in
    O(log n), where summing its longer lengths one by one cost O(n) a line (a forecast over
    thousands of held lines against thousands of lengths was most of a busy worker's CPU)."""

    def __init__(self, ordered: list[int]) -> None:
        self._sorted = ordered
        self._sums = [0, *itertools.accumulate(ordered)]  # _sums[i]: the first i lengths

    def expected_left(self, line: LineProgress) -> float:
        """The mean of the finished lengths longer than the line's output so far, each capped
        at its ``max_tokens``, less its output so far; its whole budget left when no finished
        line ran longer (or it ignores EOS). At least one: it has not finished."""
        if line.ignore_eos:
            return max(line.max_tokens - line.output_tokens, 1)
        lengths, sums = self._sorted, self._sums
        first = bisect.bisect_right(lengths, line.output_tokens)  # the longer ones from here
        num_longer = len(lengths) - first
        if not num_longer:  # nothing seen yet, or it already outlived every finished line
            return max(line.max_tokens - line.output_tokens, 1)
        uncapped = max(bisect.bisect_right(lengths, line.max_tokens), first)  # <= max_tokens
        total = sums[uncapped] - sums[first] + line.max_tokens * (len(lengths) - uncapped)
        return max(total / num_longer - line.output_tokens, 1.0)


@dataclass(frozen=True)
class BatchForecast:
    num_lines: int
    seconds_left: float


def forecast(lines: Iterable[LineProgress], *, seats: int, cost: Cost,
             lengths: OutputLengths) -> tuple[dict[str, BatchForecast], float]:
    """Seconds until each batch's held lines are done, and until all held lines are (see the
    module docstring). ``lines`` in the order the engine will serve them."""
    free: list[float] = []  # the step at which each handed-out seat frees up
    batch_ids: list[str | None] = []
    starts: list[float] = []
    ends: list[float] = []
    prefill: list[float] = []
    held = list(lines)
    table = lengths.table()
    for line in held:
        start = heapq.heappop(free) if not line.running and len(free) >= seats else 0.0
        end = start + table.expected_left(line)
        heapq.heappush(free, end)
        batch_ids.append(line.batch_id)
        starts.append(start)
        ends.append(end)
        prefill.append(line.prefill_tokens)
    if not ends:
        return {}, 0.0
    start_a, end_a, prefill_a = np.array(starts), np.array(ends), np.array(prefill)

    def seconds_until(step: float) -> float:
        decodes = np.clip(np.minimum(end_a, step) - start_a, 0.0, None).sum()
        prefills = prefill_a[start_a < step].sum()
        return float(cost.fixed * step + cost.per_decode * decodes + cost.per_prefill * prefills)

    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line, batch_id, end in zip(held, batch_ids, ends, strict=True):
        if batch_id is not None:
            last[batch_id] = max(last.get(batch_id, 0.0), end)
            counts[batch_id] = counts.get(batch_id, 0) + int(line.counts_line)
    batches = {b: BatchForecast(counts[b], seconds_until(step)) for b, step in last.items()}
    return batches, seconds_until(float(end_a.max()))
