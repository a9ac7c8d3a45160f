"""Prepare's per-line token estimates, where a batch's estimated completion starts."""

from __future__ import annotations

import json

from sqlalchemy import select

from openai_format.parse import parse_line
from service.lines import DEFAULT_OUTPUT_TOKENS, estimate_tokens
from service.models import Batch
from tests.conftest_services import chat_line, completion_line


def test_prepare_stores_the_batch_s_mean_token_estimates(make_stack, sqlite_url):
    stack = make_stack(sqlite_url)
    stack.add_worker()
    lines = [chat_line("a", "x" * 400, max_tokens=10), chat_line("b", "y" * 40, max_tokens=30)]
    batch = stack.create_batch(lines)
    stack.wait_status(batch["id"], "completed")
    with stack.ctx.db.read_session() as session:
        row = session.scalars(select(Batch).where(Batch.id == batch["id"])).one()
        prompt, output = row.est_prompt_tokens_per_line, row.est_output_tokens_per_line
    # Chat: content characters / 4, plus 4 a message and 1.
    assert prompt == ((400 // 4 + 5) + (40 // 4 + 5)) / 2 and output == 20.0
    unbounded = parse_line(json.dumps(completion_line("c", "abcdefgh", max_tokens=5)),
                           line_no=1, endpoint=None)
    assert estimate_tokens(unbounded) == (3, 5)
    body = chat_line("d", "hi")
    del body["body"]["max_tokens"]
    assert estimate_tokens(parse_line(json.dumps(body), line_no=1, endpoint=None))[1] == (
        DEFAULT_OUTPUT_TOKENS)
