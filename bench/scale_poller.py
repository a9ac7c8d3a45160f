"""A status poller in a process of its own, as a user's client is: every poll opens a new TCP
connection (no keep-alive), sends ``GET /v1/batches/{id}`` (``--what batch``) or the first page
of the list, ``GET /v1/batches?limit=N`` (``--what list``), reads the whole answer and closes,
then sleeps ``--interval``. ``--what status`` runs ``boxcar status --api`` instead (its
``cli.status_client``: ``GET /v1/status`` with the operator's key, ``BOXCAR_OPERATOR_KEY``, on a
new connection); ``--what status_db`` runs its database part (``bench.scale_status``: a new
PostgreSQL connection, one round trip with the schema's check and the reads, the report), and
once at the end explains its statements. It stops when the batch is no
longer live or on SIGTERM, and prints one JSON document: every poll of the live batch (client ms
from connect to the last body byte, the API's Server-Timing ``app`` and ``db`` ms, the status)
and the polls it left out.

    python -m bench.scale_poller --url http://127.0.0.1:8000 --key KEY --batch batch_... \
        --interval 0.1 [--what list --list-limit 20]

``bench.scale`` starts one of each once the batch is in progress, while its workers run. The
bench's own process (its sampler thread, its kept-alive client) plays no part in these figures.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

LIVE = ("validating", "in_progress", "finalizing")
WHATS = ("batch", "list", "status", "status_db")


@dataclass(frozen=True)
class TimedPoll:
    client_ms: float
    server_ms: float | None
    connect_ms: float  # of client_ms: the new connection (TCP handshake; status_db: PostgreSQL's)
    db_ms: float | None  # the API's Server-Timing db ms; status_db: all after connecting
    status: str


def poll_once(host: str, port: int, path: str, key: str, timeout: float,
              batch_id: str | None = None) -> TimedPoll:
    """One poll on a new connection, timed from before connect to after the last byte; the
    status is the answer's, or with ``batch_id`` (a list) that batch's in the page."""
    from api.timing import server_timing_ms  # imported once main() can be stopped
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.connect()
        connected = time.perf_counter()
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}",
                                           "Connection": "close"})
        response = conn.getresponse()
        body = response.read()
        took = time.perf_counter() - start
        header = response.getheader("server-timing")
        if response.status != 200:
            raise RuntimeError(f"GET {path} answered {response.status}: {body[:300]!r}")
    finally:
        conn.close()
    data = json.loads(body)
    status = data["status"] if batch_id is None else next(
        (b["status"] for b in data["data"] if b["id"] == batch_id), "absent")
    return TimedPoll(1000 * took, server_timing_ms(header), 1000 * (connected - start),
                     server_timing_ms(header, "db"), status)


def api_status_once(status: Any, batch_id: str) -> TimedPoll:
    """One ``boxcar status --api`` report (``status``: its ``cli.status_client.ApiStatus``)."""
    from api.timing import server_timing_ms
    from bench.scale_status import batch_status

    start = time.perf_counter()
    report = status.collect()
    took = time.perf_counter() - start
    return TimedPoll(1000 * took, server_timing_ms(status.server_timing),
                     1000 * status.connect_s, server_timing_ms(status.server_timing, "db"),
                     batch_status(report, batch_id))


def status_once(database_url: str, batch_id: str, interval: float) -> TimedPoll:
    from bench.scale_status import batch_status, timed_status

    opened_ms, collect_ms, report = timed_status(database_url, interval=interval)
    return TimedPoll(opened_ms + collect_ms, None, opened_ms, collect_ms,
                     batch_status(report, batch_id))


def quantile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0.5: the median's upper neighbour for an even count,
    0.95: the value 95% of polls were at or under); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class PollerProcess:
    """``python -m bench.scale_poller`` started against one batch, stopped with ``stop``."""

    def __init__(self, *, base_url: str, api_key: str, batch_id: str, interval: float,
                 cwd: str, env: dict[str, str], what: str = "batch",
                 list_limit: int = 20) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.scale_poller", "--url", base_url, "--key", api_key,
             "--batch", batch_id, "--interval", str(interval), "--what", what,
             "--list-limit", str(list_limit)],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._polls: list[TimedPoll] | None = None
        self.explained: dict[str, Any] | None = None  # status: its statements, explained

    def stop(self, timeout: float = 60.0) -> list[TimedPoll]:
        """Its polls of the live batch (it stops by itself once the batch is not live); again
        the same polls when called again."""
        if self._polls is None:
            self._polls = self._stop(timeout)
        return self._polls

    def _stop(self, timeout: float) -> list[TimedPoll]:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
        out, err = self._proc.communicate(timeout=timeout)
        if self._proc.returncode == -signal.SIGTERM and not out:
            return []  # stopped before main() took the signal: it had polled nothing
        # Stopped after it printed its report, while it exited (Python gives SIGTERM back its
        # default action as the interpreter shuts down): the report stands, if it is whole.
        printed = self._proc.returncode == -signal.SIGTERM and out.rstrip().endswith("}")
        if self._proc.returncode != 0 and not printed:
            raise RuntimeError(f"the poller exited with {self._proc.returncode} (stdout "
                               f"{out[:200]!r}): {err[-2000:]}")
        found = json.loads(out)
        self.explained = found.get("explained")
        return [TimedPoll(**p) for p in found["polls"]]


def main(argv: list[str] | None = None) -> int:
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    parser = argparse.ArgumentParser(prog="python -m bench.scale_poller", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--batch", required=True)
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--max-polls", type=int, default=100_000)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--what", choices=WHATS, default="batch")
    parser.add_argument("--list-limit", type=int, default=20)
    args = parser.parse_args(argv)
    url = urlsplit(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    if args.what == "status":
        from cli.status_client import ApiStatus
        from service.settings import Settings

        key = Settings().operator_key  # BOXCAR_OPERATOR_KEY, as ``boxcar status`` reads it
        if key is None:
            parser.error("--what status needs BOXCAR_OPERATOR_KEY")
        api_status = ApiStatus(args.url, key.get_secret_value(), timeout=args.timeout)

        def poll() -> TimedPoll:
            return api_status_once(api_status, args.batch)
    elif args.what == "status_db":
        from service.settings import Settings

        settings = Settings()  # BOXCAR_DATABASE_URL, as ``boxcar status`` reads it

        def poll() -> TimedPoll:
            return status_once(settings.database_url, args.batch,
                               settings.worker_metrics_interval)
    else:
        path, listed = ((f"/v1/batches/{args.batch}", None) if args.what == "batch" else
                        (f"/v1/batches?limit={args.list_limit}", args.batch))

        def poll() -> TimedPoll:
            return poll_once(host, port, path, args.key, args.timeout, listed)
    polls: list[TimedPoll] = []
    num_not_live = 0
    while not stopping and len(polls) < args.max_polls:
        found = poll()
        if found.status not in LIVE:
            num_not_live += 1
            break
        polls.append(found)
        time.sleep(args.interval)
    explained = None
    if args.what == "status_db":
        from bench.scale_status import explained_status

        explained = explained_status(settings.database_url,
                                     interval=settings.worker_metrics_interval)
    json.dump({"polls": [asdict(p) for p in polls], "num_not_live": num_not_live,
               "explained": explained}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
