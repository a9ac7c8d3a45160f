"""Model routing in the worker: a worker claims only its model's shards and jobs, so two
workers serving two models in one deployment each answer exactly their model's lines; work for
a model with no live worker waits for one instead of running elsewhere."""

from __future__ import annotations

import time

from sqlalchemy import select, update

from engine.testing.fake_engine import FakeEngine
from service.db import utcnow
from service.models import RequestLine, Shard
from tests.conftest_services import chat_line, completion_line, wait_for
from tests.openai_shapes import error_of
from worker import claims
from worker.prepare import prepare_batch


def two_model_stack(make_stack, db_url):
    return make_stack(db_url, models=["model-a", "model-b"])


def test_each_model_runs_only_its_own_lines(make_stack, any_db_url):
    stack = two_model_stack(make_stack, any_db_url)
    engine_a, engine_b = FakeEngine(), FakeEngine()
    worker_a = stack.add_worker(engine_a, model="model-a")
    worker_b = stack.add_worker(engine_b, model="model-b")
    batch_a = stack.create_batch([chat_line(f"a-{i}", f"alpha {i}", model="model-a")
                                  for i in range(9)])
    batch_b = stack.create_batch([chat_line(f"b-{i}", f"beta {i}", model="model-b")
                                  for i in range(9)])
    batch_default = stack.create_batch([chat_line(f"d-{i}", f"delta {i}") for i in range(5)])
    jobs = [stack.client.post("/v1/jobs", json={"body": {
        "model": model, "prompt": f"job for {model}", "max_tokens": 3}}).json()
        for model in ("model-a", "model-b")]
    assert [batch_a["model"], batch_b["model"], batch_default["model"]] == [
        "model-a", "model-b", "model-a"]  # no model named: the first configured one

    expected = {batch_a["id"]: "model-a", batch_b["id"]: "model-b",
                batch_default["id"]: "model-a"}
    for batch_id, model in expected.items():
        done = stack.wait_status(batch_id, "completed")
        output = stack.lines_of(done["output_file_id"])
        assert {line["response"]["body"]["model"] for line in output} == {model}
        assert done["request_counts"]["completed"] == len(output)
    for job in jobs:
        done = wait_for(lambda j=job: (r := stack.client.get(f"/v1/jobs/{j['id']}").json())[
            "status"] == "completed" and r, 30, 0.05, "the job")
        assert done["result"]["model"] == job["model"]

    by_worker = {worker_a.worker_id: "model-a", worker_b.worker_id: "model-b"}
    with stack.ctx.db.read_session() as session:
        rows = session.execute(
            select(RequestLine.worker_id, Shard.model).join(Shard, Shard.id == RequestLine.shard_id)
        ).all()
    assert len(rows) == 9 + 9 + 5 + 2
    assert all(by_worker[worker] == model for worker, model in rows)  # never another model
    # Each engine saw only its model's prompts.
    assert len(engine_a.added) == 9 + 5 + 1 and len(engine_b.added) == 9 + 1

    served = stack.client.get("/v1/models").json()["data"]
    assert [(m["id"], m["num_workers"]) for m in served] == [("model-a", 1), ("model-b", 1)]


def test_work_for_a_model_without_a_live_worker_waits_for_one(make_stack, any_db_url):
    stack = two_model_stack(make_stack, any_db_url)
    engine_a = FakeEngine()
    stack.add_worker(engine_a, model="model-a")
    batch = stack.create_batch([completion_line(f"b-{i}", f"beta {i}", model="model-b")
                                for i in range(6)], endpoint="/v1/completions")
    stack.wait_status(batch["id"], "in_progress")
    time.sleep(1.0)  # many lease rounds of the model-a worker
    assert stack.batch(batch["id"])["request_counts"]["completed"] == 0
    assert engine_a.added == []
    stack.add_worker(FakeEngine(), model="model-b")
    done = stack.wait_status(batch["id"], "completed")
    assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}


def test_a_line_naming_another_model_fails_alone(make_stack, any_db_url):
    stack = two_model_stack(make_stack, any_db_url)
    stack.add_worker(FakeEngine(), model="model-a")
    stack.add_worker(FakeEngine(), model="model-b")
    lines = [chat_line("a-1", "x", model="model-b"), chat_line("a-2", "y"),
             chat_line("a-3", "z", model="model-a"), chat_line("a-4", "w", model="model-b")]
    done = stack.wait_status(stack.create_batch(lines)["id"], "completed")
    assert done["model"] == "model-b"
    errors = stack.lines_of(done["error_file_id"])
    assert [(e["custom_id"], error_of(e)["code"]) for e in errors] == [
        ("a-3", "model_mismatch")]
    assert "'model-a'" in error_of(errors[0])["message"]
    output = stack.lines_of(done["output_file_id"])
    assert sorted(line["custom_id"] for line in output) == ["a-1", "a-2", "a-4"]
    assert {line["response"]["body"]["model"] for line in output} == {"model-b"}


def test_claims_filter_by_model(make_stack, any_db_url):
    """find_candidates and try_claim directly: a worker sees and takes only its model's shards
    (and shards from before routing, whose model is NULL)."""
    stack = two_model_stack(make_stack, any_db_url)  # no worker: nothing claims behind our back
    job_ids = {}
    for model in ("model-a", "model-b", "model-a"):
        job = stack.client.post("/v1/jobs", json={"body": {"model": model, "prompt": "p"}})
        job_ids.setdefault(model, []).append(job.json()["id"])
    batch = stack.create_batch([chat_line(f"b-{i}", "x", model="model-b") for i in range(6)])
    assert prepare_batch(stack.ctx.db, stack.ctx.storage, batch["id"], worker_id="prep",
                         shard_size=4)
    legacy = job_ids["model-a"][1]
    with stack.ctx.db.session() as session:
        session.execute(update(Shard).where(Shard.job_id == legacy).values(model=None))

    def candidates(model: str) -> list[str]:
        with stack.ctx.db.read_session() as session:
            found = claims.find_candidates(session, now=utcnow(), max_bulk=8, max_jobs=8,
                                           model=model)
        return sorted(c.id for c in found)

    job_a, job_b = f"{job_ids['model-a'][0]}:0", f"{job_ids['model-b'][0]}:0"
    bulk_b = [f"{batch['id']}:0", f"{batch['id']}:1"]
    assert candidates("model-a") == sorted([job_a, f"{legacy}:0"])
    assert candidates("model-b") == sorted([job_b, f"{legacy}:0", *bulk_b])
    for shard_id in (job_b, bulk_b[0]):
        with stack.ctx.db.session() as session:
            assert claims.try_claim(session, shard_id, worker_id="wa", lease_seconds=5,
                                    model="model-a") is None
        with stack.ctx.db.session() as session:
            claim = claims.try_claim(session, shard_id, worker_id="wb", lease_seconds=5,
                                     model="model-b")
            assert claim is not None and claim.lines


def test_celery_doorbells_go_to_the_model_queues():
    """The API rings a shard's model's queue; a worker consumes its model's queues and the
    shared control queue only."""
    from service.queue import CeleryQueue
    from service.settings import Settings
    from worker.celery_app import celery_config

    config = celery_config(Settings(broker_url="redis://localhost:1/0", queue_namespace="ns",
                                    model="/models/Qwen 2.5/q.gguf"))
    assert sorted(q.name for q in config["task_queues"]) == ["ns.bulk.q", "ns.control", "ns.jobs.q"]
    named = celery_config(Settings(broker_url="redis://localhost:1/0", queue_namespace="ns",
                                   served_model_name="org/model:v1"))
    assert sorted(q.name for q in named["task_queues"]) == [
        "ns.bulk.org_model_v1", "ns.control", "ns.jobs.org_model_v1"]

    sent: list[tuple[str, list, str]] = []

    class App:
        def send_task(self, name, args, queue):
            sent.append((name, args, queue))

    queue = CeleryQueue.__new__(CeleryQueue)
    queue._app, queue._namespace = App(), "ns"
    queue.shards_ready(["b:0", "b:1"], model="q")
    queue.shards_ready(["job_1:0"], model="org/model:v1", jobs=True)
    queue.shards_ready(["old:0"], model=None)  # from before routing: polling finds it
    queue.batch_changed("b")
    assert [(args[0], q) for _, args, q in sent] == [
        ("b:0", "ns.bulk.q"), ("b:1", "ns.bulk.q"), ("job_1:0", "ns.jobs.org_model_v1"),
        ("b", "ns.control")]
