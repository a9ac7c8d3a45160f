"""The Celery-on-Redis redelivery traps, on a private stack (tests/system/stack.py) whose broker
gives an unacked message back after 2 s (``visibility_timeout``, swept every second), with real
``boxcar worker`` processes on the paced fake engine (``bench.scale_worker``), so a shard runs
several seconds:

- a shard runs longer than the visibility timeout, and every task message is held past it
  (``tests/system/slow_task_worker.py``), so kombu delivers each a second time and its task body
  (wake a claim, prepare a batch) runs twice;
- a worker loses its broker connection mid-shard (its Redis goes through a proxy the test
  cuts) for longer than the visibility timeout, while the other worker's broker stays up;
- a worker is paused (SIGSTOP) past its lease and the visibility timeout, then resumes;
- the broker goes silent without closing the connection: a doorbell's send gives up after the
  socket timeout instead of holding its thread (the API's request, a worker's lease thread)
  for as long as the silence lasts.

Either way the shard's lease in the database, not the broker, decides who runs a line: the
cut-off worker keeps its shards and writes their results, nobody takes them over, and the
output and error files hold each custom_id exactly once (docs/operations.md, "Broker
messages").
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time

import pytest

from service.queue import CeleryQueue
from tests.conftest_services import chat_line, free_port, wait_for
from tests.figures import record
from tests.system.test_faults import create_batch, outcome, sql, upload

TABLE = "Redelivery traps: every custom_id exactly once (fake engine, 2 s visibility timeout)"
VISIBILITY_S = 2
TASK_S = 4.0  # > the visibility timeout plus a sweep: every first delivery is given back
# A full engine (64 seats) finishes 16 lines a second; a line takes 8 steps: 4 s, so every
# 16-line shard outlives the visibility timeout.
LINES_PER_S = 16
WORKERS = ("w1", "w2")


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    from tests.system.stack import PrivateStack, running

    stack = PrivateStack(str(tiny_model_dir), worker_module="tests.system.slow_task_worker",
                         extra_env={
                             "BOXCAR_BROKER_TRANSPORT_OPTIONS": json.dumps({
                                 "visibility_timeout": VISIBILITY_S,
                                 "unacked_restore_interval": 1,
                                 "unacked_restore_throttle": 1}),
                             "BOXCAR_BENCH_ENGINE": "paced",
                             "BOXCAR_BENCH_LINES_PER_S": str(LINES_PER_S),
                         })
    with running(stack):
        yield stack


def lines_of(tag: str, num_lines: int) -> list[dict]:
    return [chat_line(f"{tag}-{i:04d}", f"line {i} of {tag}") for i in range(num_lines)]


def wait_done(client, batch_id: str, timeout: float = 120) -> dict:
    return wait_for(lambda: (b := client.get(f"/v1/batches/{batch_id}").json())["status"]
                    in ("completed", "failed", "expired", "cancelled") and b,
                    timeout, 0.2, f"batch {batch_id} to finish")


def first_line_s(stack, batch_id: str) -> float:
    """Seconds from the batch's first claimable shard to its first finished line: no shard
    of it finished sooner after its claim."""
    return float(sql(stack, "SELECT EXTRACT(EPOCH FROM MIN(l.finished_at) - MIN(b.in_progress_at)) "
                            "FROM batches b JOIN request_lines l ON l.batch_id = b.id "
                            "WHERE b.id = :b GROUP BY b.id", b=batch_id)[0][0])


def test_tasks_and_shards_outlive_the_visibility_timeout(stack):
    stack.stop_workers()
    for name in WORKERS:
        stack.start_worker(name, env={"BOXCAR_TEST_TASK_SECONDS": str(TASK_S)})
    client = stack.client()
    lines = lines_of("vis", 320)
    started = time.monotonic()
    batch = create_batch(client, upload(client, lines))
    final = wait_done(client, batch["id"])
    batch_s = time.monotonic() - started
    # Messages still queued behind the slow ones run out; every first delivery was given back.
    time.sleep(TASK_S + VISIBILITY_S + 1)
    logs = "".join(stack.log_of(name) for name in WORKERS)
    redelivered = re.findall(r"redelivered (boxcar\.[a-z_.]+)\[", logs)
    result = outcome(client, batch["id"], [x["custom_id"] for x in lines])
    first_s = first_line_s(stack, batch["id"])
    record(TABLE, fault=f"tasks held {TASK_S:.0f} s, lines 4 s",
           status=final["status"],
           lines=len(lines), lost=result["lost"], duplicates=result["duplicates"],
           redelivered_runs=len(redelivered), first_line_s=first_s,
           batch_s=batch_s)
    assert final["status"] == "completed", final
    assert result["lost"] == result["duplicates"] == result["unknown"] == 0, result
    assert first_s > VISIBILITY_S, first_s  # every shard outlived the visibility timeout
    # The trap was sprung: messages ran twice, the prepare's among them.
    assert redelivered, logs[-3000:]
    assert "boxcar.batch_changed" in redelivered, redelivered
    # One prepare: the batch's shards were cut once (a second prepare would add shards).
    (num_shards,) = sql(stack, "SELECT COUNT(*) FROM shards WHERE batch_id = :b",
                        b=batch["id"])[0]
    assert num_shards == 320 // 16


class CuttableProxy:
    """A TCP proxy to ``127.0.0.1:port`` that the test can cut (every connection closed, new
    ones refused) and restore, on the same port, or freeze (connections stay open, nothing
    goes through: a partition, a paused host)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.frozen = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.restore()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, []
        for sock in [listener, *sockets]:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    close = cut

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                while self.frozen.is_set():
                    time.sleep(0.05)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_worker_loses_its_broker_mid_shard(stack):
    stack.stop_workers()
    proxy = CuttableProxy(stack.redis.port)
    try:
        w1 = stack.start_worker("w1", env={"BOXCAR_BROKER_URL": proxy.url})
        stack.start_worker("w2")
        client = stack.client()
        lines = lines_of("cut", 480)
        batch = create_batch(client, upload(client, lines))
        owner = f"%:{w1.pid}:%"

        def w1_running() -> bool:
            return bool(sql(stack, "SELECT 1 FROM shards WHERE batch_id = :b AND "
                            "status = 'running' AND lease_owner LIKE :o",
                            b=batch["id"], o=owner))

        wait_for(w1_running, 60, 0.1, "w1 to run a shard")
        held = {r[0] for r in sql(stack, "SELECT id FROM shards WHERE status = 'running' AND "
                                  "lease_owner LIKE :o", o=owner)}
        cut_at = sql(stack, "SELECT now()")[0][0]
        connects = stack.log_of("w1").count("Connected to redis://")
        proxy.cut()
        # A batch created while w1 is cut off: its messages reach w2 only.
        late_lines = lines_of("late", 64)
        late = create_batch(client, upload(client, late_lines))
        time.sleep(3 * VISIBILITY_S)
        restored_at = sql(stack, "SELECT now()")[0][0]
        proxy.restore()
        final = wait_done(client, batch["id"])
        late_final = wait_done(client, late["id"])
        assert w1.poll() is None, stack.log_of("w1")[-3000:]
        result = outcome(client, batch["id"], [x["custom_id"] for x in lines])
        late_result = outcome(client, late["id"], [x["custom_id"] for x in late_lines])
        # w1 ran its shards to the end without the broker: nobody else wrote their lines.
        writers = {r[0] for r in sql(stack, "SELECT DISTINCT worker_id FROM request_lines "
                                     "WHERE shard_id = ANY(:s)", s=list(held))}
        written_while_cut = sql(stack, "SELECT COUNT(*) FROM request_lines WHERE worker_id "
                                "LIKE :o AND finished_at BETWEEN :a AND :b", o=owner,
                                a=cut_at, b=restored_at)[0][0]
        reconnected = stack.log_of("w1").count("Connected to redis://") - connects
        record(TABLE, fault=f"w1's broker cut {3 * VISIBILITY_S} s mid-shard",
               status=final["status"], lines=len(lines) + len(late_lines),
               lost=result["lost"] + late_result["lost"],
               duplicates=result["duplicates"] + late_result["duplicates"],
               redelivered_runs=None, first_line_s=None, batch_s=None,
               note=f"w1 held {len(held)} shards, wrote {written_while_cut} lines while cut "
                    f"off, reconnected {reconnected}x")
        assert final["status"] == late_final["status"] == "completed", (final, late_final)
        for r in (result, late_result):
            assert r["lost"] == r["duplicates"] == r["unknown"] == 0, r
        assert len(writers) == 1 and next(iter(writers)).split(":")[1] == str(w1.pid), writers
        assert written_while_cut > 0
        assert reconnected >= 1, stack.log_of("w1")[-3000:]
    finally:
        proxy.close()
        stack.stop_workers()


# The doorbells' socket timeout in the silent-broker test: production's 5 s (service/queue.py)
# would hold the suite ~20 s for the same proof.
SILENT_TIMEOUT_S = 1.0


def test_a_silent_broker_holds_no_sender(stack):
    proxy = CuttableProxy(stack.redis.port)
    queue = CeleryQueue(proxy.url, namespace="bxsilent", transport_options={
        "socket_timeout": SILENT_TIMEOUT_S, "socket_connect_timeout": SILENT_TIMEOUT_S})
    try:
        queue.batch_changed("batch_warm")  # connected, then the broker goes quiet
        proxy.frozen.set()
        took: list[float] = []

        def ring() -> None:
            started = time.monotonic()
            queue.batch_changed("batch_silent")
            queue.shards_ready([f"batch_silent:{i}" for i in range(50)], model="m")
            took.append(time.monotonic() - started)

        thread = threading.Thread(target=ring, daemon=True)
        thread.start()
        thread.join(60)
        record(TABLE, fault="broker silent (connection open, no answer)", status="-",
               lines=0, lost=0, duplicates=0, redelivered_runs=None, first_line_s=None,
               batch_s=None, note=f"51 doorbells gave up after {took[0]:.1f} s" if took
               else "a send still held after 60 s")
        assert took, "a send to a silent broker held its thread for 60 s"
        # two doorbells, each tried twice (PUBLISH_RETRY_POLICY), each try one timeout
        assert took[0] < 4 * SILENT_TIMEOUT_S + 6, took
    finally:
        proxy.frozen.clear()
        proxy.close()
        queue.close()


def test_worker_paused_past_its_lease(stack):
    """A worker frozen (SIGSTOP) past its lease and the visibility timeout, then thawed: its
    shards were reaped meanwhile (and taken by the other worker, or by itself again once
    thawed), its late results lose to the new owner's or are written once, and it drops the
    claims it lost (the "retry outlived its lock" trap). Before the fix in
    worker/lease_keeper.py a shard it claimed again was held, heartbeated and never run: the
    batch stayed in_progress (tests/worker/test_reclaim.py)."""
    stack.stop_workers()
    w1 = stack.start_worker("w1")
    stack.start_worker("w2")
    try:
        client = stack.client()
        lines = lines_of("pause", 320)
        batch = create_batch(client, upload(client, lines))
        owner = f"%:{w1.pid}:%"
        wait_for(lambda: sql(stack, "SELECT 1 FROM shards WHERE batch_id = :b AND "
                             "status = 'running' AND lease_owner LIKE :o",
                             b=batch["id"], o=owner), 60, 0.1, "w1 to run a shard")
        held = {r[0] for r in sql(stack, "SELECT id FROM shards WHERE status = 'running' AND "
                                  "lease_owner LIKE :o", o=owner)}
        os.killpg(w1.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: not sql(stack, "SELECT 1 FROM shards WHERE id = ANY(:s) AND "
                                     "lease_owner LIKE :o", s=list(held), o=owner),
                     60, 0.2, "w1's shards to be taken over")
            time.sleep(VISIBILITY_S)
        finally:
            os.killpg(w1.pid, signal.SIGCONT)
        final = wait_done(client, batch["id"])
        result = outcome(client, batch["id"], [x["custom_id"] for x in lines])
        writers = sql(stack, "SELECT worker_id LIKE :o, COUNT(*) FROM request_lines WHERE "
                      "shard_id = ANY(:s) GROUP BY 1", o=owner, s=list(held))
        by_w1 = sum(n for mine, n in writers if mine)
        wait_for(lambda: "lost the lease" in stack.log_of("w1"), 30, 0.2,
                 "w1 to notice it lost its shards")
        record(TABLE, fault="w1 SIGSTOPped past its lease", status=final["status"],
               lines=len(lines), lost=result["lost"], duplicates=result["duplicates"],
               redelivered_runs=None, first_line_s=None, batch_s=None,
               note=f"its {len(held)} shards' {sum(n for _, n in writers)} lines: {by_w1} "
                    "written by w1 (before the pause, or after claiming one again)")
        assert final["status"] == "completed", final
        assert result["lost"] == result["duplicates"] == result["unknown"] == 0, result
        assert w1.poll() is None, stack.log_of("w1")[-3000:]
    finally:
        stack.stop_workers()
