"""Engine-ready fields: a line's body is validated once, when it is stored, into
``engine_fields``; the drain loop builds the same engine input (or the same error) from them as
from the body, without parsing it again."""

from __future__ import annotations

import dataclasses
import json

import pytest
from sqlalchemy import select

from engine.testing.fake_engine import FakeEngine
from openai_format.engine_fields import engine_fields
from pipeline import engine_adapter
from pipeline.engine_adapter import (
    EngineInput,
    PrepareError,
    parse_body,
    prepare,
    prepare_fields,
)
from service.models import RequestLine, Shard
from tests.conftest_services import chat_line, wait_for
from tests.worker.test_request_pipeline import ADD, WEATHER, make_engine
from worker import claims
from worker.drain import Drainer
from worker.items import LineResult, LineWork
from worker.prepare import prepare_batch

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BODIES = [
    (CHAT, {"messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": "Hi"}], "max_tokens": 5, "seed": 3,
            "temperature": 0.5, "stop": ["\n"], "logprobs": True, "top_logprobs": 2}),
    (CHAT, {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER, ADD],
            "tool_choice": "required", "max_tokens": 8}),
    (CHAT, {"messages": [{"role": "user", "content": "Add"}], "tools": [WEATHER, ADD],
            "tool_choice": {"type": "function", "function": {"name": "add"}}}),
    (CHAT, {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}),
    (CHAT, {"messages": [{"role": "user", "content": "JSON"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                        "required": ["a"]}}}}),
    (CHAT, {"messages": [{"role": "user", "content": "bias"}], "logit_bias": {"5": 100,
                                                                               "7": -100}}),
    (COMPLETIONS, {"prompt": "Once upon", "max_tokens": 3, "logprobs": 1, "n": 2}),
    (COMPLETIONS, {"prompt": [[1, 2, 3]], "max_tokens": 3}),
    (COMPLETIONS, {"prompt": [1, 2, 10**6], "max_tokens": 3}),  # a token outside the vocabulary
    (COMPLETIONS, {"prompt": "x " * 600, "max_tokens": 3}),  # longer than the context
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.mark.parametrize(("endpoint", "body"), BODIES)
def test_stored_fields_give_the_bodys_engine_input(engine, endpoint, body):
    request = parse_body(endpoint, body)
    stored = json.loads(json.dumps(engine_fields(request)))  # as the JSON column gives it back
    assert prepare_fields(engine, stored) == prepare(engine, endpoint, body)


def test_prepare_stores_the_fields_and_the_drain_never_parses_a_body(make_stack, sqlite_url,
                                                                      monkeypatch):
    stack = make_stack(sqlite_url)
    batch = stack.create_batch([chat_line("a", "hello", temperature=0.2),
                                chat_line("b", "once"), chat_line("a", "again")])
    assert prepare_batch(stack.ctx.db, stack.ctx.storage, batch["id"], worker_id="prep",
                         shard_size=4)
    with stack.ctx.db.read_session() as session:
        rows = session.scalars(select(RequestLine).order_by(RequestLine.line_no)).all()
    assert rows[0].engine_fields["sampling"]["temperature"] == 0.2
    assert rows[1].engine_fields["messages"] == [{"role": "user", "content": "once"}]
    # The repeated custom_id fails at prepare and keeps its custom_id on its row.
    assert (rows[2].status, rows[2].custom_id, rows[2].engine_fields) == ("failed", "a", None)

    def no_parsing(*args, **kwargs):
        raise AssertionError("the drain loop parsed a stored body")

    monkeypatch.setattr(engine_adapter, "parse_body", no_parsing)
    stack.add_worker(FakeEngine())
    job = stack.client.post("/v1/jobs", json={"body": {"prompt": "job", "max_tokens": 2}}).json()
    done = stack.wait_status(batch["id"], "completed", timeout=30)
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert [e["custom_id"] for e in stack.lines_of(done["error_file_id"])] == ["a"]
    assert sorted(o["custom_id"] for o in stack.lines_of(done["output_file_id"])) == ["a", "b"]
    wait_for(lambda: stack.client.get(f"/v1/jobs/{job['id']}").json()["status"] == "completed",
             20, 0.05, "the job")


# --- one typed hop: prepare writes EngineFields, the claimed row gives them back, the drain
# builds its input from them --------------------------------------------------------------------

ADAPTERS = {"engine_options": {"lora_modules": ["fr-support=/adapters/fr"]}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# custom_id -> (endpoint, body, the adapter the line runs under)
ROUND_TRIP = {
    "chat": (CHAT, {"messages": [{"role": "user", "content": "Weather?"}],
                    "tools": [WEATHER, ADD], "tool_choice": "required",
                    "max_completion_tokens": 6, "max_tokens": 9, "logit_bias": {"5": 10}}, None),
    "completions": (COMPLETIONS, {"prompt": [1, 2, 3], "seed": 2}, None),  # max_tokens: 16
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 5, "text": {
        "format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}}, None),
    "embeddings": ("/v1/embeddings", {"input": ["a", "bc"], "encoding_format": "base64"},
                   None),
    "lora": (CHAT, {"model": "fr-support", "messages": [{"role": "user", "content": "salut"}],
                    "temperature": 0}, "fr-support"),
}


def _claimed(stack, batch_id: str) -> list[LineWork]:
    with stack.ctx.db.session() as session:
        shard_ids = session.scalars(select(Shard.id).where(Shard.batch_id == batch_id)).all()
        claimed = [claims.try_claim(session, sid, worker_id="w", lease_seconds=60)
                   for sid in shard_ids]
    return [work for claim in claimed if claim is not None for work in claim.lines]


def test_engine_fields_round_trip_from_prepare_to_the_drains_input(make_stack, any_db_url):
    """Each kind of line, and a line on a LoRA adapter: the fields prepare stores (as JSON on
    SQLite, as COPY text on PostgreSQL) come back from the claimed row equal to
    ``engine_fields`` of the parsed body, the drain's input built from them equals the one
    ``prepare`` builds from the body (the adapter added), and the drain answers from them."""
    stack = make_stack(any_db_url, **ADAPTERS)  # no worker: the test claims the shards itself
    generator = FakeEngine()
    generator.lora_names = ["fr-support"]
    embedder = FakeEngine(is_embedding=True)
    for custom_id, (endpoint, body, lora) in ROUND_TRIP.items():
        line = {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}
        batch = stack.create_batch([line], endpoint=endpoint)
        assert prepare_batch(stack.ctx.db, stack.ctx.storage, batch["id"], worker_id="prep",
                             shard_size=4, adapters={"fr-support": "SmolLM2-135M-Instruct"})
        (work,) = _claimed(stack, batch["id"])
        request = parse_body(endpoint, body)
        assert not isinstance(request, PrepareError)
        assert work.engine_fields == engine_fields(request, lora=lora)
        assert (work.engine_fields or {}).get("lora_name") == lora
        engine = embedder if endpoint == "/v1/embeddings" else generator
        drain_input = prepare_fields(engine, work.engine_fields)
        from_body = prepare(engine, endpoint, body)
        assert not isinstance(from_body, PrepareError), from_body
        assert drain_input == dataclasses.replace(from_body, lora_name=lora)

        results: list[LineResult] = []
        drainer = Drainer(engine, submit=results.append, model_name="base", max_num_seqs=2,
                          max_num_batched_tokens=64)
        drainer.add([dataclasses.replace(work, body={})], is_job=False)  # the fields alone
        while drainer.turn():
            pass
        (result,) = results
        assert result.status == "completed", result.error
        assert result.response is not None and result.response["model"] == (lora or "base")
        assert engine.loras[work.engine_request_id] == lora
        if endpoint == "/v1/embeddings":  # its stored encoding_format: base64 text
            assert [type(d["embedding"]) for d in result.response["data"]] == [str, str]
    chat_input = prepare(generator, CHAT, ROUND_TRIP["chat"][1])
    assert not isinstance(chat_input, PrepareError)
    assert chat_input.params.max_tokens == 6 and chat_input.params.logit_bias == {5: 10.0}
    completion = prepare(generator, COMPLETIONS, ROUND_TRIP["completions"][1])
    assert not isinstance(completion, PrepareError) and completion.params.max_tokens == 16


# Rows an earlier version stored (0005_scale on): literal JSON, so a change of the writer that
# would leave them unreadable fails here.
OLD_ROWS = [
    (CHAT, {"messages": [{"role": "user", "content": "Weather?"}],
            "tools": [WEATHER, ADD], "tool_choice": {"type": "function",
                                                     "function": {"name": "add"}},
            "max_tokens": 8, "logit_bias": {"5": 10}},
     {"sampling": {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": None, "min_p": 0.0,
                   "seed": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "repetition_penalty": 1.0, "stop": [], "stop_token_ids": [],
                   "max_tokens": 8, "min_tokens": 0, "ignore_eos": False, "logprobs": None,
                   "logit_bias": [[5, 10.0]],
                   "structured_output": {"json_schema": ADD["function"]["parameters"],
                                         "strict": True}},
      "format_field": "body.tools[].function.parameters",
      "messages": [{"role": "user", "content": "Weather?"}],
      "tools": [WEATHER, ADD], "tool_mode": "named", "tool_name": "add",
      "lora_name": "fr-support"}),
    (COMPLETIONS, {"prompt": "Once", "max_tokens": 3},
     {"sampling": {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": None, "min_p": 0.0,
                   "seed": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "repetition_penalty": 1.0, "stop": [], "stop_token_ids": [],
                   "max_tokens": 3, "min_tokens": 0, "ignore_eos": False, "logprobs": None,
                   "logit_bias": None, "structured_output": None},
      "prompt": "Once"}),
    ("/v1/embeddings", {"input": "x", "dimensions": 4},
     {"embedding": {"input": ["x"], "encoding_format": "float", "dimensions": 4}}),
]


@pytest.mark.parametrize(("endpoint", "body", "stored"), OLD_ROWS)
def test_rows_stored_by_the_previous_version_read_as_before(endpoint, body, stored):
    """Same keys, same meanings: a row written before the fields were typed gives the drain
    the input its body gives now (its grammar's schema: the writer's options for a grammar may
    have grown since, as a forced call's compact JSON)."""
    engine = FakeEngine(is_embedding=endpoint == "/v1/embeddings")
    engine.lora_names = ["fr-support"]
    old = prepare_fields(engine, stored)
    new = prepare(engine, endpoint, body)
    assert not isinstance(old, PrepareError) and not isinstance(new, PrepareError), (old, new)
    new = dataclasses.replace(new, lora_name=stored.get("lora_name"))
    if isinstance(new, EngineInput) and new.params.structured_output is not None:
        assert isinstance(old, EngineInput) and old.params.structured_output is not None
        assert old.params.structured_output.json_schema == (
            new.params.structured_output.json_schema)
        new = dataclasses.replace(new, params=dataclasses.replace(
            new.params, structured_output=old.params.structured_output))
    assert old == new
