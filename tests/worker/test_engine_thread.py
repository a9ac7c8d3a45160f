"""The worker builds its engine on the thread that steps it (one OpenMP team per process)."""

from __future__ import annotations

import threading

from engine.testing.fake_engine import FakeEngine
from tests.conftest_services import chat_line
from worker import process as service_module
from worker.process import WorkerService


class ThreadRecordingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.built_on = threading.get_ident()
        self.stepped_on: set[int] = set()

    def step(self):
        self.stepped_on.add(threading.get_ident())
        return super().step()


def test_engine_is_built_and_stepped_on_one_thread_not_the_callers(make_stack, sqlite_url,
                                                                   monkeypatch):
    stack = make_stack(sqlite_url)
    engines: list[ThreadRecordingEngine] = []
    monkeypatch.setattr(service_module, "build_engine",
                        lambda settings, storage=None: engines.append(ThreadRecordingEngine())
                        or engines[-1])
    worker = WorkerService(stack.settings, db=stack.ctx.db, storage=stack.ctx.storage,
                           queue=stack.ctx.queue)
    stack.workers.append(worker.start())
    batch = stack.create_batch([chat_line(f"r{i}", f"question {i}") for i in range(6)])
    assert stack.wait_status(batch["id"], "completed")["request_counts"]["completed"] == 6

    (engine,) = engines
    assert engine.built_on != threading.get_ident()
    assert engine.stepped_on == {engine.built_on}


def test_a_failing_engine_build_raises_from_start_and_leaves_no_thread(make_stack, sqlite_url,
                                                                       monkeypatch):
    stack = make_stack(sqlite_url)

    def broken(settings, storage=None):
        raise ValueError("no such model")

    monkeypatch.setattr(service_module, "build_engine", broken)
    worker = WorkerService(stack.settings, db=stack.ctx.db, storage=stack.ctx.storage,
                           queue=stack.ctx.queue)
    try:
        worker.start()
    except ValueError as exc:
        assert "no such model" in str(exc)
    else:
        raise AssertionError("start() should raise")
    worker._engine_thread.join(5)
    assert not worker._engine_thread.is_alive()
