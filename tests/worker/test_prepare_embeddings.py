"""Prepare with /v1/embeddings lines: each valid line's engine fields hold its inputs, and the
lines past the batch's embedding-input limit fail at prepare as they do at upload (the same
count: ``service.lines.EmbeddingInputBudget``), while the rest stay pending."""

from __future__ import annotations

from sqlalchemy import select

from service.models import RequestLine
from worker.prepare import prepare_batch

EMB = "/v1/embeddings"


def _line(custom_id: str, value) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": EMB, "body": {"input": value}}


def test_prepare_counts_the_batch_s_inputs(make_stack, sqlite_url):
    stack = make_stack(sqlite_url)
    lines = [_line("a", ["x", "y", "z"]), _line("b", ["p", "q"]), _line("c", "one"),
             _line("d", [[1, 2]])]
    batch = stack.create_batch(lines, endpoint=EMB)
    assert prepare_batch(stack.ctx.db, stack.ctx.storage, batch["id"], worker_id="prep",
                         shard_size=2, max_embedding_inputs=5)
    with stack.ctx.db.read_session() as session:
        rows = {r.custom_id: r for r in session.scalars(
            select(RequestLine).where(RequestLine.batch_id == batch["id"]))}
    assert rows["a"].status == "pending" and rows["b"].status == "pending"
    assert rows["c"].status == "failed" and rows["d"].status == "failed"
    assert rows["c"].error["code"] == "too_many_inputs"
    assert rows["a"].engine_fields == {"embedding": {"input": ["x", "y", "z"],
                                                     "encoding_format": "float",
                                                     "dimensions": None}}
