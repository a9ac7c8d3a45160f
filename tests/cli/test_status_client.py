"""``boxcar status --api``: the report of a running API (``GET /v1/status``) printed as the
database's would be, without touching the database; and each way it can fail said in one line
(no operator key, a wrong one, an API that is not there, a URL that is not one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from api.app import build_context, create_app
from api.status import collect
from cli.database import Refused
from cli.status_client import ApiStatus
from service.settings import Settings
from tests.api.conftest import RecordingQueue
from tests.api.test_status_endpoint import INTERVAL, OPERATOR_KEY, comparable
from tests.batch_rows import fill_every_part
from tests.conftest_services import REPO, free_port, migrated, pg_schema, serve_app

NOWHERE_DB = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # status --api never reads it


@pytest.fixture
def live_api(tmp_path):
    """An API on PostgreSQL (the held report's path) with something in every part."""
    with pg_schema() as pg_url:
        db = migrated(pg_url)
        fill_every_part(db)
        settings = Settings(database_url=pg_url, storage_url=str(tmp_path / "storage"),
                            operator_key=OPERATOR_KEY, worker_metrics_interval=INTERVAL)
        app = create_app(context=build_context(settings, db=db, queue=RecordingQueue()))
        with serve_app(app) as base_url:
            yield base_url, db
        db.dispose()


def status(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", "status", *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO,
                               "BOXCAR_DATABASE_URL": NOWHERE_DB, **env},
                          capture_output=True, text=True, timeout=120)


def test_the_command_prints_the_api_s_report(live_api):
    base_url, db = live_api
    done = status("--json", "--api", base_url, BOXCAR_OPERATOR_KEY=OPERATOR_KEY)
    assert done.returncode == 0, done.stderr
    expected = collect(db, interval=INTERVAL)
    assert comparable(json.loads(done.stdout)) == comparable(expected)
    # BOXCAR_API_URL in place of --api; drawn for a terminal.
    drawn = status(BOXCAR_API_URL=base_url, BOXCAR_OPERATOR_KEY=OPERATOR_KEY)
    assert drawn.returncode == 0, drawn.stderr
    assert "workers   2 live" in drawn.stdout and "host:1" in drawn.stdout


def test_each_failure_is_one_line(live_api):
    base_url, _ = live_api
    no_key = status("--api", base_url)
    assert no_key.returncode == 1
    assert no_key.stderr.strip() == (
        f"boxcar status: asking the API at {base_url} needs the operator's key: set "
        "BOXCAR_OPERATOR_KEY (the API's own)")
    wrong = status("--api", base_url, BOXCAR_OPERATOR_KEY="not-the-operator-key-at-all")
    assert wrong.returncode == 1
    assert wrong.stderr.strip() == (
        f"boxcar status: the API at {base_url} answered 401: Incorrect operator key: this "
        "endpoint takes BOXCAR_OPERATOR_KEY, not a tenant's API key.")
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(Refused, match=f"cannot reach the API at {gone}: "):
        ApiStatus(gone, OPERATOR_KEY, timeout=5).collect()
    with pytest.raises(Refused, match="--api must be an http"):
        ApiStatus("127.0.0.1:8000", OPERATOR_KEY)


def test_a_path_prefix_is_kept_and_the_timings_are_read(live_api):
    base_url, _ = live_api
    client = ApiStatus(base_url + "/", OPERATOR_KEY)
    report = client.collect()
    assert report["workers"] and client.connect_s > 0
    assert client.server_timing is not None and "app" in client.server_timing
    with pytest.raises(Refused, match="answered 404"):
        ApiStatus(base_url + "/prefix", OPERATOR_KEY).collect()  # /prefix/v1/status
