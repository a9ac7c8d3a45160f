"""Worker test fixtures: the API and in-process workers (fake engine) on one database."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from fastapi.testclient import TestClient

from api.app import build_context, create_app
from engine.testing.fake_engine import FakeEngine, StepGate
from service.queue import EmbeddedQueue
from service.settings import Settings
from tests.conftest_services import *  # noqa: F403
from tests.conftest_services import jsonl, make_key, migrated, wait_for
from worker.process import WorkerService


@dataclass
class Stack:
    """An API client and the workers behind it."""

    settings: Settings
    ctx: object
    client: TestClient
    workers: list[WorkerService] = field(default_factory=list)

    def add_worker(self, engine: FakeEngine | None = None, **overrides) -> WorkerService:
        settings = self.settings.model_copy(update=overrides) if overrides else self.settings
        worker = WorkerService(settings, engine=engine or FakeEngine(), db=self.ctx.db,
                               storage=self.ctx.storage, queue=self.ctx.queue)
        self.workers.append(worker.start())
        return worker

    def upload(self, lines) -> str:
        response = self.client.post("/v1/files", data={"purpose": "batch"},
                                    files={"file": ("in.jsonl", jsonl(lines))})
        assert response.status_code == 200, response.text
        return response.json()["id"]

    def create_batch(self, lines, **extra) -> dict:
        body = {"input_file_id": self.upload(lines), "endpoint": "/v1/chat/completions",
                "completion_window": "24h", **extra}
        response = self.client.post("/v1/batches", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    def batch(self, batch_id: str) -> dict:
        return self.client.get(f"/v1/batches/{batch_id}").json()

    def wait_status(self, batch_id: str, statuses, timeout: float = 30.0) -> dict:
        statuses = {statuses} if isinstance(statuses, str) else set(statuses)
        return wait_for(lambda: (b := self.batch(batch_id))["status"] in statuses and b,
                        timeout, 0.05, f"batch {batch_id} to reach {statuses}")

    def step_settled(self, worker: WorkerService, gate: StepGate, until, *,
                     max_steps: int = 2000) -> int:
        """Step ``worker``'s engine (a ``FakeEngine`` gated by ``gate``) one step at a time,
        letting the worker settle after each, until ``until()``; returns the steps taken.

        Settled: the step and the drain loop's next drops and top-up are done (the engine waits
        at the gate again, or has no work), its finished lines are written, and a whole lease
        round ran after that (stopped batches dropped, new shards claimed). What happens between
        two steps then depends on the steps alone, not on which thread the machine ran first."""
        engine = worker.engine
        start = gate.num_passed
        while not until():
            if gate.num_passed - start >= max_steps:
                raise AssertionError(f"not done after {max_steps} steps")
            if not gate.num_allowed:
                gate.allow(1)
            assert gate.wait_blocked(10, or_when=lambda: not engine.has_unfinished_requests())
            worker.writer.flush()
            fresh = worker.leases.num_rounds + 2  # the next round may have begun before now
            worker.leases.wake(check=True)
            wait_for(lambda: worker.leases.num_rounds >= fresh,  # noqa: B023 - called at once
                     10, 0.001, "a lease round after the step")
        return gate.num_passed - start

    def lines_of(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        text = self.client.get(f"/v1/files/{file_id}/content").text
        return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def make_stack(tmp_path, request):
    def make(db_url: str, **overrides) -> Stack:
        values = dict(database_url=db_url, storage_url=str(tmp_path / "storage"), shard_size=4,
                      lease_seconds=2.0, poll_interval=0.05, finalize_scan_interval=0.3,
                      completion_windows=["24h", "3s"], webhook_allow_private=True,
                      webhook_retry_delays=[0.2, 0.2, 0.2], job_collect_window=0.001)
        values.update(overrides)
        settings = Settings(**values)
        ctx = build_context(settings, db=migrated(db_url), queue=EmbeddedQueue())
        client = TestClient(create_app(context=ctx),
                            headers={"Authorization": f"Bearer {make_key(ctx.db)}"})
        stack = Stack(settings, ctx, client)
        # A node finalizer added now runs before the database fixture (set up earlier) goes.
        request.node.addfinalizer(lambda: _close(stack))
        return stack

    return make


def _close(stack: Stack) -> None:
    for worker in stack.workers:
        worker.stop()
    stack.client.close()
    stack.ctx.db.dispose()
