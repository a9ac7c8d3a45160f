"""BlockPool: the KV cache's blocks, their reference counts, the LRU free queue, the prefix map.

A block is *free* when no request references it. A free block may still hold a cached prefix
(it keeps its hash until it is handed out again), so freed blocks go to the tail of the free
queue and allocation takes from the head: the least recently used cached block is evicted first.
A cache hit on a free block pulls it out of the middle of the queue in O(1).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()
) -> bytes:
    """Chained hash of one full block: depends on every token before it, and nothing else.

    sha256 over fixed-width bytes, so the same prefix has the same hash in every process.
    """
    h = hashlib.sha256(parent_hash or b"\0")
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(key.encode())
    return h.digest()[:16]


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    # Links of the free queue (None when not in it).
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is None or block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        if block.prev is None or block.next is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def __iter__(self):
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next


class BlockPool:
    """Owns every KV block; hands them out, takes them back, and remembers cached prefixes."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        if not self.num_blocks:  # an embedding engine has no KV cache
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes, token_ids: Sequence[int]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        # Compare the tokens too: a hash collision must never serve another prompt's KV.
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on blocks found in the cache (pulling free ones out of the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue's tail in order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Publish a full block under its hash (first writer wins; duplicates stay private)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)
