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

The engine has one integer, lower = more urgent, ordered by (priority, arrival);
``engine_priority`` maps 1-3 onto it, and the drain loop's arrival order carries 4.
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


def engine_priority(*, is_job: bool, priority: int, deadline: float | None) -> int:
    """The engine's ``add_request(priority=)`` of a line: lower is more urgent.

    Jobs map below zero (``priority`` is the shard's, ``JOB_PRIORITY_BASE`` + the job's, so a
    job of priority 5 is -1006 and outranks one of priority 0, -1001); bulk lines map to
    ``bucket * 1000 + (MAX_PRIORITY - priority)``, >= 0, so a bulk line never outranks a job
    and an earlier deadline outranks any priority."""
    if is_job:
        return -1 - max(priority, 0)
    bucket, neg_priority = bulk_rank(deadline, priority)
    return bucket * 1000 + (MAX_PRIORITY + neg_priority)
