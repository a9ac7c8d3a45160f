"""The order work runs in, declared once: claims, a worker's line queue and the engine use it.

The full ordering key, most significant first:

1. Single jobs before every bulk line; among jobs, higher ``priority`` first, then arrival.
2. Bulk lines: earliest deadline first (a batch's deadline is its ``expires_at``, the end of its
   completion window), with deadlines cut into ``DEADLINE_BUCKET_S`` buckets so batches due at
   about the same time count as equal (otherwise EDF would degrade into FIFO among batches of
   the same window, and one tenant's big batch would starve another's small one submitted a
   second later).
3. Among equal deadline buckets: higher batch ``priority`` first (a tenant cannot use priority
   to break another batch's earlier deadline; the API caps it, ``Settings.max_priority``).
4. Among equal (deadline bucket, priority): tenants share fairly (claims go to the tenant
   holding the fewest running shards; the line queue round-robins over tenants), and each
   tenant's lines run in shard (prompt-prefix) order.

The engine orders its queues by (priority, rank, arrival), lower first, and only ``priority``
displaces: a more urgent request preempts less urgent running ones (by recompute) and, through
``urgent_bulk_tokens``, caps their tokens a step while priorities differ; ``rank`` only orders
requests of one priority. ``engine_order`` is the one mapping from a line to those two:

- a single job: priority below zero (higher job priority lower), rank 0;
- a bulk line: priority 0 and ``rank`` from points 2 and 3 (``bulk_rank``), so inside the engine
  too an earlier-deadline batch's lines are admitted ahead of a later one's waiting lines, while
  the later one's running lines keep their seats (recomputing them would waste work, and
  capping them would cost throughput for as long as two deadline classes overlap);
- a bulk line whose batch's deadline is at risk (the worker's forecast of its held lines ends
  after the batch's ``expires_at``): priority ``AT_RISK_PRIORITY``, more urgent than bulk lines
  and less than every job, so it may take a seat, budget or blocks from running lines of
  batches not at risk.

Point 4 is kept by the order lines enter the engine (claims and the worker's line queue).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Deadlines this close count as one (seconds).
DEADLINE_BUCKET_S = 600
# Job and batch priorities a request may carry; the API caps tenants lower (max_priority).
MIN_PRIORITY, MAX_PRIORITY = 0, 100


def deadline_bucket(deadline: float | None) -> int:
    """The bucket of a unix-seconds deadline; no deadline sorts last."""
    if deadline is None:
        return 2**40
    return math.ceil(deadline / DEADLINE_BUCKET_S)


def bulk_rank(deadline: float | None, priority: int) -> tuple[int, int]:
    """Sort key of a bulk line's class (points 2 and 3 above); lower runs first."""
    return deadline_bucket(deadline), -priority


# A bulk line whose deadline is at risk: more urgent than bulk lines, less than every job.
AT_RISK_PRIORITY = -1


@dataclass(frozen=True)
class EngineOrder:
    """What ``add_request`` is told: ``priority`` (lower is more urgent, and displaces) and
    ``rank`` (orders one priority's requests, never displaces)."""

    priority: int
    rank: int


def engine_order(*, is_job: bool, priority: int, deadline: float | None = None,
                 at_risk: bool = False) -> EngineOrder:
    """The engine's order of a line. ``priority`` is the shard's: a job's is
    ``JOB_PRIORITY_BASE`` + its own, so a job of priority 5 maps to -1006 and outranks one of
    priority 0 (-1001); ``deadline`` is the batch's ``expires_at`` (unix seconds)."""
    if is_job:
        return EngineOrder(-1 - max(priority, 0), 0)
    bucket, negative_priority = bulk_rank(deadline, priority)
    # One integer that sorts as (bucket, -priority) does: priority is within 0-100.
    rank = bucket * (MAX_PRIORITY + 1) + (MAX_PRIORITY + negative_priority)
    return EngineOrder(AT_RISK_PRIORITY if at_risk else 0, rank)
