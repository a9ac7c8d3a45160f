"""When a model was last seen, with no row that every worker writes: 32 workers announcing and
heartbeating write the model's row once (its insert), the model is seen through its workers'
heartbeats while its row ages, and a worker's clean stop (or the prune of a killed one's row)
leaves the time it was last seen on the model's row."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import event, select

from metrics.publisher import PRUNE_AFTER, MetricsPublisher
from metrics.recorder import EngineRecorder
from service import served_models
from service.db import Database, utcnow
from service.models import ServedModel, WorkerStatus
from service.settings import Settings
from tests.conftest_services import migrated

CONFIG = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 4,
          "enable_prefix_caching": True}
TTL = 3600.0


@contextmanager
def models_writes(db: Database) -> Iterator[list[str]]:
    """The statements that write the ``models`` table while the block runs."""
    writes: list[str] = []

    def seen(conn, cursor, statement, parameters, context, executemany) -> None:
        words = statement.split()
        if words[0].upper() in ("INSERT", "UPDATE") and "models" in (w.strip('"') for w in
                                                                    words[:4]):
            writes.append(statement)

    event.listen(db.engine, "before_cursor_execute", seen)
    try:
        yield writes
    finally:
        event.remove(db.engine, "before_cursor_execute", seen)


def publisher(db: Database, worker_id: str, model: str = "tiny") -> MetricsPublisher:
    return MetricsPublisher(db, EngineRecorder(CONFIG), worker_id=worker_id, model=model,
                            interval=1.0)


def served(db: Database, *, now: dt.datetime | None = None) -> dict[str, int]:
    settings = Settings(model="configured", model_ttl=TTL)
    with db.read_session() as session:
        return {m.id: m.num_workers for m in served_models.served_models(session, settings,
                                                                         now=now)
                if not m.configured}


def last_seen(db: Database, model: str = "tiny") -> dt.datetime:
    with db.read_session() as session:
        return session.scalars(select(ServedModel.last_seen_at)
                               .where(ServedModel.id == model)).one()


def test_a_fleet_announcing_and_heartbeating_writes_the_models_row_once(any_db_url):
    db = migrated(any_db_url)
    workers = [publisher(db, f"w{i}") for i in range(32)]
    with models_writes(db) as writes:
        for _ in range(3):  # start, then two rounds of announcements and heartbeats
            for worker in workers:
                with db.session() as session:
                    served_models.announce(session, model="tiny", aliases=["tiny.gguf"],
                                           kind="generation", model_ttl=TTL)
                worker.publish()
    assert len(writes) == 1 and writes[0].split()[0].upper() == "INSERT"
    assert served(db) == {"tiny": 32}
    db.dispose()


def test_a_model_is_seen_through_its_workers_heartbeats_then_its_row(any_db_url):
    db = migrated(any_db_url)
    now = utcnow()
    long_ago = now - dt.timedelta(seconds=TTL + 600)
    with db.session() as session:  # announced long ago; a worker of it beats now
        served_models.announce(session, model="tiny", aliases=[], now=long_ago, model_ttl=TTL)
        served_models.announce(session, model="gone", aliases=[], now=long_ago, model_ttl=TTL)
    worker = publisher(db, "w1")
    worker.publish()
    assert served(db, now=now) == {"tiny": 1}  # "gone": no heartbeat, its row too old
    # The row is due a refresh (older than a tenth of the TTL): the next announcement writes it.
    with db.session() as session:
        served_models.announce(session, model="tiny", aliases=[], now=now, model_ttl=TTL)
    assert last_seen(db) == now

    # A clean stop: the heartbeat row goes, the model's row says when.
    stopped_at = utcnow()
    worker.remove()
    assert last_seen(db) >= stopped_at
    later = utcnow() + dt.timedelta(seconds=TTL - 60)
    assert served(db, now=later) == {"tiny": 0}  # within the TTL of its worker's stop
    assert served(db, now=later + dt.timedelta(seconds=120)) == {}
    db.dispose()


def test_pruning_a_killed_workers_row_keeps_its_last_heartbeat(any_db_url):
    db = migrated(any_db_url)
    killed_at = utcnow() - PRUNE_AFTER - dt.timedelta(minutes=5)
    with db.session() as session:
        served_models.announce(session, model="tiny", aliases=[], model_ttl=TTL,
                               now=killed_at - dt.timedelta(minutes=30))
        session.add(WorkerStatus(id="killed", model="tiny", started_at=killed_at,
                                 heartbeat_at=killed_at))
    publisher(db, "w2")._prune()  # a new worker starts
    with db.read_session() as session:
        assert session.get(WorkerStatus, "killed") is None
    assert last_seen(db) == killed_at
    db.dispose()
