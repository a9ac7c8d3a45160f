"""The production service for one run of the scale benchmark: a fresh PostgreSQL database, a
private Redis queue namespace, a temporary storage folder, a real ``boxcar api`` process and N
``boxcar worker`` processes (``bench.scale_worker``: the fake engine). ``close()`` stops every
process it started, drops the database and deletes the queues and the folder, whatever happened.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

REPO = str(Path(__file__).resolve().parents[1])
WORKER_START_TIMEOUT_S = 300.0  # 32 workers importing Celery and SQLAlchemy on 2 busy cores


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM the process group (Celery's warm shutdown hands shards back), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


class ScaleStack:
    def __init__(self, *, server_url: str, broker_url: str, engine_env: dict[str, str]) -> None:
        self.server_url = server_url  # a database on the server, used to create and drop ours
        self.broker_url = broker_url
        self.name = f"boxcar_scale_{uuid.uuid4().hex[:10]}"
        self.namespace = f"bxscale-{uuid.uuid4().hex[:8]}"
        self.database_url = make_url(server_url).set(database=self.name).render_as_string(
            hide_password=False)
        self.root = tempfile.mkdtemp(prefix="boxcar-scale-")
        self.env = {
            **os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1",
            "BOXCAR_DATABASE_URL": self.database_url,
            "BOXCAR_BROKER_URL": broker_url,
            "BOXCAR_QUEUE_NAMESPACE": self.namespace,
            "BOXCAR_STORAGE_URL": os.path.join(self.root, "storage"),
            "BOXCAR_OPERATOR_KEY": secrets.token_urlsafe(24),  # boxcar status --api
            **engine_env,
        }
        self.api: subprocess.Popen | None = None
        self.api_port = 0
        self.api_key = ""
        self.workers: list[subprocess.Popen] = []
        self.killed: set[int] = set()  # indexes of workers killed on purpose
        self._created = False

    # -- start ---------------------------------------------------------------------------------

    def create_database(self) -> None:
        from service.db import Database
        from service.keys import create_key
        from service.migrate import upgrade

        admin = create_engine(self.server_url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{self.name}"'))
            self._created = True
        finally:
            admin.dispose()
        db = Database(self.database_url)
        try:
            upgrade(db)
            with db.session() as session:
                self.api_key = create_key(session, tenant_name="bench").key
        finally:
            db.dispose()

    def start_api(self) -> None:
        self.api_port = free_port()
        log = open(os.path.join(self.root, "api.log"), "ab")
        self.api = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "api", "--host", "127.0.0.1",
             "--port", str(self.api_port)],
            cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

        def up() -> bool:
            if self.api is not None and self.api.poll() is not None:
                raise RuntimeError(f"the API exited:\n{self.log_tail('api')}")
            try:
                return httpx.get(f"{self.base_url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 60, "the API")

    def launch_workers(self, num_workers: int) -> None:
        """Start them all at once (they import in parallel); ``wait_workers`` waits for them."""
        for i in range(num_workers):
            log = open(os.path.join(self.root, f"w{i}.log"), "ab")
            self.workers.append(subprocess.Popen(
                [sys.executable, "-m", "bench.scale_worker", "worker", "--concurrency", "1",
                 "--hostname", f"w{i}@{self.namespace}"],
                cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
            log.close()

    def check_workers(self) -> None:
        """Raise, with its log, if a worker exited: a run must not go on short of workers
        (but for those ``kill_worker`` killed on purpose)."""
        for i, proc in enumerate(self.workers):
            if i not in self.killed and proc.poll() is not None:
                raise RuntimeError(f"worker w{i} exited with status {proc.returncode}:\n"
                                   f"{self.log_tail(f'w{i}')}")

    def kill_worker(self, index: int) -> None:
        """SIGKILL worker ``index`` and its children: no warm shutdown, its shards stay leased
        to a dead worker until the lease runs out and another takes them over."""
        os.killpg(self.workers[index].pid, signal.SIGKILL)
        self.workers[index].wait(10)
        self.killed.add(index)

    def wait_workers(self) -> None:
        def all_ready() -> bool:
            self.check_workers()
            return all(b"ready." in Path(self.root, f"w{i}.log").read_bytes()
                       for i in range(len(self.workers)))

        wait_until(all_ready, WORKER_START_TIMEOUT_S, f"{len(self.workers)} workers to start", 0.5)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout,
                            headers={"Authorization": f"Bearer {self.api_key}"})

    def log_tail(self, name: str, num_chars: int = 3000) -> str:
        path = Path(self.root, f"{name}.log")
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    # -- stop ----------------------------------------------------------------------------------

    def close(self) -> None:
        for part in (self._stop_processes, self._drop_database, self._drop_queues,
                     lambda: shutil.rmtree(self.root, ignore_errors=True)):
            try:
                part()
            except Exception as exc:  # keep cleaning up the rest
                print(f"bench.scale: cleaning up failed: {exc}", file=sys.stderr)

    def _stop_processes(self) -> None:
        for proc in self.workers:  # all signalled first: they shut down in parallel
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in [*self.workers, *([self.api] if self.api else [])]:
            _stop_group(proc)
        self.workers.clear()

    def _drop_database(self) -> None:
        if not self._created:
            return
        admin = create_engine(self.server_url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        finally:
            admin.dispose()

    def _drop_queues(self) -> None:
        import redis

        client = redis.Redis.from_url(self.broker_url)
        for key in client.scan_iter(f"*{self.namespace}*"):  # queues and kombu's bindings
            client.delete(key)
