"""Prepare's rows: on PostgreSQL they are built with their JSON columns as text for COPY, on
SQLite as dicts for an insert; either way each line's stored body, engine fields and error read
back as the parse of the line gives them."""

from __future__ import annotations

import json

from sqlalchemy import select

from openai_format.engine_fields import engine_fields
from openai_format.parse import LineError, parse_line
from service.lines import sort_key, stored_body
from service.models import RequestLine
from tests.conftest_services import chat_line
from tests.worker.test_request_pipeline import ADD, WEATHER
from worker.prepare import prepare_batch

CHAT = "/v1/chat/completions"
LINES = [
    chat_line("dev", "Hi", temperature=0.5, stop=["\n"], logprobs=True, top_logprobs=2),
    {"custom_id": "roles", "method": "POST", "url": CHAT,
     "body": {"messages": [{"role": "developer", "content": "Be brief."},
                           {"role": "user", "content": [{"type": "text", "text": "Grüße, 世界"}]}],
              "user": "u1", "metadata": {"k": "v"}}},
    chat_line("tools", "Weather?", tools=[WEATHER, ADD], tool_choice="required"),
    chat_line("bias", "bias", logit_bias={"5": 100, "7": -100}, seed=10**20),
    # A lone surrogate is valid JSON and a valid str, but no Unicode text: a failed line (it
    # used to fail the whole prepare, again and again, in the prompt's sort key), while a
    # surrogate pair is one character.
    '{"custom_id": "surrogate", "method": "POST", "url": "/v1/chat/completions", '
    '"body": {"messages": [{"role": "user", "content": "Hi"}], "stop": ["a \\ud800 b"]}}',
    '{"custom_id": "surrogate-prompt", "method": "POST", "url": "/v1/chat/completions", '
    '"body": {"messages": [{"role": "user", "content": "x \\udc00 y"}]}}',
    '{"custom_id": "pair", "method": "POST", "url": "/v1/chat/completions", '
    '"body": {"messages": [{"role": "user", "content": "x \\ud83d\\ude00 y"}]}}',
    '{"custom_id": "broken", "method": "POST"',
    chat_line("dev", "a repeated custom_id"),
    chat_line("bad", "Hi", temperature=3),
    {"custom_id": "other", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "x"}},
]


def test_rows_read_back_as_the_lines_parse(make_stack, any_db_url):
    stack = make_stack(any_db_url)
    batch = stack.create_batch(LINES)
    assert prepare_batch(stack.ctx.db, stack.ctx.storage, batch["id"], worker_id="prep",
                         shard_size=2)
    with stack.ctx.db.read_session() as session:
        rows = session.scalars(select(RequestLine).where(RequestLine.batch_id == batch["id"])
                               .order_by(RequestLine.line_no)).all()
    assert [r.line_no for r in rows] == list(range(1, len(LINES) + 1))
    seen: set[str] = set()
    for row, line in zip(rows, LINES, strict=True):
        raw = line if isinstance(line, str) else json.dumps(line)
        parsed = parse_line(raw, line_no=row.line_no, endpoint=CHAT)
        if not isinstance(parsed, LineError) and parsed.custom_id in seen:
            parsed = LineError("duplicate_custom_id", "", row.line_no, parsed.custom_id)
        if isinstance(parsed, LineError):
            assert (row.status, row.custom_id, row.body, row.engine_fields) == (
                "failed", parsed.custom_id, None, None)
            assert row.error["code"] == parsed.code
            assert row.error["message"].startswith(f"line {row.line_no}: ")
            continue
        seen.add(parsed.custom_id)
        assert (row.status, row.custom_id, row.error) == ("pending", parsed.custom_id, None)
        assert row.body == stored_body(parsed)
        assert row.engine_fields == json.loads(json.dumps(engine_fields(parsed.body)))
        assert row.sort_key == sort_key(parsed)
    by_id = {r.custom_id: r for r in rows if r.status == "pending"}
    assert set(by_id) == {"dev", "roles", "tools", "bias", "pair"}
    assert by_id["roles"].sort_key.startswith("system\x1eBe brief.\x1fuser\x1eGrüße, 世界")
    assert by_id["pair"].body["messages"][0]["content"] == "x \U0001f600 y"
    failed = {r.custom_id: r.error for r in rows if r.status == "failed"}
    assert "lone surrogate" in failed["surrogate"]["message"]
    assert "lone surrogate" in failed["surrogate-prompt"]["message"]
    # Shards follow the sort keys: positions 0.. in (sort key, line number) order, 2 a shard.
    ordered = sorted(by_id.values(), key=lambda r: (r.sort_key, r.line_no))
    assert [(r.position, r.shard_id) for r in ordered] == [
        (k, f"{batch['id']}:{k // 2}") for k in range(len(ordered))]


def test_lines_with_nul_characters_are_stored(make_stack, any_db_url):
    """A PostgreSQL text column refuses NUL: a sort key never holds one (an embeddings line's,
    a prompt's), so such lines are stored like any other, not the chunk's COPY failing."""
    stack = make_stack(any_db_url)
    for endpoint, line in (
            (CHAT, chat_line("nul", "a\x00b")),
            ("/v1/embeddings", {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings",
                                "body": {"input": ["a", "b\x00"]}})):
        batch = stack.create_batch([line], endpoint=endpoint)
        assert prepare_batch(stack.ctx.db, stack.ctx.storage, batch["id"], worker_id="prep",
                             shard_size=2)
        with stack.ctx.db.read_session() as session:
            (row,) = session.scalars(select(RequestLine).where(
                RequestLine.batch_id == batch["id"])).all()
        assert row.status == "pending" and "\x00" not in row.sort_key
        assert row.body == line["body"]
