"""estimated_completion_at (api.eta): the workers' forecasts of the lines they hold, the
lines no worker holds after them; without forecasts, work left in tokens over the workers' live
throughput, with the work queued ahead; deadline_at_risk, its gauge and the status report."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from prometheus_client import generate_latest
from sqlalchemy import event, select, update

from api.eta import MIN_LEARNED_LINES, SOON_S, EtaCache, estimate, throughput, work_left
from api.metrics import metrics_registry
from api.status import collect
from cli.status import format_status
from service import counters
from service.counters import CounterDelta
from service.db import utcnow
from service.models import (
    IN_PROGRESS,
    LINE_COMPLETED,
    LINE_PENDING,
    Batch,
    RequestLine,
    WorkerStatus,
)
from tests.api.test_batches import make_batch


def test_work_left_uses_prepare_estimates_then_the_batch_s_own_lines():
    prior = dict(est_prompt=100.0, est_output=50.0)
    assert work_left(remaining=10, completed=0, input_tokens=0, output_tokens=0,
                     cached_tokens=0, **prior) == 1500.0
    # Learned: 40 prompt tokens a line, half from the cache, 10 output tokens.
    learned = work_left(remaining=10, completed=MIN_LEARNED_LINES, input_tokens=120,
                        output_tokens=30, cached_tokens=60, **prior)
    assert learned == pytest.approx(10 * (40 * 0.5 + 10))


def test_throughput_counts_recent_busy_seconds_of_every_worker():
    now = 1000.0
    busy = {"t": now - 1, "steps": 4, "generation_tokens_per_s": 80.0,
            "prompt_tokens_per_s": 20.0}
    idle = {"t": now - 2, "steps": 0, "generation_tokens_per_s": 0.0,
            "prompt_tokens_per_s": 0.0}
    old = {"t": now - 100, "steps": 4, "generation_tokens_per_s": 999.0,
           "prompt_tokens_per_s": 0.0}
    assert throughput([{"timeline": [old, idle, busy]}], now=now) == 100.0
    assert throughput([{"timeline": [busy]}, {"timeline": [busy]}], now=now) == 200.0
    assert throughput([{"timeline": [idle, old]}], now=now) is None


def _start(ctx, batch_id: str, *, open_lines: int, done_lines: int = 0) -> None:
    with ctx.db.session() as session:
        values = dict(status=IN_PROGRESS, in_progress_at=utcnow(), prepared_at=utcnow(),
                      est_prompt_tokens_per_line=100.0, est_output_tokens_per_line=50.0)
        session.execute(update(Batch).where(Batch.id == batch_id).values(**values))
        tenant = session.scalar(select(Batch.tenant_id).where(Batch.id == batch_id))
        for i in range(open_lines + done_lines):
            done = i < done_lines
            session.add(RequestLine(
                tenant_id=tenant, batch_id=batch_id, line_no=i + 1, custom_id=f"c{i}",
                endpoint="/v1/chat/completions", status=LINE_COMPLETED if done else LINE_PENDING,
                prompt_tokens=40 if done else 0, completion_tokens=10 if done else 0))
        # As prepare and the result writer do: the counters change with the lines.
        counters.add(session, {batch_id: CounterDelta(
            num_open=open_lines, num_completed=done_lines, input_tokens=40 * done_lines,
            output_tokens=10 * done_lines)}, slot=0)


def _worker(ctx, model: str, rate: float, forecast: dict | None = None) -> None:
    metrics = {"timeline": [{"t": time.time() - 1, "steps": 3, "generation_tokens_per_s": rate,
                             "prompt_tokens_per_s": 0.0}]}
    if forecast is not None:
        metrics["forecast"] = forecast
    with ctx.db.session() as session:
        row = session.get(WorkerStatus, "w1")
        if row is None:
            session.add(WorkerStatus(id="w1", model=model, heartbeat_at=utcnow(),
                                     metrics=metrics))
        else:
            row.metrics = metrics


def test_estimates_follow_the_queue_order_and_flag_a_late_batch(client, ctx):
    clock = [0.0]  # the cache's clock, moved by hand past its TTL
    ctx.etas = EtaCache(2.0, ttl=0.2, clock=lambda: clock[0])  # polls within 0.2 s share one
    created = make_batch(client).json()
    day, model = created["id"], created["model"]
    hour = make_batch(client, completion_window="1h").json()["id"]
    # Unknown until a worker has stepped: null, not a guess.
    _start(ctx, day, open_lines=10)
    _start(ctx, hour, open_lines=4)
    assert client.get(f"/v1/batches/{day}").json()["estimated_completion_at"] is None
    _worker(ctx, model, rate=100.0)
    now = time.time()
    with ctx.db.read_session() as session:
        etas = estimate(session, worker_metrics_interval=2.0, now=now)
    # The 1h batch runs first: 4 lines x 150 tokens at 100 tokens/s; the 24h one after it.
    assert etas[hour].estimated_completion_at == pytest.approx(now + 6.0)
    assert etas[day].estimated_completion_at == pytest.approx(now + 6.0 + 15.0)
    assert not etas[day].late and not etas[hour].late
    clock[0] += 0.25
    body = client.get(f"/v1/batches/{day}").json()
    assert body["estimated_completion_at"] == pytest.approx(now + 21.0, abs=3)
    assert body["deadline_at_risk"] is False

    # The 24h batch's deadline now falls before its estimate: flagged everywhere.
    with ctx.db.session() as session:
        session.execute(update(Batch).where(Batch.id == day)
                        .values(expires_at=utcnow() + dt.timedelta(seconds=5)))
    with ctx.db.read_session() as session:
        etas = estimate(session, worker_metrics_interval=2.0)
    assert etas[day].late and not etas[hour].late
    page = generate_latest(metrics_registry(ctx.db, 2.0)).decode()
    assert "boxcar_batches_deadline_at_risk 1.0" in page
    report = collect(ctx.db, interval=2.0)
    late = {b["id"]: b["deadline_at_risk"] for b in report["active_batches"]}
    assert late == {day: True, hour: False}
    assert "LATE" in format_status(report) and "eta " in format_status(report)
    assert client.get(f"/v1/batches/{day}").json()["deadline_at_risk"] is False  # cached
    clock[0] += 0.25
    assert client.get(f"/v1/batches/{day}").json()["deadline_at_risk"] is True
    shown = {b["id"]: b for b in client.get("/ui/api/summary").json()["batches"]}
    assert shown[day]["deadline_at_risk"] is True and shown[hour]["deadline_at_risk"] is False
    # Due in 5 s, the former 24h batch is now the more urgent class: it runs first.
    assert shown[day]["estimated_completion_at"] < shown[hour]["estimated_completion_at"]


def test_equal_classes_share_and_finished_lines_teach_the_estimate(client, ctx):
    created = make_batch(client).json()
    a, model = created["id"], created["model"]
    b = make_batch(client).json()["id"]
    _start(ctx, a, open_lines=10)
    # b: three lines done at 40 prompt + 10 output tokens each -> 50 a line from now on.
    _start(ctx, b, open_lines=2, done_lines=MIN_LEARNED_LINES)
    with ctx.db.session() as session:  # same deadline bucket and priority as a
        expires = session.scalar(select(Batch.expires_at).where(Batch.id == a))
        session.execute(update(Batch).where(Batch.id == b).values(expires_at=expires))
    _worker(ctx, model, rate=100.0)
    now = time.time()
    with ctx.db.read_session() as session:
        etas = estimate(session, worker_metrics_interval=2.0, now=now)
    assert etas[b].work_left == 100.0 and etas[a].work_left == 1500.0
    # b shares the workers with a: a's work counts up to b's own.
    assert etas[b].estimated_completion_at == pytest.approx(now + (100 + 100) / 100)
    assert etas[a].estimated_completion_at == pytest.approx(now + (100 + 1500) / 100)


def _forecast(at: float, seconds_left: float, batches: dict[str, tuple[int, float]]) -> dict:
    return {"at": at, "seats": 4, "seconds_left": seconds_left,
            "cost": {"fixed": 0.1, "per_decode": 0.01, "per_prefill": 0.001},
            "batches": {b: {"lines": n, "seconds_left": s} for b, (n, s) in batches.items()}}


def test_held_lines_end_when_the_workers_forecast_says(client, ctx):
    """The worker holds every open line, most of them nearly done: its forecast is the
    estimate. The token rate alone (10 lines x 150 tokens at 100 tokens/s) said 15 s."""
    created = make_batch(client).json()
    a, model = created["id"], created["model"]
    _start(ctx, a, open_lines=10)
    at = time.time() - 1  # published a second ago: the estimate counts from then
    _worker(ctx, model, rate=100.0, forecast=_forecast(at, 3.0, {a: (10, 3.0)}))
    with ctx.db.read_session() as session:
        etas = estimate(session, worker_metrics_interval=2.0)
    assert etas[a].estimated_completion_at == pytest.approx(at + 3.0)
    # A forecast this version cannot read counts as none: the token rate again.
    _worker(ctx, model, rate=100.0, forecast={"at": "soon"})
    now = time.time()
    with ctx.db.read_session() as session:
        etas = estimate(session, worker_metrics_interval=2.0, now=now)
    assert etas[a].estimated_completion_at == pytest.approx(now + 15.0)


def test_a_forecast_whose_end_has_passed_is_late_not_done(client, ctx):
    """The worker forecast its lines' end 3 s after a forecast made 10 s ago (its engine then
    ran one long step, a prefill of seconds, and has published nothing newer): the lines are
    still open, so the estimate is now, not 7 s ago."""
    created = make_batch(client).json()
    a, model = created["id"], created["model"]
    _start(ctx, a, open_lines=10)
    now = time.time()
    _worker(ctx, model, rate=100.0, forecast=_forecast(now - 10.0, 3.0, {a: (10, 3.0)}))
    with ctx.db.read_session() as session:
        etas = estimate(session, worker_metrics_interval=2.0, now=now)
    assert etas[a].estimated_completion_at == pytest.approx(now)


def test_a_batch_seconds_from_done_is_estimated_to_the_millisecond(client, ctx):
    """A short batch has a second or two left when a quarter of it is done: the estimate a
    poll reads keeps the forecast's fraction of a second (rounded to whole seconds it was off
    by up to half a second, a third of that time left)."""
    created = make_batch(client).json()
    a, model = created["id"], created["model"]
    _start(ctx, a, open_lines=10)
    at = int(time.time()) - 1 + 0.25  # the forecast's end falls a quarter past a second
    _worker(ctx, model, rate=100.0, forecast=_forecast(at, 3.0, {a: (10, 3.0)}))
    shown = client.get(f"/v1/batches/{a}").json()["estimated_completion_at"]
    assert isinstance(shown, float) and shown == pytest.approx(at + 3.0, abs=1e-3)


def test_a_forecast_of_none_of_a_batch_s_lines_from_a_worker_with_room_is_provisional(
        client, ctx):
    """No worker holds any of the batch's lines and one of its model has free seats: it is
    about to claim them, so the estimate (the lines' guess after the held work) is
    provisional. Not once a worker holds some of them, nor while every worker is full."""
    created = make_batch(client).json()
    a, model = created["id"], created["model"]
    other = make_batch(client).json()["id"]
    _start(ctx, a, open_lines=10)
    now = time.time()

    def provisional(batches: dict[str, tuple[int, float]]) -> bool:
        _worker(ctx, model, rate=100.0, forecast=_forecast(now, 1.0, batches))
        with ctx.db.read_session() as session:
            return estimate(session, worker_metrics_interval=2.0, now=now)[a].provisional

    assert provisional({})  # an idle worker
    assert provisional({other: (3, 1.0)})  # one seat of four free
    assert not provisional({a: (2, 1.0)})  # it holds some: its forecast is the estimate
    assert not provisional({other: (4, 1.0)})  # full: a's lines wait, the guess stands


def test_a_poll_gets_a_new_estimate_soon_when_its_batch_s_is_missing_or_provisional(
        client, ctx):
    """The cache's value was made while the batch validated, then while no worker held its
    lines (provisional both times: a worker with room claims them within moments): each is made
    again after SOON_S, not after the whole TTL; a held batch's estimate keeps the TTL."""
    clock = [0.0]
    ctx.etas = EtaCache(2.0, ttl=2.0, clock=lambda: clock[0])  # the poll computes it itself
    created = make_batch(client).json()
    a, model = created["id"], created["model"]
    now = time.time()
    _worker(ctx, model, rate=100.0, forecast=_forecast(now, 0.0, {}))
    validating = client.get(f"/v1/batches/{a}").json()["estimated_completion_at"]
    assert validating is not None  # from its file's lines, before prepare (api.create_eta)
    _start(ctx, a, open_lines=10)  # in progress now: the cached value is the validating one
    clock[0] = SOON_S / 2
    assert client.get(f"/v1/batches/{a}").json()["estimated_completion_at"] == validating
    clock[0] = SOON_S + 0.01
    guess = client.get(f"/v1/batches/{a}").json()["estimated_completion_at"]
    assert guess is not None  # made again: the worker's lines-to-come guess, provisional
    # The worker claims the lines and forecasts them: the next value has its forecast.
    _worker(ctx, model, rate=100.0, forecast=_forecast(now, 30.0, {a: (10, 30.0)}))
    clock[0] = 2 * SOON_S + 0.02
    assert client.get(f"/v1/batches/{a}").json()["estimated_completion_at"] == pytest.approx(
        now + 30.0, abs=1e-3)
    _worker(ctx, model, rate=100.0, forecast=_forecast(now, 20.0, {a: (10, 20.0)}))
    clock[0] = 2.0  # a held batch's value is kept for the TTL ...
    assert client.get(f"/v1/batches/{a}").json()["estimated_completion_at"] == pytest.approx(
        now + 30.0, abs=1e-3)
    clock[0] = 2 * SOON_S + 0.02 + 2.0  # ... and made again after it
    assert client.get(f"/v1/batches/{a}").json()["estimated_completion_at"] == pytest.approx(
        now + 20.0, abs=1e-3)


def test_lines_no_worker_holds_run_after_the_held_work_in_queue_order(client, ctx):
    created = make_batch(client).json()
    day, model = created["id"], created["model"]
    hour = make_batch(client, completion_window="1h").json()["id"]
    _start(ctx, day, open_lines=10)
    _start(ctx, hour, open_lines=2)
    now = time.time()
    # The worker holds 6 of day's lines (all its held work: 3 s); 4 of day's and both of
    # hour's are pending. A pending line on a full engine of 4 seats: 100 prompt tokens at
    # 0.001 s, 50 decodes at 0.01 s plus a quarter of each step's 0.1 s: 1.85 s.
    _worker(ctx, model, rate=100.0, forecast=_forecast(now, 3.0, {day: (6, 3.0)}))
    with ctx.db.read_session() as session:
        etas = estimate(session, worker_metrics_interval=2.0, now=now)
    line = 0.001 * 100 + (0.01 + 0.1 / 4) * 50
    assert etas[hour].estimated_completion_at == pytest.approx(now + 3.0 + 2 * line)
    # day's pending lines wait for hour's (a more urgent class).
    assert etas[day].estimated_completion_at == pytest.approx(now + 3.0 + 6 * line)


def test_the_estimate_reads_the_counters_never_the_lines(client, ctx):
    """O(1) per batch: the estimate's statements touch the batch and counter rows only, and a
    batch's work left follows its counters (here they say 7 open lines; it has 10)."""
    created = make_batch(client).json()
    a, model = created["id"], created["model"]
    _start(ctx, a, open_lines=10)
    with ctx.db.session() as session:
        counters.add(session, {a: CounterDelta(num_open=-3)}, slot=5)
    _worker(ctx, model, rate=100.0)
    statements: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    event.listen(ctx.db.read_engine, "before_cursor_execute", record)
    try:
        with ctx.db.read_session() as session:
            etas = estimate(session, worker_metrics_interval=2.0)
    finally:
        event.remove(ctx.db.read_engine, "before_cursor_execute", record)
    assert etas[a].work_left == 7 * 150.0
    assert statements and not [s for s in statements if "request_lines" in s]


def test_a_batch_still_preparing_counts_its_file_s_lines(client, ctx):
    """Prepare commits chunks: while it runs, the counters hold only the committed lines, and
    the estimate counts every line of the file that has not finished."""
    created = make_batch(client).json()
    a, model = created["id"], created["model"]
    _start(ctx, a, open_lines=10, done_lines=2)  # the first chunks: 12 of the file's 50
    with ctx.db.session() as session:
        session.execute(update(Batch).where(Batch.id == a).values(num_total=50,
                                                                  prepared_at=None))
    _worker(ctx, model, rate=100.0)
    with ctx.db.read_session() as session:
        etas = estimate(session, worker_metrics_interval=2.0)
    per_line = etas[a].work_left / 48  # 50 lines, 2 finished; checked against 10 below
    assert per_line > 0
    with ctx.db.session() as session:  # prepare's last chunk: the counters are whole again
        session.execute(update(Batch).where(Batch.id == a).values(prepared_at=utcnow()))
    with ctx.db.read_session() as session:
        assert estimate(session, worker_metrics_interval=2.0)[a].work_left == pytest.approx(
            10 * per_line)
