"""Told at create (api.create_eta): a batch's estimated_completion_at is in its create response,
from the queue ahead of it in the engine order, the workers' pace and its file's token estimate
(its lines' prompt/output split from a sample of them); an estimate past expires_at gets a
``completion_window_at_risk`` warning and one ``batch.at_risk`` webhook event, or with
``refuse_at_risk`` fails its validation with ``completion_window_infeasible``."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import func, select

from openai_format.parse import parse_line
from service.lines import estimate_tokens
from service.models import Batch, File, WebhookDelivery
from tests.api.test_batches import make_batch
from tests.api.test_eta import _start, _worker
from tests.conftest_services import chat_line

HOOK = "https://example.com/hook"


def _deliveries(ctx, batch_id: str) -> list[str]:
    with ctx.db.read_session() as session:
        return list(session.scalars(select(WebhookDelivery.event_type)
                                    .where(WebhookDelivery.object_id == batch_id)))


def test_the_create_response_has_the_estimate_with_the_queue_ahead(client, ctx):
    ahead = make_batch(client, completion_window="1h").json()
    model = ahead["model"]
    _start(ctx, ahead["id"], open_lines=4)  # 4 lines x 150 tokens, a more urgent class
    _worker(ctx, model, rate=100.0)
    lines = [chat_line("a", "hello there " * 20, max_tokens=30),
             chat_line("b", "x", max_tokens=50)]
    before = time.time()
    created = make_batch(client, lines=lines)
    after = time.time()
    assert created.status_code == 200, created.text
    body = created.json()
    assert body["status"] == "validating" and "boxcar_warnings" not in body
    with ctx.db.read_session() as session:
        row = session.get(Batch, session.scalar(select(Batch.pk).where(Batch.id == body["id"])))
        file = session.scalar(select(File).where(File.id == row.input_file_id))
        enqueued = file.enqueued_tokens
        per_line = (row.est_prompt_tokens_per_line, row.est_output_tokens_per_line)
    # The file's tokens a line, split as its lines split them (prompt / output).
    estimates = [estimate_tokens(parse_line(json.dumps(x), line_no=1))
                 for x in lines]
    prompt, output = (sum(e[0] for e in estimates), sum(e[1] for e in estimates))
    assert per_line == pytest.approx((enqueued / 2 * prompt / (prompt + output),
                                      enqueued / 2 * output / (prompt + output)))
    # The 1h batch's 600 tokens run first, then this one's, at 100 tokens/s, from the moment
    # the create computed it: somewhere inside the call (a slow machine spends seconds there).
    seconds = (600 + enqueued) / 100
    assert before + seconds - 0.01 <= body["estimated_completion_at"] <= after + seconds + 0.01
    assert body["deadline_at_risk"] is False
    # A poll while it validates gets the same estimate.
    # (the same queue: at most the seconds since the create later, if it was computed anew).
    polled = client.get(f"/v1/batches/{body['id']}").json()
    drift = polled["estimated_completion_at"] - body["estimated_completion_at"]
    assert -0.01 <= drift <= time.time() - before + 0.01


def test_no_worker_no_estimate(client, ctx):
    body = make_batch(client).json()
    assert body["estimated_completion_at"] is None and "boxcar_warnings" not in body


def _slow_fleet(client, ctx) -> str:
    model = make_batch(client).json()["model"]
    _worker(ctx, model, rate=1.0)  # 1 token/s
    return model


def test_a_batch_at_risk_is_warned_once(client, ctx):
    _slow_fleet(client, ctx)
    lines = [chat_line(f"c{i}", "x", max_tokens=2000) for i in range(3)]
    response = make_batch(client, lines=lines, completion_window="1h", webhook_url=HOOK)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "validating" and body["deadline_at_risk"] is True
    assert body["estimated_completion_at"] > body["expires_at"]
    (warning,) = body["boxcar_warnings"]
    assert warning["code"] == "completion_window_at_risk"
    assert "estimated completion" in warning["message"]
    assert "past the end of its completion window" in warning["message"]
    assert _deliveries(ctx, body["id"]) == ["batch.at_risk"]
    polled = client.get(f"/v1/batches/{body['id']}").json()
    assert polled["deadline_at_risk"] is True and "boxcar_warnings" not in polled
    assert _deliveries(ctx, body["id"]) == ["batch.at_risk"]  # once, at create


def test_refuse_at_risk_fails_the_batch_naming_the_estimate(client, ctx):
    _slow_fleet(client, ctx)
    ctx.settings = ctx.settings.model_copy(update={"refuse_at_risk": True})
    lines = [chat_line(f"c{i}", "x", max_tokens=2000) for i in range(3)]
    response = make_batch(client, lines=lines, completion_window="1h", webhook_url=HOOK)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "failed" and "boxcar_warnings" not in body
    (error,) = body["errors"]["data"]
    assert (error["code"], error["param"]) == ("completion_window_infeasible",
                                               "completion_window")
    assert "estimated completion" in error["message"]
    assert _deliveries(ctx, body["id"]) == ["batch.failed"]
    with ctx.db.read_session() as session:
        held = session.scalar(select(func.sum(Batch.enqueued_tokens))
                              .where(Batch.id == body["id"]))
    assert held == 0  # its quota is not held
    # A batch that fits its window is created as before.
    fits = make_batch(client, completion_window="24h").json()
    assert fits["status"] == "validating" and fits["deadline_at_risk"] is False
