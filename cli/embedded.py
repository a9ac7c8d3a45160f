"""The embedded service (``boxcar serve``): the API and one worker in one process.

SQLite, a local folder and the embedded queue (the worker polls the database and the API rings
it in-process): nothing to install. The code paths are the production ones; only the settings
differ. The schema is migrated at start and a local API key is kept next to the database.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import uvicorn
from sqlalchemy.engine import make_url

from api.app import build_context, create_app
from engine.protocol import Engine
from service.db import Database
from service.keys import create_key, ensure_key
from service.migrate import upgrade
from service.queue import EmbeddedQueue
from service.settings import Settings
from worker.process import WorkerService

log = logging.getLogger(__name__)


def state_dir(settings: Settings) -> str:
    """Where the embedded mode keeps its API key: beside the SQLite file (else .boxcar)."""
    if settings.is_sqlite:
        path = make_url(settings.database_url).database
        if path and path != ":memory:":
            return os.path.dirname(os.path.abspath(path))
    return os.path.abspath(".boxcar")


def ensure_local_key(db: Database, settings: Settings) -> str:
    """The key in ``<state dir>/api_key`` (made on first start), valid for tenant "default"."""
    if settings.bootstrap_api_key:
        with db.session() as session:
            ensure_key(session, key=settings.bootstrap_api_key)
        return settings.bootstrap_api_key
    path = os.path.join(state_dir(settings), "api_key")
    if os.path.exists(path):
        with open(path) as f:
            key = f.read().strip()
        with db.session() as session:
            ensure_key(session, key=key)
        return key
    with db.session() as session:
        key = create_key(session, tenant_name="default", name="local").key
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


class EmbeddedServer:
    """API (uvicorn, in a thread) + worker (``WorkerService``) sharing one database."""

    def __init__(
        self,
        settings: Settings,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        engine: Engine | None = None,
        log_level: str = "warning",
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.settings = settings
        self.host = host
        self.port = port
        self._engine = engine
        self._log_level = log_level
        self._on_fatal = on_fatal  # the worker's engine broke (``WorkerService``)
        self.api_key: str | None = None
        self.worker: WorkerService | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EmbeddedServer:
        settings = self.settings
        context = build_context(settings, queue=EmbeddedQueue())
        upgrade(context.db)
        self.api_key = ensure_local_key(context.db, settings)
        self.worker = WorkerService(settings, engine=self._engine, db=context.db,
                                    storage=context.storage, queue=context.queue,
                                    on_fatal=self._on_fatal).start()
        config = uvicorn.Config(create_app(context=context), host=self.host, port=self.port,
                                log_level=self._log_level, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="boxcar-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start on {self.base_url}")
            time.sleep(0.02)
        return self

    def wait(self) -> None:
        """Block until the API server stops (Ctrl-C)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        if self.worker is not None:
            self.worker.stop()
            self.worker.db.dispose()
