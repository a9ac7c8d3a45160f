"""API test fixtures: an app on a fresh SQLite file and a local storage folder."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import build_context, create_app
from service.queue import EmbeddedQueue
from service.settings import Settings
from tests.conftest_services import *  # noqa: F403
from tests.conftest_services import make_key, migrated


class RecordingQueue(EmbeddedQueue):
    """Remembers the doorbells the API rang."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[str] = []
        self.shards: list[tuple[str, bool]] = []
        self.models: list[str | None] = []

    def batch_changed(self, batch_id: str) -> None:
        self.batches.append(batch_id)

    def shards_ready(self, shard_ids, *, model: str | None, jobs: bool = False) -> None:
        self.shards.extend((s, jobs) for s in shard_ids)
        self.models.extend(model for _ in shard_ids)


def api_settings(database_url: str, tmp_path) -> Settings:
    """The API tests' settings on ``database_url``: small files and shards, two windows."""
    return Settings(database_url=database_url, storage_url=str(tmp_path / "storage"),
                    max_file_bytes=64 * 1024, max_file_lines=50, shard_size=4,
                    completion_windows=["24h", "1h"])


@pytest.fixture
def settings(sqlite_url, tmp_path) -> Settings:
    return api_settings(sqlite_url, tmp_path)


@pytest.fixture
def ctx(settings):
    context = build_context(settings, db=migrated(settings.database_url), queue=RecordingQueue())
    yield context
    context.db.dispose()


@pytest.fixture
def app(ctx):
    return create_app(context=ctx)


@pytest.fixture
def key(ctx) -> str:
    return make_key(ctx.db, "acme")


@pytest.fixture
def client(app, key) -> TestClient:
    with TestClient(app, headers={"Authorization": f"Bearer {key}"}) as c:
        yield c


@pytest.fixture
def pg_context(pg_url, tmp_path):
    """An app context on the PostgreSQL test database (migrated), small shards."""
    settings = Settings(database_url=pg_url, storage_url=str(tmp_path / "storage"),
                        shard_size=4, completion_windows=["24h"])
    ctx = build_context(settings, db=migrated(pg_url), queue=RecordingQueue())
    yield ctx
    ctx.db.dispose()
