"""A production stack made only of private processes, so a test may kill or restart any part:
PostgreSQL (initdb into a temporary folder), Redis and SeaweedFS on free ports, one or more API
processes (``boxcar api``) and Celery workers (``boxcar worker``) as subprocesses. The
services may reach PostgreSQL through a proxy the test owns (``database_proxy``).

The machine's shared PostgreSQL (5432) and Redis (6379) are never touched. Everything is
stopped in ``PrivateStack.close`` whatever happened.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.conftest_services import (
    REPO,
    PrivateSeaweed,
    _quiet,
    _stop_group,
    free_port,
    wait_for,
)


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM over from the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class PrivatePostgres:
    """A throwaway cluster: ``initdb`` once, then ``pg_ctl`` start/stop on a fixed free port."""

    def __init__(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        if not bins and shutil.which("pg_ctl") is None:
            raise RuntimeError("PostgreSQL server binaries (pg_ctl, initdb) are not installed")
        self.bindir = os.path.dirname(bins[-1]) if bins else os.path.dirname(
            shutil.which("pg_ctl"))
        self.root = tempfile.mkdtemp(prefix="boxcar-pg-")
        self.datadir = os.path.join(self.root, "data")
        self.port = free_port()
        # As root the server must run as another user: postgres, when the machine has one.
        self._as = None
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("no 'postgres' user to run the server as: PostgreSQL is "
                                   "not installed as a package") from None
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 120) -> None:
        cmd = [*(self._as or []), *args]
        subprocess.run(cmd, check=True, timeout=timeout, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, cwd=self.root)

    def start(self) -> None:
        if not os.path.exists(self.datadir):
            self._run(os.path.join(self.bindir, "initdb"), "-D", self.datadir, "-U", "postgres",
                      "--auth=trust", "--no-sync", "-E", "UTF8")
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c full_page_writes=off -c synchronous_commit=off -c max_connections=200")
        self._run(os.path.join(self.bindir, "pg_ctl"), "-D", self.datadir, "-o", options,
                  "-l", os.path.join(self.root, "server.log"), "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        if os.path.exists(os.path.join(self.datadir, "postmaster.pid")):
            self._run(os.path.join(self.bindir, "pg_ctl"), "-D", self.datadir, "-m", mode,
                      "-w", "-t", "60", "stop")

    def close(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class PrivateRedis:
    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis(port=self.port, socket_timeout=1)
        wait_for(lambda: _quiet(client.ping), 20, 0.05, "private Redis")

    def stop(self) -> None:
        _stop_group(self.proc, signal.SIGKILL)
        self.proc = None

    close = stop


@dataclass
class PrivateStack:
    """The whole production service on private servers; every part can be killed and started."""

    model_dir: str
    extra_env: dict[str, str] = field(default_factory=dict)
    pg: PrivatePostgres | None = None
    redis: PrivateRedis | None = None
    weed: PrivateSeaweed | None = None
    api_key: str = ""
    logdir: str = ""
    bucket: str = ""
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    # What ``python -m`` runs as ``boxcar`` for a worker (e.g. ``bench.scale_worker``: a fake
    # engine, or a test's wrapper of it).
    worker_module: str = "cli.main"
    # ``boxcar api`` processes on the one database (the first is ``api`` / ``base_url``).
    num_apis: int = 1
    # Something the services reach PostgreSQL through (a fault proxy): ``start(host, port)``
    # returns the port to connect to instead. The stack's own set-up connects directly.
    database_proxy: Any = None
    apis: list[subprocess.Popen | None] = field(default_factory=list)
    api_ports: list[int] = field(default_factory=list)
    # A worker's own environment (over the stack's), kept for its restarts.
    worker_envs: dict[str, dict[str, str]] = field(default_factory=dict)

    def start(self) -> PrivateStack:
        from service.db import Database
        from service.migrate import upgrade
        from tests.conftest_services import _try_create_bucket, make_key
        from tests.system.conftest import ENGINE_OPTIONS

        self.logdir = tempfile.mkdtemp(prefix="boxcar-stack-")
        self.pg, self.redis, self.weed = PrivatePostgres(), PrivateRedis(), PrivateSeaweed()
        self.pg.start()
        self.redis.start()
        self.weed.start()
        self.bucket = f"bx-{uuid.uuid4().hex[:12]}"
        client = self.weed.server.client()
        wait_for(lambda: _try_create_bucket(client, self.bucket), 30, 0.2, "a bucket")
        database_url = self.pg.url
        if self.database_proxy is not None:
            port = self.database_proxy.start("127.0.0.1", self.pg.port)
            database_url = database_url.replace(f":{self.pg.port}/", f":{port}/")
        self.env = {
            **os.environ, **self.weed.server.env(),
            "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1",
            "BOXCAR_DATABASE_URL": database_url,
            "BOXCAR_BROKER_URL": self.redis.url,
            "BOXCAR_QUEUE_NAMESPACE": "bxfault",
            "BOXCAR_STORAGE_URL": f"s3://{self.bucket}/boxcar",
            "BOXCAR_S3_CREATE_BUCKET": "false",
            "BOXCAR_MODEL": self.model_dir,
            "BOXCAR_ENGINE_OPTIONS": json.dumps(ENGINE_OPTIONS),
            "BOXCAR_SHARD_SIZE": "16",
            "BOXCAR_LEASE_SECONDS": "3",
            "BOXCAR_POLL_INTERVAL": "0.2",
            "BOXCAR_FINALIZE_SCAN_INTERVAL": "1",
            "BOXCAR_COMPLETION_WINDOWS": json.dumps(["24h", "4s"]),
            **self.extra_env,
        }
        db = Database(self.pg.url)
        upgrade(db)
        self.api_key = make_key(db, "acme")
        db.dispose()
        for index in range(self.num_apis):
            self.start_api(index)
        return self

    def heal(self, workers: tuple[str, ...] = ("w1", "w2")) -> PrivateStack:
        """Every server and the API up, and these workers running (after a test killed some)."""
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            self.redis.start()
        if self.weed.proc is None or self.weed.proc.poll() is not None:
            self.weed.start()
        if not os.path.exists(os.path.join(self.pg.datadir, "postmaster.pid")):
            self.pg.start()
        for index, api in enumerate(self.apis):
            if api is None or api.poll() is not None:
                self.start_api(index)
        for name in workers:
            proc = self.workers.get(name)
            if proc is None or proc.poll() is not None:
                self.workers.pop(name, None)
                self.restart_worker(name)
        return self

    # -- the API process ---------------------------------------------------------------------

    @property
    def api(self) -> subprocess.Popen | None:
        return self.apis[0] if self.apis else None

    @property
    def api_port(self) -> int:
        return self.api_ports[0] if self.api_ports else 0

    @property
    def base_url(self) -> str:
        return self.base_urls[0]

    @property
    def base_urls(self) -> list[str]:
        """Every API process's URL, whether it is up or not."""
        return [f"http://127.0.0.1:{port}" for port in self.api_ports]

    def client(self, timeout: float = 30, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout,
                            headers={"Authorization": f"Bearer {key or self.api_key}"})

    def start_api(self, index: int = 0) -> float:
        """Start API process ``index`` (again on its port); returns the seconds until it
        answered /healthz."""
        started = time.monotonic()
        while len(self.api_ports) <= index:
            self.api_ports.append(free_port())
            self.apis.append(None)
        name = "api" if index == 0 else f"api{index + 1}"
        log = open(os.path.join(self.logdir, f"{name}.log"), "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "api", "--host", "127.0.0.1",
             "--port", str(self.api_ports[index])],
            cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.apis[index] = proc
        url = self.base_urls[index]

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the API exited:\n{self.log_of(name)[-3000:]}")
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 60, 0.05, "the API")
        return time.monotonic() - started

    def kill_api(self, index: int = 0) -> None:
        _stop_group(self.apis[index], signal.SIGKILL)

    # -- workers -------------------------------------------------------------------------------

    def start_worker(self, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start worker ``name`` (``env`` over the stack's; none: the stack's alone) and wait
        until Celery is ready."""
        return self.start_workers({name: env})[name]

    def restart_worker(self, name: str) -> subprocess.Popen:
        """Start worker ``name`` again with the environment it was last started with (a fault
        run's restart of a killed worker)."""
        return self.start_workers({name: self.worker_envs.get(name)})[name]

    def start_workers(self, envs: dict[str, dict[str, str] | None]) -> dict[str, subprocess.Popen]:
        """Start these workers at once (each with its ``env`` as in ``start_worker``), then
        wait until each is ready: their start-ups overlap."""
        waits = []
        for name, env in envs.items():
            self.worker_envs[name] = env or {}
            log_path = os.path.join(self.logdir, f"{name}.log")
            log = open(log_path, "ab")
            offset = log.tell()
            proc = subprocess.Popen(
                [sys.executable, "-m", self.worker_module, "worker", "--concurrency", "2",
                 "--hostname", f"{name}@boxcar-fault"],
                cwd=REPO, env={**self.env, **self.worker_envs.get(name, {})}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            self.workers[name] = proc
            waits.append((name, proc, log_path, offset))
        for name, proc, log_path, offset in waits:

            def ready(name=name, proc=proc, log_path=log_path, offset=offset) -> bool:
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {name} exited:\n{self.log_of(name)[-3000:]}")
                with open(log_path, "rb") as f:
                    f.seek(offset)
                    return b"ready." in f.read()

            wait_for(ready, 120, 0.1, f"worker {name} to start")
        return {name: self.workers[name] for name in envs}

    def kill_worker(self, name: str) -> int:
        proc = self.workers.pop(name)
        _stop_group(proc, signal.SIGKILL)
        return proc.pid

    def stop_workers(self) -> None:
        for proc in self.workers.values():
            _stop_group(proc)
        self.workers.clear()

    def log_of(self, name: str) -> str:
        with open(os.path.join(self.logdir, f"{name}.log"), errors="replace") as f:
            return f.read()

    def close(self) -> None:
        parts = [self.stop_workers, *(lambda api=api: _stop_group(api) for api in self.apis),
                 *(p.close for p in (self.weed, self.redis, self.pg) if p is not None)]
        if self.database_proxy is not None:
            parts.append(self.database_proxy.close)
        for part in parts:
            try:
                part()
            except Exception as exc:  # keep stopping the rest
                print(f"stopping a part of the private stack failed: {exc}", file=sys.stderr)
        shutil.rmtree(self.logdir, ignore_errors=True)


BOUNDARY = "boxcar-test-boundary"
MULTIPART_HEADERS = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


@contextmanager
def running(stack: PrivateStack) -> Iterator[PrivateStack]:
    """``stack`` started for a test (skipped, saying why, where a server is not installed) and
    closed after it."""
    try:
        try:
            stack.start()
        except RuntimeError as exc:
            if "not installed" in str(exc):
                pytest.skip(str(exc))
            raise
        yield stack
    finally:
        stack.close()


def multipart_upload(lines: Iterable[bytes], *, chunk_bytes: int = 256 << 10,
                     sent: list[int] | None = None, pause: float = 0.0) -> Iterator[bytes]:
    """A ``/v1/files`` body (purpose=batch, file=lines) generated on the fly in chunks of about
    ``chunk_bytes``, so the client never holds the file either. ``sent`` counts file bytes."""
    yield (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
           f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
           f"filename=\"upload.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n").encode()
    buffer = bytearray()
    for line in lines:
        buffer += line
        if len(buffer) >= chunk_bytes:
            if sent is not None:
                sent[0] += len(buffer)
            yield bytes(buffer)
            buffer.clear()
            if pause:
                time.sleep(pause)
    if sent is not None:
        sent[0] += len(buffer)
    yield bytes(buffer) + f"\r\n--{BOUNDARY}--\r\n".encode()
