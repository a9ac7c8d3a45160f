"""Engine-ready fields: a line's body is validated once, when it is stored, into
``engine_fields``; the drain loop builds the same engine input (or the same error) from them as
from the body, without parsing it again."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from engine.testing.fake_engine import FakeEngine
from openai_format.sampling import engine_fields
from pipeline import engine_adapter
from pipeline.engine_adapter import parse_body, prepare, prepare_fields
from service.models import RequestLine
from tests.conftest_services import chat_line, wait_for
from tests.worker.test_request_pipeline import ADD, WEATHER, make_engine
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
