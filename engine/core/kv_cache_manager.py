"""KVCacheManager: the per-request view of the block pool.

It finds a request's cached prefix, allocates the slots a step needs, publishes blocks as they
fill, and frees everything when the request ends or is preempted. It also remembers which running
request will compute each prompt block not yet cached (``in_flight``), so that a waiting request
sharing that prefix can wait for it instead of computing it a second time.

A model that mixes sliding-window and full-attention layers gives its windowed layers their own
pool (``window``, ``engine/core/window_kv.py``): their blocks behind the window are freed as the
request moves on, and every allocation asks both pools, so admission and preemption count what
a request really holds.
"""

from __future__ import annotations

from engine.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from engine.core.request import Request
from engine.core.window_kv import ComputedBlocks, WindowBlocks


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, watermark: float,
        window: WindowBlocks | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.window = window
        self.watermark_blocks = int(watermark * num_blocks)
        # Chained block hash -> the running request that will compute (and publish) that block.
        self.in_flight: dict[bytes, Request] = {}
        # Prefix-cache counters, in tokens (as vLLM reports them).
        self.num_queries = 0
        self.num_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        # Only tokens known on the host: a hash never covers a placeholder (async scheduling).
        num_full = request.num_sampled_tokens // bs
        # The adapter is an extra key of every block: one prompt under two adapters has two
        # KVs (vLLM's extra keys); under one adapter it is shared.
        extra = (f"lora:{request.lora_name}",) if request.lora_name is not None else ()
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.token_ids[i * bs : (i + 1) * bs],
                                            extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached run of the request's full blocks, and the tokens it covers.

        At least one token is always left to compute: its logits are what we sample from.
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        bs = self.block_size
        max_hit_blocks = (request.num_tokens - 1) // bs
        blocks: list[KVBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            block = self.pool.get_cached_block(block_hash, request.token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            blocks.append(block)
        if self.window is None:
            return blocks, len(blocks) * bs
        num_hit, window_blocks = self.window.hit(request.block_hashes, request.token_ids,
                                                 len(blocks))
        return ComputedBlocks(blocks[:num_hit], window_blocks), num_hit * bs

    def in_flight_owner(self, request: Request, num_hit_blocks: int) -> Request | None:
        """The running request computing the block right after ``request``'s cached prefix.

        Only a block that could be a hit counts (the last token is always computed anyway).
        Call after ``get_computed_blocks`` (which fills ``request.block_hashes``).
        """
        if not self.in_flight or num_hit_blocks >= (request.num_tokens - 1) // self.block_size:
            return None
        owner = self.in_flight.get(request.block_hashes[num_hit_blocks])
        return owner if owner is not request else None

    def promise_blocks(self, request: Request, num_hit_blocks: int) -> None:
        """Mark the admitted request's full blocks past its cached prefix as being computed."""
        if not self.enable_caching:
            return
        for block_hash in request.block_hashes[num_hit_blocks:]:
            self.in_flight.setdefault(block_hash, request)

    def _release_promises(self, request: Request, start: int, end: int) -> None:
        for block_hash in request.block_hashes[start:end]:
            if self.in_flight.get(block_hash) is request:
                del self.in_flight[block_hash]

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a refused admission is looked up again later)."""
        self.num_queries += num_tokens
        self.num_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
        *,
        admit: bool = False,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens; False (and no change) if it can't.

        ``admit`` applies the watermark: a new request may not take the last free blocks, which
        are kept so that running requests can keep decoding without preemption.
        """
        if not computed_blocks and self.window is None and self.blocks_needed(
                request.num_computed_tokens + num_new_tokens) <= len(request.block_ids):
            return True  # most decode steps: the last block has room
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_required - len(request.block_ids) - len(computed_blocks)
        # Cached blocks that are currently free leave the free queue when we take them.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        reserve = self.watermark_blocks if admit else 0
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks - reserve:
            return False
        if self.window is not None:
            hit = computed_blocks.window if isinstance(computed_blocks, ComputedBlocks) else []
            new, evictable = self.window.num_new_blocks(
                request, num_computed, num_computed + num_new_tokens, hit)
            if new + evictable > self.window.num_free_blocks:
                return False
            self.window.allocate(request, num_computed, num_computed + num_new_tokens, hit)
        self.pool.touch(computed_blocks)
        request.block_ids.extend(b.block_id for b in computed_blocks)
        if num_new_blocks > 0:
            request.block_ids.extend(b.block_id for b in self.pool.allocate(num_new_blocks))
        return True

    def cache_full_blocks(self, request: Request, num_computed: int) -> None:
        """Publish the request's blocks whose ``num_computed`` first tokens are computed (by
        steps that are done: with async scheduling ``request.num_computed_tokens`` also counts
        the step in flight); free its windowed layers' blocks that fell behind the window
        (those a step in flight still reads are reused only by later steps)."""
        if not self.enable_caching:
            if self.window is not None:
                self.window.release_behind(request)
            return
        bs = self.block_size
        num_done = num_computed // bs
        if self.window is None and num_done <= request.num_published_blocks:
            return  # most decode steps: no block filled up (hashes catch up when one does)
        self._update_block_hashes(request)
        num_full = min(num_done, len(request.block_hashes))
        for i in range(request.num_published_blocks, num_full):
            block = self.pool.blocks[request.block_ids[i]]
            self.pool.cache_block(
                block, request.block_hashes[i], request.token_ids[i * bs : (i + 1) * bs]
            )
        self._release_promises(request, request.num_published_blocks, num_full)
        if self.window is not None:
            self.window.publish(request, request.num_published_blocks, num_full)
            self.window.release_behind(request)
        request.num_published_blocks = max(request.num_published_blocks, num_full)

    def free(self, request: Request) -> None:
        if self.in_flight:
            self._release_promises(request, request.num_published_blocks, len(request.block_hashes))
        # Tail blocks first: they are the least likely to be shared, so they are evicted first.
        self.pool.free([self.pool.blocks[i] for i in reversed(request.block_ids)])
        request.block_ids = []
        if self.window is not None:
            self.window.free(request)
        request.num_published_blocks = 0

    def reset_counters(self) -> None:
        self.num_queries = 0
        self.num_hits = 0
