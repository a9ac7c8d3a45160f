"""Prepare streams its input file: it reads the object a chunk at a time and commits lines
long before the file's end, and holds no copy of the file (tests/system/test_big_file_memory.py
measures the worker process)."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator

from service.storage import ObjectStorage
from tests.conftest_services import chat_line
from worker.prepare import prepare_batch

LINE_BYTES = 2_500
READ_BYTES = 64 << 10


class TrickleStorage:
    """The stack's storage, whose objects come out ``READ_BYTES`` at a time, whatever a reader
    asks for (so reading a file whole would take every chunk before its first line); it counts
    the bytes handed out."""

    def __init__(self, inner: ObjectStorage) -> None:
        self.inner = inner
        self.bytes_read = 0

    def writer(self, key: str):  # noqa: ANN201 - the inner storage's context manager
        return self.inner.writer(key)

    def iter_chunks(self, key: str, chunk_size: int = READ_BYTES) -> Iterator[bytes]:
        for chunk in self.inner.iter_chunks(key, READ_BYTES):
            self.bytes_read += len(chunk)
            yield chunk

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def check(self) -> None:
        self.inner.check()


def padded_lines(num_lines: int) -> list[str]:
    lines = []
    for i in range(num_lines):
        line = json.dumps(chat_line(f"p-{i:05d}", ""))
        pad = LINE_BYTES - len(line) - 1
        lines.append(line.replace('"content": ""', f'"content": "{"v" * pad}"', 1))
    return lines


def prepare_traced(stack, num_lines: int) -> tuple[list[int], int]:
    """Prepare a batch of ``num_lines`` lines of ``LINE_BYTES``; the bytes read by each chunk's
    commit, and the peak of Python's allocations meanwhile."""
    batch = stack.create_batch(padded_lines(num_lines))
    storage = TrickleStorage(stack.ctx.storage)
    read_at_commit: list[int] = []
    tracemalloc.start()
    try:
        shard_ids = prepare_batch(stack.ctx.db, storage, batch["id"], worker_id="prep",
                                  shard_size=8,
                                  on_shards=lambda ids: read_at_commit.append(storage.bytes_read))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert shard_ids and storage.bytes_read == num_lines * LINE_BYTES
    return read_at_commit, peak


def test_prepare_reads_the_file_as_it_commits(make_stack, sqlite_url):
    stack = make_stack(sqlite_url)
    prepare_traced(stack, 200)  # imports, statement caches: not the file's
    read_small, peak_small = prepare_traced(stack, 2_000)  # 5 MB
    read_big, peak_big = prepare_traced(stack, 6_000)  # 15 MB
    # The first chunk (4 shards of 8 lines) committed after reading about its own lines.
    assert read_big[0] <= 32 * LINE_BYTES + READ_BYTES, read_big[:3]
    assert len(read_big) > len(read_small) > 10
    # A chunk's rows (at most 32 shards) at a time, and ~100 bytes a line for the custom_id
    # check: 10 MB more file, well under 1 MB more peak.
    assert peak_big - peak_small < 4_000 * LINE_BYTES / 10, (peak_small, peak_big)
    assert peak_big < 6_000 * LINE_BYTES / 2, peak_big
