"""Block pool, free queue and prefix hashing: pure bookkeeping, no model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.core.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens


def test_free_queue_is_fifo_with_o1_removal():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2]
    assert queue.num_free == 4
    with pytest.raises(RuntimeError):
        queue.remove(blocks[0])  # not in the queue any more


def test_hash_is_chained_and_deterministic_across_processes():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5])
    # Same tokens under a different parent: a different block.
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(h1, [5, 6], ("lora-a",)) != hash_block_tokens(h1, [5, 6])
    code = (
        "from engine.core.block_pool import hash_block_tokens;"
        "print(hash_block_tokens(None, [1, 2, 3, 4]).hex())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=".",
    )
    assert other.stdout.strip() == h1.hex()


def test_allocate_free_and_lru_eviction():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"ha", (1, 2))
    pool.cache_block(b, b"hb", (3, 4))
    assert pool.num_free_blocks == 2
    pool.free([b, a])  # b joins the queue before a
    assert pool.num_free_blocks == 4
    # Cached but free blocks can still be hit, and a hit pulls the block out of the queue.
    assert pool.get_cached_block(b"ha", (1, 2)) is a
    assert pool.get_cached_block(b"ha", (9, 9)) is None  # tokens must match, not just the hash
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 3
    # Allocation takes never-used blocks first, then the least recently freed cached one (b).
    got = pool.allocate(3)
    assert got[-1] is b
    assert pool.get_cached_block(b"hb", (3, 4)) is None  # evicted on reuse
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_double_free_is_an_error():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError):
        pool.free([a])


def test_shared_block_is_freed_only_by_last_reference():
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h", (7,))
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([a])
    assert pool.num_free_blocks == 1
    pool.free([a])
    assert pool.num_free_blocks == 2
