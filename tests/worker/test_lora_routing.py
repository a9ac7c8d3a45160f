"""LoRA adapters in the service: listed in /v1/models with their base as parent, a batch or a
job naming one goes to the base model's workers and runs under the adapter, lines of batches on
different adapters share one engine, an unknown adapter is refused at create, and an adapter
given as an object-storage key is downloaded once."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from engine.testing.fake_engine import FakeEngine
from service.models import RequestLine, Shard
from service.storage import LocalStorage, put_bytes
from tests.conftest_services import chat_line, wait_for
from tests.openai_shapes import error_of
from worker.lora_files import local_lora_modules

BASE = "SmolLM2-135M-Instruct"
ADAPTERS = {"engine_options": {"lora_modules": ["fr-support=/adapters/fr", "legal=s3key/legal"]}}


def lora_engine() -> FakeEngine:
    engine = FakeEngine()
    engine.lora_names = ["fr-support", "legal"]
    return engine


def test_adapters_are_listed_with_their_parent(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, **ADAPTERS)
    data = stack.client.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [
        (BASE, None), ("fr-support", BASE), ("legal", BASE)]
    assert stack.client.get("/v1/models/legal").json()["parent"] == BASE


def test_unknown_adapter_is_refused_at_create(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, **ADAPTERS)
    file_id = stack.upload([chat_line("a", "x", model="de-support")])
    response = stack.client.post("/v1/batches", json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model"
    assert f"served models: {BASE}, fr-support, legal" in error["message"]


def test_adapter_batches_and_jobs_run_on_the_base_workers(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, **ADAPTERS)
    engine = lora_engine()
    stack.add_worker(engine)
    batches = {
        "fr-support": stack.create_batch([chat_line(f"f{i}", f"bonjour {i}", model="fr-support")
                                          if i % 2 else chat_line(f"f{i}", f"bonjour {i}")
                                          for i in range(6)]),
        "legal": stack.create_batch([chat_line(f"l{i}", f"clause {i}", model="legal")
                                     for i in range(5)]),
        BASE: stack.create_batch([chat_line(f"b{i}", f"base {i}") for i in range(4)]),
    }
    job = stack.client.post("/v1/jobs", json={"body": {
        "model": "legal", "prompt": "a job", "max_tokens": 3}}).json()
    assert job["model"] == "legal"
    for model, batch in batches.items():
        assert batch["model"] == model
        done = stack.wait_status(batch["id"], "completed")
        output = stack.lines_of(done["output_file_id"])
        assert {line["response"]["body"]["model"] for line in output} == {model}
    finished = wait_for(lambda: (r := stack.client.get(f"/v1/jobs/{job['id']}").json())[
        "status"] == "completed" and r, 30, 0.05, "the job")
    assert finished["result"]["model"] == "legal"
    with stack.ctx.db.read_session() as session:
        assert set(session.scalars(select(Shard.model))) == {BASE}  # all on the base's queue
        rows = session.execute(select(RequestLine.batch_id, RequestLine.engine_fields)).all()
    for batch_id, fields in rows:
        model = next((m for m, b in batches.items() if b["id"] == batch_id), "legal")
        assert fields.get("lora_name") == (None if model == BASE else model)
    used = sorted(name or "" for name in engine.loras.values())
    assert used.count("fr-support") == 6 and used.count("legal") == 6 and used.count("") == 4


def test_a_line_whose_adapter_the_worker_lacks_fails_alone(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, **ADAPTERS)
    engine = FakeEngine()
    engine.lora_names = ["fr-support"]  # this worker could not register 'legal'
    stack.add_worker(engine)
    legal = stack.create_batch([chat_line(f"l{i}", "x", model="legal") for i in range(3)])
    base = stack.create_batch([chat_line(f"b{i}", "y") for i in range(3)])
    done = stack.wait_status(legal["id"], "completed")
    errors = stack.lines_of(done["error_file_id"])
    assert len(errors) == 3
    for line in errors:
        error = error_of(line)
        assert error["code"] == "invalid_value" and "LoRA adapter 'legal'" in error["message"]
    assert stack.wait_status(base["id"], "completed")["request_counts"]["completed"] == 3


def test_object_storage_adapter_is_downloaded_once(tmp_path):
    storage = LocalStorage(str(tmp_path / "objects"))
    put_bytes(storage, "adapters/legal/adapter_config.json", b'{"r": 4}')
    put_bytes(storage, "adapters/legal/adapter_model.safetensors", b"weights")
    local = tmp_path / "local"
    local.mkdir()
    cache = tmp_path / "cache"
    entries = ["legal=adapters/legal", f"here={local}"]
    resolved = local_lora_modules(entries, storage, cache)
    name, folder = resolved[0].split("=", 1)
    assert name == "legal" and resolved[1] == f"here={local}"
    assert (tmp_path / "cache").exists()
    assert (Path(folder) / "adapter_model.safetensors").read_bytes() == b"weights"
    storage.delete("adapters/legal/adapter_model.safetensors")  # a second start reads the cache
    assert local_lora_modules(entries, storage, cache) == resolved
    with pytest.raises(ValueError, match="'gone'.*holding adapter_config.json"):
        local_lora_modules(["gone=adapters/none"], storage, cache)


def test_only_a_worker_serving_the_adapter_prepares_its_batch(make_stack, sqlite_url):
    # Found by the chaos run (bench/chaos.py): an embedding model's worker, whose settings name
    # no adapter, prepared an adapter's batch into shards queued under the adapter's name
    # (no worker consumes that queue) with lines that did not carry the adapter.
    from worker.prepare import prepare_batch

    stack = make_stack(sqlite_url, models=[BASE, "embedder"], **ADAPTERS)
    batch = stack.create_batch([chat_line(f"l{i}", f"clause {i}", model="legal")
                                for i in range(5)])
    assert prepare_batch(stack.ctx.db, stack.ctx.storage, batch["id"], worker_id="embedder-1",
                         shard_size=4, adapters={}, models={BASE, "embedder"}) is None
    assert stack.client.get(f"/v1/batches/{batch['id']}").json()["status"] == "validating"
    other = stack.add_worker(FakeEngine(), model="embedder", engine_options={})
    assert other.housekeeper.models == {BASE, "embedder"}
    engine = lora_engine()
    worker = stack.add_worker(engine)
    assert worker.housekeeper.models == {BASE, "embedder", "fr-support", "legal"}
    done = stack.wait_status(batch["id"], "completed")
    assert {line["response"]["body"]["model"] for line in stack.lines_of(
        done["output_file_id"])} == {"legal"}
    with stack.ctx.db.read_session() as session:
        assert set(session.scalars(select(Shard.model))) == {BASE}
    assert sorted(engine.loras.values()) == ["legal"] * 5
