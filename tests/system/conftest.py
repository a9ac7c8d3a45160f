"""System test fixtures: the real engine on the tiny model, behind the embedded service and
behind the production stack (PostgreSQL, Redis + Celery worker processes, SeaweedFS S3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field

import pytest
import uvicorn

from api.app import create_app
from cli.embedded import EmbeddedServer
from service.db import Database
from service.migrate import upgrade
from service.settings import Settings
from tests.conftest_services import *  # noqa: F403
from tests.conftest_services import (
    REDIS_URL,
    REPO,
    _redis_reachable,
    _try_create_bucket,
    free_port,
    make_key,
    pg_schema,
    wait_for,
)

# Small and quick on two CPU cores; the KV cache sized in blocks, not bytes. fp32, the exact
# mode: the tests compare served tokens with offline ones, and ``auto`` is bf16 on a CPU with
# bf16 units, whose tokens may depend on how requests were batched.
ENGINE_OPTIONS = {"device": "cpu", "dtype": "float32", "max_num_seqs": 8, "num_kv_blocks": 256,
                  "num_threads": 1}


@dataclass
class Endpoint:
    """Where a running service answers, and a key for it."""

    base_url: str
    api_key: str
    db_url: str
    extra: dict = field(default_factory=dict)


@pytest.fixture
def embedded(tmp_path, tiny_model_dir):
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'boxcar.db'}", storage_url=str(tmp_path / "storage"),
        model=str(tiny_model_dir), engine_options=ENGINE_OPTIONS, shard_size=8,
        poll_interval=0.1, finalize_scan_interval=1.0,
    )
    server = EmbeddedServer(settings, port=free_port()).start()
    yield Endpoint(server.base_url, server.api_key, settings.database_url,
                   {"server": server})
    server.stop()


class ApiThread:
    """The production API (``create_app``) served by uvicorn in a thread."""

    def __init__(self, settings: Settings) -> None:
        self.port = free_port()
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 30, 0.05, "the API")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@dataclass
class Production:
    base_url: str
    api_key: str
    db_url: str
    env: dict[str, str]
    logdir: str
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start_worker(self, name: str, *, module: str = "cli.main",
                     env: dict[str, str] | None = None) -> subprocess.Popen:
        """``module`` runs ``boxcar`` (tests/system/faulty_worker.py wraps it to inject faults)."""
        log_path = os.path.join(self.logdir, f"{name}.log")
        log = open(log_path, "ab")
        offset = log.tell()
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "worker", "--concurrency", "2",
             "--hostname", f"{name}@boxcar-test"],
            cwd=REPO, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.workers[name] = proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {name} exited:\n{open(log_path).read()[-3000:]}")
            with open(log_path, "rb") as f:
                f.seek(offset)
                return b"ready." in f.read()

        wait_for(ready, 90, 0.2, f"worker {name} to start")
        return proc

    def kill_worker(self, name: str) -> None:
        proc = self.workers.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def log_of(self, name: str) -> str:
        return open(os.path.join(self.logdir, f"{name}.log")).read()

    def stop(self) -> None:
        for proc in self.workers.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
        self.workers.clear()


def _drop_queues(namespace: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"*{namespace}*"):  # queues and kombu's binding keys
        client.delete(key)


@pytest.fixture(scope="module")
def production(seaweedfs, tiny_model_dir, tmp_path_factory):
    """API + Celery workers on PostgreSQL, Redis and SeaweedFS; workers start on demand."""
    if not _redis_reachable():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    bucket = f"bx-{uuid.uuid4().hex[:12]}"
    wait_for(lambda: _try_create_bucket(seaweedfs.client(), bucket), 20, 0.2, "a bucket")
    namespace = f"bxtest-{uuid.uuid4().hex[:8]}"
    logdir = str(tmp_path_factory.mktemp("workers"))
    with pg_schema() as db_url:
        env_settings = {
            "BOXCAR_DATABASE_URL": db_url,
            "BOXCAR_BROKER_URL": REDIS_URL,
            "BOXCAR_QUEUE_NAMESPACE": namespace,
            "BOXCAR_STORAGE_URL": f"s3://{bucket}/boxcar",
            "BOXCAR_MODEL": str(tiny_model_dir),
            "BOXCAR_ENGINE_OPTIONS": json.dumps(ENGINE_OPTIONS),
            "BOXCAR_SHARD_SIZE": "8",
            "BOXCAR_LEASE_SECONDS": "3",
            "BOXCAR_POLL_INTERVAL": "0.2",
            "BOXCAR_FINALIZE_SCAN_INTERVAL": "1",
            **seaweedfs.env(),
        }
        os.environ.update(seaweedfs.env())  # the API in this process talks to S3 too
        settings = Settings(database_url=db_url, broker_url=REDIS_URL, queue_namespace=namespace,
                            storage_url=f"s3://{bucket}/boxcar", model=str(tiny_model_dir),
                            s3_endpoint_url=seaweedfs.endpoint_url)
        db = Database(db_url)
        upgrade(db)
        api = ApiThread(settings)
        env = {**os.environ, **env_settings, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
        stack = Production(f"http://127.0.0.1:{api.port}", make_key(db), db_url, env, logdir)
        try:
            yield stack
        finally:
            stack.stop()
            api.stop()
            db.dispose()
            _drop_queues(namespace)



@pytest.fixture(scope="session")
def private_stack(tiny_model_dir):
    """API, two workers, PostgreSQL, Redis and SeaweedFS, all private to this run, for the tests
    that kill or restart them (tests/system/test_faults.py, test_load.py)."""
    from tests.system.stack import PrivateStack, running

    stack = PrivateStack(str(tiny_model_dir))
    with running(stack):
        yield stack
