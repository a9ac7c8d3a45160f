"""Two models in one deployment: the embedded service's worker loads one tiny random-weight
model, a second worker beside it (same database, storage and queue) loads another of a different
architecture and size. Through the official openai client: /v1/models lists both, each batch and
job runs on the model its lines name (the response's ``model`` and its greedy text, compared
with the model run offline), a line naming the other model fails alone, and a batch naming a
model nobody serves is refused at create."""

from __future__ import annotations

import json

import openai
import pytest
from sqlalchemy import create_engine, text

from cli.embedded import EmbeddedServer
from service.settings import Settings
from tests.conftest import make_checkpoint
from tests.conftest_services import completion_line, free_port, jsonl, wait_for
from tests.openai_shapes import error_of
from tests.system.conftest import ENGINE_OPTIONS
from worker.process import WorkerService

PROMPTS = [f"Batch inference {i}: the quick brown fox" for i in range(6)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-models")
    small = make_checkpoint(root / "tiny-a", "llama", seed=1)
    big = make_checkpoint(root / "tiny-b", "qwen2", seed=2, hidden_size=96, intermediate_size=192,
                          num_attention_heads=6, num_key_value_heads=2)
    return {"tiny-a": str(small), "tiny-b": str(big)}


def offline_texts(model_dir: str) -> list[str]:
    from engine import LLM, SamplingParams

    llm = LLM(model=model_dir, **ENGINE_OPTIONS)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True))
    return [out.text for out in outputs]


@pytest.fixture
def deployment(tmp_path, two_models):
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'boxcar.db'}", storage_url=str(tmp_path / "storage"),
        model=two_models["tiny-a"], models=["tiny-a", "tiny-b"], engine_options=ENGINE_OPTIONS,
        shard_size=4, poll_interval=0.1, finalize_scan_interval=1.0,
    )
    server = EmbeddedServer(settings, port=free_port()).start()
    second = WorkerService(settings.model_copy(update={"model": two_models["tiny-b"]}),
                           db=server.worker.db, storage=server.worker.storage,
                           queue=server.worker.queue)
    try:
        second.start()
        yield server, second
    finally:
        second.stop()
        server.stop()


def test_two_models_in_one_deployment(deployment, two_models):
    server, second = deployment
    expected = {name: offline_texts(path) for name, path in two_models.items()}
    assert expected["tiny-a"] != expected["tiny-b"]  # the two models answer differently
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                           max_retries=0)

    listed = client.models.list().data
    assert [m.id for m in listed] == ["tiny-a", "tiny-b"]
    assert all(m.object == "model" and m.owned_by == "boxcar" for m in listed)
    wait_for(lambda: [m.model_extra["num_workers"] for m in client.models.list().data] == [1, 1],
             30, 0.2, "both workers in /v1/models")
    assert client.models.retrieve("tiny-b").id == "tiny-b"

    def submit(lines) -> str:
        file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        return client.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                                     completion_window="24h").id

    def line(model: str | None, i: int, tag: str) -> dict:
        extra = {"model": model} if model else {}
        return completion_line(f"{tag}-{i}", PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                               ignore_eos=True, **extra)

    batches = {
        submit([line("tiny-b", i, "b") for i in range(6)]): "tiny-b",
        submit([line("tiny-a", i, "a") for i in range(6)]): "tiny-a",
        submit([line(None, i, "d") for i in range(6)]): "tiny-a",  # the first configured model
        # A line naming the other model fails alone (OpenAI: one model per batch).
        submit([line("tiny-b", 0, "m"), line("tiny-a", 1, "m"), line("tiny-b", 2, "m")]):
            "tiny-b",
    }
    job = client.post("/jobs", cast_to=object, body={"body": {
        "model": "tiny-b", "prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True}})
    with pytest.raises(openai.BadRequestError) as refused:
        submit([line("gpt-4o-mini", 0, "x")])
    assert refused.value.body["param"] == "model"
    assert "tiny-a, tiny-b" in refused.value.message

    for batch_id, model in batches.items():
        done = wait_for(lambda b=batch_id: (r := client.batches.retrieve(b)).status in (
            "completed", "failed") and r, 180, 0.2, f"batch {batch_id}")
        assert done.status == "completed" and done.model == model
        output = [json.loads(x) for x in
                  client.files.content(done.output_file_id).text.splitlines()]
        for answer in output:
            i = int(answer["custom_id"].rsplit("-", 1)[1])
            body = answer["response"]["body"]
            assert body["model"] == model
            assert body["choices"][0]["text"] == expected[model][i], answer["custom_id"]
        if done.error_file_id:
            errors = [json.loads(x) for x in
                      client.files.content(done.error_file_id).text.splitlines()]
            assert [(e["custom_id"], error_of(e)["code"]) for e in errors] == [
                ("m-1", "model_mismatch")]
    job_done = wait_for(
        lambda: (r := client.get(f"/jobs/{job['id']}", cast_to=object))["status"] == "completed"
        and r, 60, 0.2, "the job")
    assert job_done["result"]["model"] == "tiny-b"
    assert job_done["result"]["choices"][0]["text"] == expected["tiny-b"][3]

    # Every line was written by the worker of its model.
    by_worker = {server.worker.worker_id: "tiny-a", second.worker_id: "tiny-b"}
    with server.worker.db.engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT request_lines.worker_id, shards.model FROM request_lines "
            "JOIN shards ON shards.id = request_lines.shard_id")).all()
    assert len(rows) == 6 * 3 + 2 + 1
    assert all(by_worker[worker] == model for worker, model in rows)


def test_two_models_on_celery_with_a_restarting_worker(production, two_models):
    """Production (PostgreSQL, Redis + Celery, S3): per-model queues. A model whose only worker
    died is still served (its TTL): its batch is accepted and its shards wait in its own queue,
    untouched by the other model's worker, until a worker of it starts again."""
    import httpx
    import redis

    from tests.conftest_services import REDIS_URL

    namespace = production.env["BOXCAR_QUEUE_NAMESPACE"]
    client = httpx.Client(base_url=production.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {production.api_key}"})
    production.start_worker("wa", env={"BOXCAR_MODEL": two_models["tiny-a"]})
    production.start_worker("wb", env={"BOXCAR_MODEL": two_models["tiny-b"]})
    production.kill_worker("wb")  # crashed, or restarting: tiny-b stays served for the TTL
    served = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert {"tiny-a", "tiny-b"} <= set(served)

    def submit(model: str, tag: str) -> str:
        lines = [completion_line(f"{tag}-{i}", PROMPTS[i], max_tokens=MAX_TOKENS,
                                 temperature=0, ignore_eos=True, model=model) for i in range(6)]
        file_id = client.post("/v1/files", data={"purpose": "batch"},
                              files={"file": ("in.jsonl", jsonl(lines))}).json()["id"]
        response = client.post("/v1/batches", json={
            "input_file_id": file_id, "endpoint": "/v1/completions",
            "completion_window": "24h"})
        assert response.status_code == 200, response.text
        return response.json()["id"]

    batch_b = submit("tiny-b", "b")
    batch_a = submit("tiny-a", "a")
    refused = client.post("/v1/jobs", json={"body": {"model": "NonExistModel", "prompt": "x"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"

    def batch(batch_id: str) -> dict:
        return client.get(f"/v1/batches/{batch_id}").json()

    wait_for(lambda: batch(batch_a)["status"] == "completed", 120, 0.2, "tiny-a's batch")
    queued_b = batch(batch_b)
    assert queued_b["status"] == "in_progress"  # prepared by wa, but not run by it
    assert queued_b["request_counts"]["completed"] == 0
    bell = redis.Redis.from_url(REDIS_URL)
    assert bell.llen(f"{namespace}.bulk.tiny-b") >= 1  # its doorbells wait in tiny-b's queue

    production.start_worker("wb2", env={"BOXCAR_MODEL": two_models["tiny-b"]})
    wait_for(lambda: batch(batch_b)["status"] == "completed", 120, 0.2, "tiny-b's batch")
    for batch_id, model in ((batch_a, "tiny-a"), (batch_b, "tiny-b")):
        done = batch(batch_id)
        assert done["model"] == model and done["request_counts"]["completed"] == 6
        output = [json.loads(x) for x in client.get(
            f"/v1/files/{done['output_file_id']}/content").text.splitlines()]
        assert {line["response"]["body"]["model"] for line in output} == {model}
    engine = create_engine(production.db_url)
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT DISTINCT request_lines.worker_id, shards.model FROM request_lines "
            "JOIN shards ON shards.id = request_lines.shard_id "
            "WHERE shards.batch_id IN (:a, :b)"), {"a": batch_a, "b": batch_b}).all()
    engine.dispose()
    models_of = {}
    for worker_id, model in rows:
        models_of.setdefault(worker_id, set()).add(model)
    assert sorted(m for ms in models_of.values() for m in ms) == ["tiny-a", "tiny-b"]  # one each
