"""The chaos run's database proxy (bench/chaos_proxy.py): bytes pass through unchanged, a delay
holds each chunk a draw from its range, a stall holds it until the stall ends, clear ends
either; against an echo server on loopback, with the proxy's waits recorded, not slept."""

from __future__ import annotations

import socket
import threading

import pytest

from bench.chaos_proxy import DelayProxy


@pytest.fixture
def echo_port():
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def _round_trip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += sock.recv(65536)
        return got


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_bytes_pass_through_and_a_delay_holds_each_chunk(echo_port):
    clock = Clock()
    proxy = DelayProxy(seed=1, clock=lambda: clock.now, sleep=clock.sleep)
    port = proxy.start("127.0.0.1", echo_port)
    try:
        assert _round_trip(port, b"select 1") == b"select 1"
        assert clock.slept == [] and proxy.num_connections == 1
        proxy.delay(0.05, 0.5)
        payload = bytes(range(256)) * 8
        assert _round_trip(port, payload) == payload
        # at least one chunk each way, each held a draw from the range
        assert len(clock.slept) >= 2 and all(0.05 <= s <= 0.5 for s in clock.slept)
        proxy.clear()
        clock.slept.clear()
        assert _round_trip(port, b"again") == b"again" and clock.slept == []
    finally:
        proxy.close()


def test_a_stall_holds_chunks_until_it_ends():
    clock = Clock()
    proxy = DelayProxy(clock=lambda: clock.now, sleep=clock.sleep)
    proxy.stall(3.0)
    assert proxy.hold_for() == pytest.approx(3.0)
    clock.now += 2.0
    assert proxy.hold_for() == pytest.approx(1.0)
    proxy.delay(0.1, 0.1)
    assert proxy.hold_for() == pytest.approx(1.1)  # a delay on top of what is left
    clock.now += 5.0
    assert proxy.hold_for() == pytest.approx(0.1)
    proxy.clear()
    assert proxy.hold_for() == 0.0


def test_bad_faults_are_refused():
    proxy = DelayProxy()
    with pytest.raises(ValueError, match="low_s <= high_s"):
        proxy.delay(0.5, 0.1)
    with pytest.raises(ValueError, match=">= 0 seconds"):
        proxy.stall(-1)


def test_a_server_away_is_a_refused_connection(echo_port):
    proxy = DelayProxy()
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    port = proxy.start("127.0.0.1", dead_port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            assert sock.recv(10) == b""  # closed at once: what a client sees of a restart
    finally:
        proxy.close()
