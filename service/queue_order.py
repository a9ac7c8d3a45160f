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

The engine has one integer, lower = more urgent, ordered by (priority, arrival), and a more
urgent request preempts less urgent running ones (by recompute) and, through
``urgent_bulk_tokens``, caps the less urgent requests' tokens a step while priorities differ.
``engine_priority`` gives that only to single jobs (below zero, higher job priority lower);
every bulk line is 0. Points 2-4 are kept by the order lines enter the engine (claims and the
worker's line queue), which keeps only about two steps' worth waiting beyond its running seats:
an earlier-deadline batch waits at most for the seats' current occupants, and bulk lines never
preempt each other (that would recompute work) nor cap each other's steps (two deadline
classes in the engine at once would otherwise cost throughput for as long as they overlap).
"""

from __future__ import annotations

import math

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


def engine_priority(*, is_job: bool, priority: int) -> int:
    """The engine's ``add_request(priority=)`` of a line: lower is more urgent.

    ``priority`` is the shard's: a job's is ``JOB_PRIORITY_BASE`` + its own, so a job of
    priority 5 maps to -1006 and outranks one of priority 0 (-1001); every bulk line is 0."""
    return -1 - max(priority, 0) if is_job else 0
