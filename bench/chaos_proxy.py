"""The chaos run's network fault to the database: a TCP proxy on loopback that every service
connects to PostgreSQL through (``PrivateStack(database_proxy=...)``), so the bench can slow or
stall that link without root (``tc netem`` needs CAP_NET_ADMIN; this needs a port).

Each connection is two pumps (client -> server, server -> client), one thread each. A pump
reads a chunk (up to ``CHUNK`` bytes), then, before forwarding it, waits out the proxy's
current fault: ``delay(low_s, high_s)`` holds each chunk a uniform draw from that range (a
query and its answer each pay one draw, so a round trip pays two), ``stall(seconds)`` holds
every chunk until the stall ends. Chunks of one direction keep their order (one pump), so
the link is slow, never corrupt: what PostgreSQL's clients see is a far or congested server,
and a stall past their timeouts is a dead one. ``clear()`` ends either.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable

CHUNK = 64 << 10


class DelayProxy:
    def __init__(self, *, seed: int = 0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._rng = random.Random(seed)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._delay: tuple[float, float] | None = None
        self._stall_until = 0.0
        self._listener: socket.socket | None = None
        self._target: tuple[str, int] | None = None
        self._sockets: set[socket.socket] = set()
        self._closed = threading.Event()
        self.num_connections = 0
        self.num_chunks_held = 0  # chunks that waited out a fault

    # -- faults --------------------------------------------------------------------------------

    def delay(self, low_s: float, high_s: float) -> None:
        """From now on, hold each chunk ``uniform(low_s, high_s)`` seconds."""
        if not 0 <= low_s <= high_s:
            raise ValueError(f"a delay needs 0 <= low_s <= high_s, got {low_s} and {high_s}")
        with self._lock:
            self._delay = (low_s, high_s)

    def stall(self, seconds: float) -> None:
        """Hold every chunk until ``seconds`` from now."""
        if seconds < 0:
            raise ValueError(f"a stall lasts >= 0 seconds, got {seconds}")
        with self._lock:
            self._stall_until = self._clock() + seconds

    def clear(self) -> None:
        with self._lock:
            self._delay, self._stall_until = None, 0.0

    def hold_for(self) -> float:
        """Seconds the next chunk waits, under the current fault (0: none)."""
        with self._lock:
            wait = max(0.0, self._stall_until - self._clock())
            if self._delay is not None:
                wait += self._rng.uniform(*self._delay)
        return wait

    # -- the proxy -----------------------------------------------------------------------------

    def start(self, host: str, port: int) -> int:
        """Forward to ``host:port``; returns the loopback port to connect to instead."""
        self._target = (host, port)
        listener = socket.create_server(("127.0.0.1", 0))
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True,
                         name="db-proxy-accept").start()
        return listener.getsockname()[1]

    def _accept(self, listener: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                client, _ = listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(self._target, timeout=5)
                server.settimeout(None)
            except OSError:  # the server is away (a restart): the client sees a refusal
                client.close()
                continue
            self.num_connections += 1
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets.update((client, server))
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True,
                                 name="db-proxy-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                chunk = src.recv(CHUNK)
                if not chunk:
                    break
                wait = self.hold_for()
                if wait > 0:
                    self.num_chunks_held += 1
                    self._sleep(wait)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            # One side gone: end both, as a broken link ends a connection.
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
                with self._lock:
                    self._sockets.discard(sock)

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
