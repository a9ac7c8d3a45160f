"""The lines a worker holds that have not entered its engine yet.

The order is ``service.queue_order``'s: single jobs leave first (higher priority first, then
arrival); bulk lines leave by class, (deadline bucket, batch priority), the most urgent class
first; within a class they leave round-robin across tenants, so one tenant's huge batch does not
starve another's small one; each tenant's lines leave in shard order, which is prefix order, so
requests sharing a prompt prefix enter the engine together and its prefix cache hits.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Callable

from service.queue_order import bulk_rank
from worker.items import LineWork

_Tenants = OrderedDict[str, deque[LineWork]]


class LineQueue:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[tuple[int, int, LineWork]] = []  # (-priority, seq, work)
        # class (deadline bucket, -priority) -> tenants in round-robin order -> their lines
        self._classes: dict[tuple[int, int], _Tenants] = {}
        self._seq = itertools.count()
        self._num_bulk = 0

    def push(self, lines: list[LineWork], *, is_job: bool) -> None:
        with self._lock:
            for work in lines:
                if is_job:
                    heapq.heappush(self._jobs, (-work.priority, next(self._seq), work))
                else:
                    tenants = self._classes.setdefault(
                        bulk_rank(work.deadline, work.priority), OrderedDict())
                    tenants.setdefault(work.tenant_id, deque()).append(work)
                    self._num_bulk += 1

    def pop(self) -> LineWork | None:
        with self._lock:
            if self._jobs:
                return heapq.heappop(self._jobs)[2]
            if not self._classes:
                return None
            rank = min(self._classes)  # a handful of classes: deadlines x priorities held
            tenants = self._classes[rank]
            tenant, lines = next(iter(tenants.items()))
            work = lines.popleft()
            self._num_bulk -= 1
            # The tenant goes to the back of the line (or leaves it when it has nothing left).
            del tenants[tenant]
            if lines:
                tenants[tenant] = lines
            elif not tenants:
                del self._classes[rank]
            return work

    def remove(self, predicate: Callable[[LineWork], bool]) -> list[LineWork]:
        """Take out every queued line that matches (a cancelled batch, a lost shard)."""
        removed: list[LineWork] = []
        with self._lock:
            kept_jobs = []
            for entry in self._jobs:
                if predicate(entry[2]):
                    removed.append(entry[2])
                else:
                    kept_jobs.append(entry)
            heapq.heapify(kept_jobs)
            self._jobs = kept_jobs
            for rank in list(self._classes):
                tenants = self._classes[rank]
                for tenant in list(tenants):
                    lines = tenants[tenant]
                    keep = deque(w for w in lines if not predicate(w))
                    removed.extend(w for w in lines if predicate(w))
                    self._num_bulk -= len(lines) - len(keep)
                    if keep:
                        tenants[tenant] = keep
                    else:
                        del tenants[tenant]
                if not tenants:
                    del self._classes[rank]
        return removed

    def ordered(self) -> list[LineWork]:
        """Every queued line in the order ``pop`` would hand them out (the forecast reads it)."""
        with self._lock:
            lines = [entry[2] for entry in sorted(self._jobs)]
            for rank in sorted(self._classes):
                queues = [iter(q) for q in self._classes[rank].values()]
                while queues:  # the round-robin across tenants, as pop does it
                    alive = []
                    for queue in queues:
                        work = next(queue, None)
                        if work is not None:
                            lines.append(work)
                            alive.append(queue)
                    queues = alive
        return lines

    @property
    def num_jobs(self) -> int:
        with self._lock:
            return len(self._jobs)

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs) + self._num_bulk
