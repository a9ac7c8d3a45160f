"""An upload is streamed: each piece of the body goes on to storage as it is fed, and the
API holds no copy of the file (tests/system/test_big_file_memory.py measures the process)."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager

from api.uploads import JsonlIngest, MultipartStream
from tests.conftest_services import chat_line
from tests.system.stack import BOUNDARY, multipart_upload

NUM_LINES = 4_000
LINE_BYTES = 2_500  # a 10 MB file
PIECE_BYTES = 64 << 10


class CountingSink:
    """Storage that keeps nothing: it counts the bytes written to it, write by write."""

    def __init__(self) -> None:
        self.num_bytes = 0
        self.largest_write = 0

    @contextmanager
    def writer(self, key: str) -> Iterator[CountingSink]:
        yield self

    def write(self, data: bytes) -> None:
        self.num_bytes += len(data)
        self.largest_write = max(self.largest_write, len(data))


def lines() -> Iterator[bytes]:
    for i in range(NUM_LINES):
        line = json.dumps(chat_line(f"s-{i:05d}", ""))
        pad = LINE_BYTES - len(line) - 1
        yield line.replace('"content": ""', f'"content": "{"v" * pad}"', 1).encode() + b"\n"


def test_an_upload_goes_to_storage_as_it_is_fed():
    sink = CountingSink()
    ingest = JsonlIngest(sink, "file-stream", max_bytes=1 << 30, max_lines=NUM_LINES)  # type: ignore[arg-type]
    parser = MultipartStream(f"multipart/form-data; boundary={BOUNDARY}", ingest.feed)
    fed = 0
    tracemalloc.start()
    try:
        for piece in multipart_upload(lines(), chunk_bytes=PIECE_BYTES):
            parser.feed(piece)
            fed += len(piece)
            # Nothing is held back but the piece's unfinished line and the multipart framing.
            assert sink.num_bytes >= fed - PIECE_BYTES - LINE_BYTES - 512, (fed, sink.num_bytes)
        parser.finish()
        ingest.finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    file_bytes = NUM_LINES * LINE_BYTES
    assert (ingest.num_lines, ingest.num_errors, sink.num_bytes) == (NUM_LINES, 0, file_bytes)
    assert sink.largest_write <= 2 * PIECE_BYTES
    # The custom_id set and a few pieces: a small fraction of the 10 MB file.
    assert peak < file_bytes / 10, peak
