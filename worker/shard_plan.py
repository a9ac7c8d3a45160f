"""How a batch's lines are cut into shards: full shards, then a tail of shrinking ones.

A batch ends when its slowest worker ends. Workers claim shards in queue order, so when the
queue runs dry each holds what its last claims gave it, and with equal shards of
``shard_size`` lines their ends spread over up to a shard's running time while the others
stand idle: at 32 paced workers on a 40,000-line batch (157 shards of 256, under five a
worker) the run phase reached 72-76% of ideal, against 92-94% at 16 workers.

So the plan follows guided self-scheduling (Polychronopoulos and Kuck, 1987): a shard is at
most ``1 / TAIL_SPREAD`` of the lines from its start to the batch's end, and never under
``MIN_TAIL_LINES``. The early shards stay full (all but a batch's last ~``TAIL_SPREAD *
shard_size`` lines are cut as before), the last ones shrink geometrically, and the claims
that drain the queue hand out small pieces, so workers run dry within a small shard of one
another. The cost is the tail's extra shards: about ``TAIL_SPREAD * ln(shard_size /
MIN_TAIL_LINES)`` + ``TAIL_SPREAD`` at most, whatever the batch's size (131 at the defaults:
288 shards for 40,000 lines where there were 157), each one more claim.

The plan depends only on the input file's count of lines without upload errors (prepare may
fail more: the last planned shards then hold fewer lines, or none), so a resumed prepare cuts
the same shards as one that never stopped. Lines past the plan (none, unless prepare finds
more valid lines than the upload did) go in shards of ``MIN_TAIL_LINES``.
"""

from __future__ import annotations

# A tail shard holds at most this fraction of the lines still to come: a batch's tail is cut
# evenly for up to this many workers (guided self-scheduling's P).
TAIL_SPREAD = 64
# The smallest tail shard: below this a claim (a transaction, a round of the lease loop) costs
# more than the lines it hands out save at the batch's end. A line queue's worth of these is
# capped by ``worker_max_shards`` anyway.
MIN_TAIL_LINES = 32


class ShardPlan:
    """The sizes of a batch's shards, in queue order, for ``num_lines`` expected valid lines."""

    def __init__(self, num_lines: int, shard_size: int) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, got {shard_size}")
        self.min_size = min(MIN_TAIL_LINES, shard_size)
        sizes: list[int] = []
        left = max(num_lines, 0)
        while left > 0:
            size = min(left, max(self.min_size, min(shard_size, -(-left // TAIL_SPREAD))))
            sizes.append(size)
            left -= size
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def size(self, index: int) -> int:
        """Shard ``index``'s planned lines (past the plan: ``min_size``)."""
        return self.sizes[index] if index < len(self.sizes) else self.min_size

    def lines(self, first: int, count: int) -> int:
        """The planned lines of shards ``first`` .. ``first + count - 1``."""
        return sum(self.size(k) for k in range(first, first + count))

    def cut(self, first: int, num_lines: int) -> list[int]:
        """The sizes of ``num_lines`` lines cut from shard ``first`` on (the last one may be
        short of its plan)."""
        out: list[int] = []
        k = first
        while num_lines > 0:
            size = min(self.size(k), num_lines)
            out.append(size)
            num_lines -= size
            k += 1
        return out
