"""``boxcar worker --healthcheck`` (a container's healthcheck): healthy while a worker on this
host writes its heartbeat, unhealthy when it stopped or its heartbeat is stale."""

from __future__ import annotations

import datetime as dt
import socket

from sqlalchemy import update

from cli.main import main
from engine.testing.fake_engine import FakeEngine
from service.models import WorkerStatus
from tests.conftest_services import wait_for


def test_worker_healthcheck_follows_the_heartbeat(make_stack, sqlite_url, monkeypatch, capsys):
    monkeypatch.setenv("BOXCAR_DATABASE_URL", sqlite_url)
    stack = make_stack(sqlite_url)
    assert main(["worker", "--healthcheck"]) == 1  # no worker yet
    assert "no worker heartbeat from host" in capsys.readouterr().err

    worker = stack.add_worker(FakeEngine())
    assert worker.worker_id.startswith(f"{socket.gethostname()}:")
    wait_for(lambda: main(["worker", "--healthcheck"]) == 0, 10, 0.1, "a heartbeat")
    assert "healthy: a worker on" in capsys.readouterr().out
    assert main(["worker", "--healthcheck", "--host", "elsewhere"]) == 1

    worker.publisher._stop.set()  # the heartbeat stops; the row stays, getting old
    worker.publisher.wake()
    for thread in worker._threads:
        if thread.name == "boxcar-metrics":
            thread.join(5)
    with stack.ctx.db.session() as session:
        session.execute(update(WorkerStatus).values(
            heartbeat_at=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)))
    capsys.readouterr()
    assert main(["worker", "--healthcheck"]) == 1
    assert "s old (more than" in capsys.readouterr().err
