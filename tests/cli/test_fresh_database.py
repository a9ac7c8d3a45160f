"""A fresh database: SQLite migrates itself on any command; on PostgreSQL every command checks
the schema and refuses with one line naming `boxcar db upgrade` (no traceback), and `boxcar api`
starts not ready (/readyz 503 "schema at X, needs Y", /v1 answers 503 JSON) until it is upgraded.
Each PostgreSQL case runs in a database of its own, created here and dropped afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from service.migrate import head
from tests.conftest_services import PG_BASE, REPO, _pg_reachable, free_port, wait_for


def boxcar(*args: str, db_url: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "BOXCAR_DATABASE_URL": db_url}
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def fresh_pg() -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database (dropped afterwards)."""
    if not _pg_reachable():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    name = f"bx_fresh_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_BASE, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    try:
        yield make_url(PG_BASE).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


def test_fresh_sqlite_file_migrates_itself(tmp_path):
    url = f"sqlite:///{tmp_path / 'fresh' / 'boxcar.db'}"
    created = boxcar("keys", "create", "--tenant", "x", db_url=url)
    assert created.returncode == 0, created.stderr
    assert "API key (shown once): bx-" in created.stdout
    status = boxcar("status", "--json", db_url=url)
    assert status.returncode == 0, status.stderr


def test_fresh_postgres_commands_refuse_in_one_line(fresh_pg):
    for args in (("keys", "create", "--tenant", "x"), ("status",)):
        result = boxcar(*args, db_url=fresh_pg)
        assert result.returncode == 1, result
        assert "Traceback" not in result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line == (f"boxcar {' '.join(args[:2]) if args[0] == 'keys' else args[0]}: "
                        f"database schema at nothing (empty database), needs {head()}: "
                        "run `boxcar db upgrade`")
    upgraded = boxcar("db", "upgrade", db_url=fresh_pg)
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout.strip() == f"database at revision {head()}"
    created = boxcar("keys", "create", "--tenant", "x", db_url=fresh_pg)
    assert created.returncode == 0, created.stderr


def test_unreachable_database_is_one_line(tmp_path):
    result = boxcar("keys", "create", db_url="postgresql+psycopg://nobody@127.0.0.1:1/none")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("boxcar keys create: cannot use the database "
                           "postgresql+psycopg://nobody@127.0.0.1:1/none: ")


def test_api_on_fresh_postgres_is_not_ready_until_upgraded(fresh_pg, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "BOXCAR_DATABASE_URL": fresh_pg,
           "BOXCAR_STORAGE_URL": str(tmp_path / "storage")}
    env.pop("BOXCAR_BROKER_URL", None)
    log_path = tmp_path / "api.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cli.main", "api", "--host", "127.0.0.1",
                                 "--port", str(port)], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)

        def answers() -> httpx.Response | None:
            assert proc.poll() is None, log_path.read_text()
            try:
                return client.get("/readyz")
            except httpx.TransportError:
                return None

        ready = wait_for(answers, 60, 0.2, "the API to answer")
        assert ready.status_code == 503
        assert ready.json()["checks"]["schema"] == (
            f"database schema at nothing (empty database), needs {head()}: "
            "run `boxcar db upgrade`")
        batches = client.post("/v1/batches", json={}, headers={"Authorization": "Bearer sk-x"})
        assert batches.status_code == 503
        error = batches.json()["error"]
        assert error["code"] == "schema_out_of_date" and "boxcar db upgrade" in error["message"]
        assert client.get("/healthz").status_code == 200  # alive, not ready

        assert boxcar("db", "upgrade", db_url=fresh_pg).returncode == 0
        wait_for(lambda: client.get("/readyz").status_code == 200, 10, 0.2, "readiness")
        after = client.post("/v1/batches", json={}, headers={"Authorization": "Bearer sk-x"})
        assert after.status_code == 401  # through the gate: the key is checked now
        assert "Traceback" not in log_path.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
