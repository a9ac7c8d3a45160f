"""Server-Timing: every response says how long the API took and how much of it went to database
statements, counted on the request's own threads."""

from __future__ import annotations

from api.timing import server_timing_ms
from tests.api.test_batches import make_batch


def test_a_status_poll_reports_its_server_and_statement_time(client):
    batch = make_batch(client).json()
    response = client.get(f"/v1/batches/{batch['id']}")
    assert response.status_code == 200
    header = response.headers["server-timing"]
    app_ms, db_ms = server_timing_ms(header), server_timing_ms(header, "db")
    assert app_ms is not None and db_ms is not None and 0 < db_ms <= app_ms
    # The key (a dependency, on a pool thread) and the batch with its counters (the handler):
    # statements made on other threads than the middleware's are counted too.
    assert 'desc="' in header and int(header.split('desc="')[1].split()[0]) >= 2
    missing = client.get("/v1/batches/batch_nope")
    assert missing.status_code == 404 and server_timing_ms(missing.headers["server-timing"])


def test_server_timing_values_parse_or_are_absent():
    assert server_timing_ms('app;dur=2.41, db;dur=1.12;desc="3 statements"') == 2.41
    assert server_timing_ms('app;dur=2.41, db;dur=1.12;desc="3"', "db") == 1.12
    assert server_timing_ms("app;desc=x") is None and server_timing_ms(None) is None
    assert server_timing_ms("cache;dur=1") is None
