"""Object storage down while a batch needs it: prepare and finalize fail, and the worker retries
them with backoff, so the batch moves on within seconds of storage coming back (not after the
two-minute stage lease). A max_tokens that cannot fit in the context fails its line only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from engine.testing.fake_engine import FakeEngine
from tests.conftest_services import chat_line, wait_for
from tests.openai_shapes import error_of


class FlakyStorage:
    """Wraps a storage; while ``down`` is set every call fails like an unreachable S3."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.down = threading.Event()
        self.num_refused = 0

    def _check(self) -> None:
        if self.down.is_set():
            from botocore.exceptions import EndpointConnectionError

            self.num_refused += 1
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1/")

    @contextmanager
    def writer(self, key: str) -> Iterator:
        self._check()
        with self.inner.writer(key) as writer:
            yield writer
        self._check()  # the commit fails too

    def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        self._check()
        yield from self.inner.iter_chunks(key, chunk_size)

    def delete(self, key: str) -> None:
        self._check()
        self.inner.delete(key)

    def exists(self, key: str) -> bool:
        self._check()
        return self.inner.exists(key)

    def check(self) -> None:
        self._check()
        self.inner.check()


def flaky_stack(make_stack, db_url: str):
    stack = make_stack(db_url)
    storage = FlakyStorage(stack.ctx.storage)
    stack.ctx.storage = storage  # the API and the workers share the context's storage
    return stack, storage


def test_finalize_is_retried_soon_after_storage_returns(make_stack, sqlite_url):
    stack, storage = flaky_stack(make_stack, sqlite_url)
    stack.add_worker(FakeEngine(step_time=0.01))
    lines = [chat_line(f"f{i}", f"line {i}", max_tokens=3) for i in range(20)]
    batch = stack.create_batch(lines)
    stack.wait_status(batch["id"], "in_progress")
    storage.down.set()
    wait_for(lambda: storage.num_refused >= 2, 20, 0.02, "finalize to fail on storage")
    assert stack.batch(batch["id"])["status"] == "finalizing"
    refused = storage.num_refused
    wait_for(lambda: storage.num_refused > refused, 20, 0.02, "finalize to retry while down")
    storage.down.clear()
    # The stage lease is 120 s, longer than this wait: finishing in it was the worker's own
    # retry, not another worker taking an expired lease over.
    done = stack.wait_status(batch["id"], "completed", timeout=20)
    output = stack.lines_of(done["output_file_id"])
    assert sorted(line["custom_id"] for line in output) == sorted(f"f{i}" for i in range(20))


def test_prepare_is_retried_soon_after_storage_returns(make_stack, sqlite_url):
    stack, storage = flaky_stack(make_stack, sqlite_url)
    stack.add_worker(FakeEngine())
    file_id = stack.upload([chat_line(f"p{i}", f"line {i}", max_tokens=2) for i in range(8)])
    storage.down.set()
    response = stack.client.post("/v1/batches", json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert response.status_code == 200, response.text  # creating needs no storage
    batch_id = response.json()["id"]
    wait_for(lambda: storage.num_refused >= 2, 20, 0.02, "prepare to fail on storage")
    refused = stack.client.post("/v1/files", data={"purpose": "batch"},
                                files={"file": ("x.jsonl", b'{"a": 1}\n')})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "object_storage_unavailable"
    assert stack.batch(batch_id)["status"] == "validating"
    storage.down.clear()
    done = stack.wait_status(batch_id, "completed", timeout=20)  # its own retry, as above
    assert done["request_counts"] == {"total": 8, "completed": 8, "failed": 0}


def test_max_tokens_beyond_the_context_fails_only_its_line(make_stack, sqlite_url):
    stack = make_stack(sqlite_url)
    stack.add_worker(FakeEngine(max_model_len=64))
    lines = [chat_line("ok", "hi", max_tokens=4),
             chat_line("huge", "hi", max_tokens=1000),
             chat_line("sum", "x" * 40, max_tokens=40),  # fits alone, not with the prompt
             chat_line("fits", "x" * 40, max_tokens=4)]
    done = stack.wait_status(stack.create_batch(lines)["id"], "completed")
    errors = {e["custom_id"]: error_of(e) for e in stack.lines_of(done["error_file_id"])}
    assert set(errors) == {"huge", "sum"}
    assert all(e["code"] == "context_length_exceeded" for e in errors.values())
    assert "maximum context length is 64 tokens" in errors["huge"]["message"]
    assert "1000 in max_tokens" in errors["huge"]["message"]
    assert sorted(x["custom_id"] for x in stack.lines_of(done["output_file_id"])) == ["fits", "ok"]
