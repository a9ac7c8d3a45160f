"""A status poller in a process of its own, as a user's client is: every poll opens a new TCP
connection (no keep-alive), sends ``GET /v1/batches/{id}``, reads the whole answer and closes,
then sleeps ``--interval``. It stops when the batch is no longer live or on SIGTERM, and prints
one JSON document: every poll of the live batch (client ms from connect to the last body byte,
the API's Server-Timing ``app`` and ``db`` ms, the status) and the polls it left out.

    python -m bench.scale_poller --url http://127.0.0.1:8000 --key KEY --batch batch_... \
        --interval 0.1

``bench.scale`` starts it once the batch is in progress, while its workers run. The bench's own
process (its sampler thread, its kept-alive client) plays no part in these figures.
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
from urllib.parse import urlsplit

LIVE = ("validating", "in_progress", "finalizing")


@dataclass(frozen=True)
class TimedPoll:
    client_ms: float
    server_ms: float | None
    connect_ms: float  # of client_ms: the new connection's TCP handshake
    db_ms: float | None
    status: str


def poll_once(host: str, port: int, path: str, key: str, timeout: float) -> TimedPoll:
    """One poll on a new connection, timed from before connect to after the last byte."""
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
    return TimedPoll(1000 * took, server_timing_ms(header), 1000 * (connected - start),
                     server_timing_ms(header, "db"), json.loads(body)["status"])


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
                 cwd: str, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.scale_poller", "--url", base_url, "--key", api_key,
             "--batch", batch_id, "--interval", str(interval)],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._polls: list[TimedPoll] | None = None

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
        if self._proc.returncode != 0:
            raise RuntimeError(f"the poller exited with {self._proc.returncode} (stdout "
                               f"{out[:200]!r}): {err[-2000:]}")
        return [TimedPoll(**p) for p in json.loads(out)["polls"]]


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
    args = parser.parse_args(argv)
    url = urlsplit(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    path = f"/v1/batches/{args.batch}"
    polls: list[TimedPoll] = []
    num_not_live = 0
    while not stopping and len(polls) < args.max_polls:
        poll = poll_once(host, port, path, args.key, args.timeout)
        if poll.status not in LIVE:
            num_not_live += 1
            break
        polls.append(poll)
        time.sleep(args.interval)
    json.dump({"polls": [asdict(p) for p in polls], "num_not_live": num_not_live}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
