"""No silent death: an engine whose step() raises stops its worker, which hands its shards back
at once (their lines go back to pending, none is failed) and reports the failure; a second
worker finishes the batch with every line exactly once. A line whose preparation raises fails
alone while the rest of its batch and the next batch complete."""

from __future__ import annotations

import threading

from sqlalchemy import select

from engine.testing.fake_engine import FakeEngine
from service.models import LINE_PENDING, RequestLine, Shard
from tests.conftest_services import chat_line
from tests.openai_shapes import error_of
from worker.drain import EngineFailed
from worker.lease_keeper import LeaseKeeper


class BreakingEngine(FakeEngine):
    """A fake engine whose step() raises after ``ok_steps`` steps, like a CUDA error would."""

    def __init__(self, ok_steps: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ok_steps = ok_steps

    def step(self):
        if self.num_steps >= self.ok_steps:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step()


class TemplateError(Exception):
    """What jinja2 raises from a template's ``raise_exception`` (not a ValueError)."""


class PickyTemplateEngine(FakeEngine):
    def apply_chat_template(self, messages: list[dict], *,
                            tools: list[dict] | None = None) -> list[int]:
        if any("BOOM" in str(m.get("content")) for m in messages):
            raise TemplateError("Conversation roles must alternate user/assistant/user/...")
        return super().apply_chat_template(messages, tools=tools)


def test_broken_engine_stops_the_worker_and_hands_its_shards_back(make_stack, any_db_url):
    # A 60 s lease: the second worker can only finish in time if the shards were handed back.
    stack = make_stack(any_db_url, lease_seconds=60.0)
    fatal: list[BaseException] = []
    doomed_engine = BreakingEngine(ok_steps=6, max_num_seqs=2, step_time=0.01)
    doomed = stack.add_worker(doomed_engine)
    doomed._on_fatal = fatal.append
    lines = [chat_line(f"e{i:02d}", f"line {i}", max_tokens=3) for i in range(24)]
    batch = stack.create_batch(lines)
    assert doomed.failed.wait(20), "the worker did not stop after its engine broke"

    assert isinstance(doomed.failure, EngineFailed)
    assert "CUDA error" in str(doomed.failure)
    assert fatal == [doomed.failure]  # on_fatal (exit_process in `boxcar worker`) was called
    assert not doomed._engine_thread.is_alive()
    assert all(not t.is_alive() for t in doomed._threads)  # no heartbeats, no claims
    with stack.ctx.db.read_session() as session:
        shards = session.execute(select(Shard.status, Shard.lease_owner)).all()
        statuses = dict(session.execute(select(RequestLine.custom_id, RequestLine.status)).all())
    # Handed back, not left to expire: no shard runs under the dead worker's lease.
    assert all(status in ("pending", "done") for status, _ in shards), shards
    assert all(owner is None for status, owner in shards if status == "pending"), shards
    assert "failed" not in statuses.values()  # the engine's fault fails no line
    assert LINE_PENDING in statuses.values()

    rescuer = stack.add_worker(FakeEngine())
    done = stack.wait_status(batch["id"], "completed", timeout=20)
    assert done["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
    output_ids = [line["custom_id"] for line in stack.lines_of(done["output_file_id"])]
    assert sorted(output_ids) == sorted(line["custom_id"] for line in lines)
    assert done["error_file_id"] is None
    with stack.ctx.db.read_session() as session:
        writers = set(session.scalars(select(RequestLine.worker_id)).all())
    assert rescuer.worker_id in writers


def test_lease_keeper_stops_renewing_once_the_engine_thread_is_dead(make_stack, sqlite_url):
    stack = make_stack(sqlite_url)
    worker = stack.add_worker(FakeEngine())
    dead: list[bool] = []
    keeper = LeaseKeeper(worker.db, stack.settings, worker_id="zombie", held=worker.held,
                         drainer=worker.drainer, announce_shards=lambda ids: None,
                         on_batches_touched=lambda ids: None, engine_alive=lambda: False,
                         on_engine_dead=lambda: dead.append(True))
    keeper.check = lambda: (_ for _ in ()).throw(AssertionError("heartbeat while dead"))
    keeper.claim_some = lambda: (_ for _ in ()).throw(AssertionError("claim while dead"))
    keeper._stop = threading.Event()
    assert keeper.run_round() is False
    assert dead == [True]


def test_engine_thread_ending_on_its_own_stops_the_worker(make_stack, sqlite_url):
    stack = make_stack(sqlite_url)
    worker = stack.add_worker(FakeEngine())
    worker.drainer._stop.set()  # the drain loop returns although nobody called stop()
    worker.drainer.wake()
    assert worker.failed.wait(10)
    assert "ended on its own" in str(worker.failure)


def test_a_line_whose_template_raises_fails_alone(make_stack, sqlite_url):
    stack = make_stack(sqlite_url)
    worker = stack.add_worker(PickyTemplateEngine())
    first = [chat_line(f"a{i}", "BOOM" if i == 3 else f"line {i}", max_tokens=3)
             for i in range(10)]
    done = stack.wait_status(stack.create_batch(first)["id"], "completed", timeout=20)
    assert done["request_counts"] == {"total": 10, "completed": 9, "failed": 1}
    (error,) = stack.lines_of(done["error_file_id"])
    assert error["custom_id"] == "a3"
    message = error_of(error)["message"]
    assert "TemplateError" in message and "roles must alternate" in message
    assert len(stack.lines_of(done["output_file_id"])) == 9

    second = [chat_line(f"b{i}", f"line {i}", max_tokens=3) for i in range(6)]
    done = stack.wait_status(stack.create_batch(second)["id"], "completed", timeout=20)
    assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert worker.failure is None and worker._engine_thread.is_alive()
