"""``GET /v1/status``: the operator's report, the one ``api.status.collect`` makes, on SQLite
(read on a thread) and PostgreSQL (the held report of ``api.poll_snapshots``, read in one
pipeline on a warm connection); only the operator's key opens it, and a key too short to be one
is refused at start."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api.app import build_context, create_app
from api.status import collect
from service.settings import MIN_OPERATOR_KEY_CHARS, Settings
from tests.api.conftest import RecordingQueue
from tests.batch_rows import fill_every_part
from tests.conftest_services import make_key, migrated

OPERATOR_KEY = "operator-key-of-the-tests-0123456789"
INTERVAL = 2.0
QUOTA = 1_000


@pytest.fixture
def busy_db(any_db_url):
    db = migrated(any_db_url)
    fill_every_part(db)
    yield db
    db.dispose()


def client_of(db, tmp_path, operator_key: str | None = OPERATOR_KEY) -> TestClient:
    settings = Settings(database_url=db.url, storage_url=str(tmp_path / "storage"),
                        operator_key=operator_key, worker_metrics_interval=INTERVAL,
                        max_enqueued_tokens=QUOTA)
    return TestClient(create_app(context=build_context(settings, db=db,
                                                       queue=RecordingQueue())))


def comparable(report: dict[str, Any]) -> dict[str, Any]:
    """The report less what moves between two reads a moment apart: when it was read, the
    heartbeats' ages, the ETAs (counted from now)."""
    found = dict(report, workers=[{k: v for k, v in w.items() if k != "heartbeat_age_s"}
                                  for w in report["workers"]],
                 active_batches=[{k: v for k, v in b.items() if k != "estimated_completion_at"}
                                 for b in report["active_batches"]])
    found.pop("read_at")
    return found


def test_the_api_answers_collect_s_report(busy_db, tmp_path):
    with client_of(busy_db, tmp_path) as client:
        answer = client.get("/v1/status", headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
        again = client.get("/v1/status", headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
    assert answer.status_code == 200, answer.text
    report = answer.json()
    expected = collect(busy_db, interval=INTERVAL, max_enqueued_tokens=QUOTA)
    assert comparable(report) == comparable(expected)
    assert abs(report["read_at"] - time.time()) < 60
    # Every part has something in it, so the comparison compares something.
    assert report["batches"] == {"completed": 1, "in_progress": 2, "finalizing": 1,
                                 "validating": 1, "cancelling": 1}
    assert [w["id"] for w in report["workers"]] == ["host:1", "host:2"]
    assert {q["limit"] for q in report["enqueued_tokens"]} == {QUOTA}
    assert again.status_code == 200 and comparable(again.json()) == comparable(report)


def test_only_the_operator_key_opens_it(sqlite_url, tmp_path):
    db = migrated(sqlite_url)
    tenant_key = make_key(db, "acme")
    with client_of(db, tmp_path) as client:
        for headers in ({}, {"Authorization": f"Bearer {tenant_key}"},
                        {"Authorization": f"Bearer {OPERATOR_KEY}x"},
                        {"Authorization": f"Basic {OPERATOR_KEY}"}):
            refused = client.get("/v1/status", headers=headers)
            assert refused.status_code == 401, (headers, refused.text)
            assert refused.json()["error"]["code"] == "invalid_api_key"
        tenant = client.get("/v1/status", headers={"Authorization": f"Bearer {tenant_key}"})
        assert "BOXCAR_OPERATOR_KEY" in tenant.json()["error"]["message"]
    with client_of(db, tmp_path, operator_key=None) as client:
        off = client.get("/v1/status", headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
    assert off.status_code == 403
    assert off.json()["error"]["code"] == "operator_key_not_set"
    assert "BOXCAR_OPERATOR_KEY" in off.json()["error"]["message"]
    db.dispose()


def test_an_operator_key_too_short_is_refused_and_an_empty_one_is_none():
    with pytest.raises(ValidationError, match=f"at least {MIN_OPERATOR_KEY_CHARS} characters"):
        Settings(operator_key="short")
    assert Settings(operator_key="").operator_key is None
    assert Settings(operator_key=OPERATOR_KEY).operator_key is not None
    assert OPERATOR_KEY not in repr(Settings(operator_key=OPERATOR_KEY))  # a secret
