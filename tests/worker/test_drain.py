"""The worker end to end on a fake engine: exactly-once results, files, counts, cancel, expiry,
prefix ordering, jobs ahead of bulk, tenant fairness."""

from __future__ import annotations

import json
import threading

from fastapi.testclient import TestClient
from openai.types import Batch

from engine.testing.fake_engine import FakeEngine, StepGate
from tests.conftest_services import chat_line, make_key, wait_for
from tests.openai_shapes import check_line, error_of, strict


def custom_ids(lines: list[dict]) -> list[str]:
    return [line["custom_id"] for line in lines]


def test_batch_completes_with_every_line_once(make_stack, any_db_url):
    stack = make_stack(any_db_url)
    engine = FakeEngine()
    stack.add_worker(engine)
    good = [chat_line(f"req-{i}", f"shared system prompt; question {i}") for i in range(10)]
    bad = ['{"custom_id": "broken"', chat_line("req-3", "duplicate id")]
    too_long = chat_line("long", "TOO_LONG prompt")
    batch = stack.create_batch(good[:5] + bad + [too_long] + good[5:])
    done = stack.wait_status(batch["id"], "completed")

    output = stack.lines_of(done["output_file_id"])
    errors = stack.lines_of(done["error_file_id"])
    assert sorted(custom_ids(output)) == sorted(f"req-{i}" for i in range(10))
    # Input order; the line without a custom_id is in the batch's errors, by line number.
    assert custom_ids(errors) == ["req-3", "long"]
    assert [error_of(e)["code"] for e in errors] == [
        "duplicate_custom_id", "context_length_exceeded"]
    assert [(e["line"], e["code"]) for e in done["errors"]["data"]] == [
        (6, "invalid_json"), (7, "duplicate_custom_id")]
    assert done["request_counts"] == {"total": 13, "completed": 10, "failed": 3}
    for line in output + errors:
        check_line(line, "/v1/chat/completions")
    strict(Batch, done)
    first = output[0]
    assert first["response"]["status_code"] == 200 and first["error"] is None
    body = first["response"]["body"]
    # Answers carry the served model's id (the settings' model), the name /v1/models lists.
    assert body["object"] == "chat.completion" and body["model"] == "SmolLM2-135M-Instruct"
    assert done["model"] == "SmolLM2-135M-Instruct"
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 4
    usage = done["usage"]
    assert usage["output_tokens"] == 40
    assert usage["input_tokens"] == sum(line["response"]["body"]["usage"]["prompt_tokens"]
                                        for line in output)
    # Ten prompts share a long prefix: the fake prefix cache hits and the batch reports it.
    assert usage["input_tokens_details"]["cached_tokens"] > 0
    assert 0 < done["prefix_cache_hit_rate"] < 1
    assert done["completed_at"] >= done["finalizing_at"] >= done["in_progress_at"]
    assert len(engine.thread_ids) == 1  # one thread owns the engine


def test_lines_run_in_prefix_order(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, shard_size=100)
    engine = FakeEngine()
    stack.add_worker(engine)
    docs = ["zeta document " * 5, "alpha document " * 5, "mid document " * 5]
    lines = [chat_line(f"{d[:4]}-{i}", d + f"question {i}") for i in range(4) for d in docs]
    batch = stack.create_batch(lines)
    stack.wait_status(batch["id"], "completed")
    with stack.ctx.db.read_session() as session:
        from sqlalchemy import select

        from service.models import RequestLine

        ids = dict(session.execute(select(RequestLine.pk, RequestLine.custom_id)).all())
    order = [ids[int(rid.split("-")[1])][:4] for rid in engine.added]
    # Requests sharing a document ran together, not interleaved as in the file.
    assert order == sorted(order)


def test_cancel_stops_the_batch_and_finalizes_partial_results(make_stack, any_db_url):
    stack = make_stack(any_db_url)
    gate = StepGate()  # the engine steps when the test says
    engine = FakeEngine(max_num_seqs=2, before_step=gate.wait)
    worker = stack.add_worker(engine)
    try:
        lines = [chat_line(f"c{i}", f"text {i}", max_tokens=2) for i in range(40)]
        batch = stack.create_batch(lines)
        # Two steps: the first two lines run their two tokens, the next two are admitted.
        stack.step_settled(worker, gate, lambda: gate.num_passed == 2)
        assert stack.batch(batch["id"])["request_counts"]["completed"] == 2
        dropped = threading.Event()  # the worker saw the cancel: the drain loop will drop
        drop = worker.drainer.drop
        worker.drainer.drop = lambda predicate: (drop(predicate), dropped.set())
        assert stack.client.post(f"/v1/batches/{batch['id']}/cancel").json()["status"] in (
            "cancelling", "cancelled")
        worker.leases.wake(check=True)
        assert dropped.wait(10)
        held = engine.num_unfinished_requests  # two running, maybe one waiting (the top-up)
        # The step after the cancel was seen gives the two running lines their first token;
        # the next turn drops them, unfinished: the cancel did not wait for running lines.
        stack.step_settled(worker, gate, lambda: not engine.has_unfinished_requests())
        done = stack.wait_status(batch["id"], "cancelled", timeout=10)
    finally:
        gate.open()
    output = stack.lines_of(done["output_file_id"])
    errors = stack.lines_of(done["error_file_id"])
    assert sorted(custom_ids(output) + custom_ids(errors)) == sorted(f"c{i}" for i in range(40))
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert done["request_counts"] == {"total": 40, "completed": 2, "failed": 38}
    # The engine gave up every cancelled request it held, after one more step.
    assert held >= 2 and len(engine.aborted) == held and gate.num_passed == 3


def test_expired_batch_reports_batch_expired(make_stack, sqlite_url):
    stack = make_stack(sqlite_url)
    engine = FakeEngine(max_num_seqs=1, step_time=0.02)
    stack.add_worker(engine)
    lines = [chat_line(f"e{i}", f"slow {i}", max_tokens=20) for i in range(30)]
    batch = stack.create_batch(lines, completion_window="3s")
    done = stack.wait_status(batch["id"], "expired", timeout=15)
    assert done["expired_at"] and done["expires_at"] <= done["expired_at"]
    output = stack.lines_of(done["output_file_id"])
    errors = stack.lines_of(done["error_file_id"])
    assert sorted(custom_ids(output) + custom_ids(errors)) == sorted(f"e{i}" for i in range(30))
    assert errors and {e["error"]["code"] for e in errors} == {"batch_expired"}


def test_single_jobs_run_ahead_of_bulk_lines(make_stack, any_db_url):
    stack = make_stack(any_db_url)
    gate = StepGate()
    engine = FakeEngine(max_num_seqs=2, before_step=gate.wait)
    worker = stack.add_worker(engine)
    try:
        batch = stack.create_batch([chat_line(f"b{i}", f"bulk {i}", max_tokens=10)
                                    for i in range(80)])
        stack.step_settled(worker, gate, lambda: gate.num_passed == 10)  # two bulk lines done
        job = stack.client.post("/v1/jobs", json={"body": {
            "messages": [{"role": "user", "content": "urgent"}], "max_tokens": 3}}).json()

        def job_done() -> dict | None:
            j = stack.client.get(f"/v1/jobs/{job['id']}").json()
            return j if j["status"] == "completed" else None

        steps = stack.step_settled(worker, gate, lambda: job_done() is not None)
        result = job_done()
        completed = stack.batch(batch["id"])["request_counts"]["completed"]
    finally:
        gate.open()
    assert result["result"]["object"] == "chat.completion"
    assert result["result"]["choices"][0]["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 3
    # The job did not wait for the batch: it took the first seat a bulk line freed (within a
    # bulk line's 10 steps), then its own 3 steps, while 76 bulk lines were still to run.
    assert steps <= 1 + 10 + 3
    assert completed <= 2 + 2 * 2
    stack.wait_status(batch["id"], "completed")


def test_tenants_share_the_engine_fairly(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, shard_size=2, worker_max_shards=2)
    gate = StepGate()
    engine = FakeEngine(max_num_seqs=2, before_step=gate.wait)
    worker = stack.add_worker(engine)
    try:
        big = stack.create_batch([chat_line(f"a{i}", f"tenant a {i}") for i in range(40)])
        stack.wait_status(big["id"], "in_progress")
        other = TestClient(stack.client.app, headers={
            "Authorization": f"Bearer {make_key(stack.ctx.db, 'beta')}"})
        file_id = other.post("/v1/files", data={"purpose": "batch"}, files={"file": (
            "b.jsonl", "\n".join(json.dumps(chat_line(f"b{i}", f"tenant b {i}"))
                                 for i in range(6)))}).json()["id"]
        small = other.post("/v1/batches", json={"input_file_id": file_id,
                                                 "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"}).json()
        wait_for(lambda: other.get(f"/v1/batches/{small['id']}").json()["status"]
                 == "in_progress", 10, 0.02, "the small batch to be prepared")
        stack.step_settled(worker, gate, lambda: other.get(
            f"/v1/batches/{small['id']}").json()["status"] == "completed")
        big_done = stack.batch(big["id"])["request_counts"]["completed"]
    finally:
        gate.open()
    # Tenant b's six lines (three shards) did not queue behind all of tenant a's forty: the
    # tenants took turns, a shard each, so a finished its first shard and one per b's shard.
    assert big_done <= 8
    assert stack.wait_status(big["id"], "completed")["request_counts"]["completed"] == 40
