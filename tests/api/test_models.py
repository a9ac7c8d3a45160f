"""/v1/models and model routing at the API: what is served (configured models, models workers
announced within the TTL), OpenAI's Model shape through the official client, and the refusal
of batches and jobs naming a model nobody serves (400 on ``model``)."""

from __future__ import annotations

import datetime as dt

import openai
import pytest
from sqlalchemy import select

from service import served_models
from service.db import utcnow
from service.models import Shard
from tests.api.test_batches import make_batch
from tests.api.test_files import upload
from tests.conftest_services import chat_line, completion_line, jsonl

DEFAULT = "SmolLM2-135M-Instruct"  # the settings' default model: configured, so served


def announce(ctx, model: str, aliases=(), *, ago: float = 0.0) -> dt.datetime:
    at = utcnow() - dt.timedelta(seconds=ago)
    with ctx.db.session() as session:
        served_models.announce(session, model=model, aliases=list(aliases), now=at,
                               model_ttl=ctx.settings.model_ttl)
    return at


@pytest.fixture
def oai(client, key) -> openai.OpenAI:
    """The official client, talking to the app in process (TestClient is an httpx.Client)."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client,
                         max_retries=0)


def test_models_list_and_retrieve_with_the_openai_client(client, ctx, oai):
    seen = announce(ctx, "tiny-b", ["tiny-b.Q8_0"], ago=30)
    announce(ctx, "retired", ago=ctx.settings.model_ttl + 60)

    page = oai.models.list()
    assert [m.id for m in page.data] == [DEFAULT, "tiny-b"]  # configured first; not "retired"
    for model in page.data:
        assert isinstance(model, openai.types.Model)
        assert model.object == "model" and model.owned_by == "boxcar"
        assert isinstance(model.created, int)
    by_id = {m.id: m for m in page.data}
    assert by_id["tiny-b"].created == int(seen.timestamp())
    raw = client.get("/v1/models").json()
    assert raw["object"] == "list"
    for item in raw["data"]:  # the exact wire shape, beyond what the client tolerates
        openai.types.Model.model_validate(item, strict=True)
        assert {"id", "object", "created", "owned_by"} <= set(item)
    assert raw["data"][1]["aliases"] == ["tiny-b.Q8_0"] and raw["data"][1]["num_workers"] == 0

    assert oai.models.retrieve("tiny-b").id == "tiny-b"
    assert oai.models.retrieve("tiny-b.Q8_0").id == "tiny-b"  # an alias names the model too
    assert oai.models.retrieve(DEFAULT).id == DEFAULT
    with pytest.raises(openai.NotFoundError) as missing:
        oai.models.retrieve("retired")
    assert "not served" in missing.value.message and "tiny-b" in missing.value.message


def test_models_need_a_key(app):
    from fastapi.testclient import TestClient

    with TestClient(app) as anonymous:
        assert anonymous.get("/v1/models").status_code == 401


def test_unserved_model_is_refused_at_create(client, ctx):
    response = make_batch(client, [chat_line("a", "x", model="gpt-4o-mini"),
                                   chat_line("b", "y", model="gpt-4o-mini")])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert "'gpt-4o-mini'" in error["message"] and DEFAULT in error["message"]

    inline = client.post("/v1/batches", json={
        "endpoint": "/v1/completions", "completion_window": "24h",
        "requests": [{"custom_id": "a", "url": "/v1/completions",
                      "body": {"model": "NonExistModel", "prompt": "hi"}}]})
    assert inline.status_code == 400 and inline.json()["error"]["param"] == "model"

    job = client.post("/v1/jobs", json={"body": {
        "model": "NonExistModel", "messages": [{"role": "user", "content": "hi"}]}})
    assert job.status_code == 400, job.text
    assert job.json()["error"]["param"] == "model"
    assert DEFAULT in job.json()["error"]["message"]
    # Nothing was queued for any worker.
    assert ctx.queue.batches == [] and ctx.queue.shards == []
    assert client.get("/v1/batches").json()["data"] == []
    assert client.get("/v1/jobs").json()["data"] == []


def test_batches_and_jobs_carry_the_model_they_name(client, ctx):
    announce(ctx, "tiny-b", ["tiny-b.Q8_0"])
    by_alias = make_batch(client, [chat_line("a", "x", model="tiny-b.Q8_0")])
    assert by_alias.status_code == 200, by_alias.text
    assert by_alias.json()["model"] == "tiny-b"
    unnamed = make_batch(client, [chat_line("a", "x")])
    assert unnamed.json()["model"] == DEFAULT  # no line names one: the default model

    job = client.post("/v1/jobs", json={"body": {
        "model": "tiny-b", "prompt": "Once", "max_tokens": 2}})
    assert job.status_code == 200, job.text
    assert job.json()["model"] == "tiny-b"
    assert ctx.queue.models == ["tiny-b"]  # rung on tiny-b's queue
    with ctx.db.read_session() as session:
        shard = session.scalars(select(Shard).where(Shard.job_id == job.json()["id"])).one()
        assert shard.model == "tiny-b"


def test_a_model_stays_served_for_the_ttl_after_its_last_worker(client, ctx):
    ttl = ctx.settings.model_ttl
    announce(ctx, "restarting", ago=ttl - 60)  # its workers went away a while ago
    announce(ctx, "long-gone", ago=ttl + 60)
    assert make_batch(client, [chat_line("a", "x", model="restarting")]).status_code == 200
    gone = make_batch(client, [chat_line("a", "x", model="long-gone")])
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "model"
    announce(ctx, "long-gone")  # a worker of it started again
    assert make_batch(client, [chat_line("a", "x", model="long-gone")]).status_code == 200


def test_configured_models_are_served_before_any_worker(client, ctx, settings):
    ctx.settings = settings.model_copy(update={"models": ["/models/big-a.gguf", "small-b"]})
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == ["big-a", "small-b"]  # the settings' own model is no longer the deployment's
    listed = client.get("/v1/models/big-a.gguf").json()  # the file name is an alias
    assert listed["id"] == "big-a" and listed["aliases"] == ["big-a.gguf"]
    assert make_batch(client, [chat_line("a", "x")]).json()["model"] == "big-a"  # the first
    assert make_batch(client, [chat_line("a", "x", model="small-b")]).json()["model"] == "small-b"
    refused = make_batch(client, [chat_line("a", "x", model=DEFAULT)])
    assert refused.status_code == 400 and "big-a, small-b" in refused.json()["error"]["message"]


def test_an_alias_of_two_models_is_ambiguous(client, ctx):
    announce(ctx, "a-q4", ["shared-stem"])
    announce(ctx, "a-q8", ["shared-stem"])
    response = make_batch(client, [chat_line("a", "x", model="shared-stem")])
    assert response.status_code == 400
    assert "ambiguous" in response.json()["error"]["message"]
    assert client.get("/v1/models/shared-stem").status_code == 404
    assert make_batch(client, [chat_line("a", "x", model="a-q8")]).json()["model"] == "a-q8"


def test_lines_naming_another_model_are_line_errors_at_upload(client):
    lines = [chat_line("a", "x", model="m1"), chat_line("b", "y"),
             completion_line("c", "z", model="m2"), chat_line("d", "w", model="m1")]
    file = upload(client, jsonl(lines)).json()
    assert file["error_count"] == 1
    [error] = file["line_errors"]
    assert error["line"] == 3 and error["code"] == "model_mismatch"
    assert error["custom_id"] == "c"
    assert "'m2'" in error["message"] and "'m1'" in error["message"]
