"""The KV blocks of a model's sliding-window layers, kept apart from its full-attention layers'.

(With every layer windowed, Mistral or Phi-3 with a window, the full group holds no layer: its
pool only keeps the block hashes and prefix-cache keys, zero bytes a block.)

In a model that mixes both (Gemma 2: every other layer; Gemma 3: five local layers to one
global), a windowed layer never reads a position more than ``window - 1`` behind its query, so
its blocks wholly behind the window can go back to the pool (vLLM's hybrid allocator, in two
groups): the full-attention layers keep a block per ``block_size`` tokens of context, the
windowed ones about ``(window + chunk) / block_size``. The windowed group has its own pool and,
per request, its own block table (``Request.window_block_ids``), the same length as the full
table; entries behind the window point at block 0, a null block that is never handed out or read.

Prefix caching covers both groups under the same chained block hashes: a cached prefix of ``n``
blocks is a hit only where the windowed group still holds the blocks its last window needs.
"""

from __future__ import annotations

from engine.core.block_pool import BlockPool, KVBlock
from engine.core.request import Request

NULL_BLOCK = 0


class ComputedBlocks(list):
    """A prefix-cache hit: the full group's blocks (the list) and the windowed group's blocks of
    the same prefix (``window``: None where the window does not need the block)."""

    window: list[KVBlock | None]

    def __init__(self, blocks=(), window: list[KVBlock | None] | None = None) -> None:
        super().__init__(blocks)
        self.window = window or []


class WindowBlocks:
    """The windowed layers' pool and the per-request bookkeeping of their block tables."""

    def __init__(self, num_blocks: int, block_size: int, window: int,
                 enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the windowed layers need at least 2 KV blocks, got {num_blocks}")
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching)
        # Block 0 is the null block: taken out of the free queue for good.
        self.pool.touch([self.pool.blocks[NULL_BLOCK]])

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def first_needed(self, num_computed: int) -> int:
        """The first block a query at position ``num_computed`` (or later) can still read."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def hit(self, block_hashes: list[bytes], token_ids: list[int], num_hit_blocks: int
            ) -> tuple[int, list[KVBlock | None]]:
        """The longest prefix of at most ``num_hit_blocks`` blocks whose last window is cached
        here too: (its block count, its blocks, None where not needed)."""
        bs = self.block_size
        for n in range(num_hit_blocks, 0, -1):
            first = self.first_needed(n * bs)
            blocks: list[KVBlock | None] = [None] * first
            for i in range(first, n):
                block = self.pool.get_cached_block(block_hashes[i], token_ids[i * bs:(i + 1) * bs])
                if block is None:
                    break
                blocks.append(block)
            else:
                return n, blocks
        return 0, []

    def num_new_blocks(self, request: Request, num_computed: int, num_tokens: int,
                       hit: list[KVBlock | None]) -> tuple[int, int]:
        """(blocks to allocate, cached hit blocks that are free now) for the request to hold
        ``num_tokens`` tokens' slots, ``num_computed`` of them computed."""
        have = len(request.window_block_ids) + len(hit)
        want = -(-num_tokens // self.block_size)
        first = self.first_needed(num_computed)
        new = sum(1 for j in range(have, want) if j >= first)
        return new, sum(1 for b in hit if b is not None and b.ref_cnt == 0)

    def allocate(self, request: Request, num_computed: int, num_tokens: int,
                 hit: list[KVBlock | None]) -> None:
        real = [b for b in hit if b is not None]
        self.pool.touch(real)
        request.window_block_ids.extend(NULL_BLOCK if b is None else b.block_id for b in hit)
        want = -(-num_tokens // self.block_size)
        first = self.first_needed(num_computed)
        new = [j for j in range(len(request.window_block_ids), want) if j >= first]
        fresh = iter(self.pool.allocate(len(new)))
        for j in range(len(request.window_block_ids), want):
            request.window_block_ids.append(next(fresh).block_id if j >= first else NULL_BLOCK)

    def publish(self, request: Request, start: int, end: int) -> None:
        """Offer blocks ``start .. end - 1`` (full, computed) to the prefix cache."""
        bs = self.block_size
        for i in range(start, end):
            block_id = request.window_block_ids[i]
            if block_id != NULL_BLOCK:
                self.pool.cache_block(self.pool.blocks[block_id], request.block_hashes[i],
                                      request.token_ids[i * bs:(i + 1) * bs])

    def release_behind(self, request: Request) -> None:
        """Free the blocks wholly behind the window of the request's next token."""
        table = request.window_block_ids
        first = min(self.first_needed(request.num_computed_tokens), len(table))
        done = [self.pool.blocks[table[j]] for j in range(first) if table[j] != NULL_BLOCK]
        if done:
            self.pool.free(done)
            for j in range(first):
                table[j] = NULL_BLOCK

    def free(self, request: Request) -> None:
        self.pool.free([self.pool.blocks[i] for i in reversed(request.window_block_ids)
                        if i != NULL_BLOCK])
        request.window_block_ids = []
