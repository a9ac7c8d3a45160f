"""The doorbell between the API and the workers: "batch B changed", "shard S has work".

A message carries an id and nothing else; the database says what the work is and who holds it,
so a lost or repeated message never loses or repeats a result (workers also poll the database).
Production rings Celery on Redis; the embedded mode rings in-process listeners and lets the
workers' polling do the rest.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

log = logging.getLogger(__name__)

TASK_BATCH_CHANGED = "boxcar.batch_changed"
TASK_RUN_SHARD = "boxcar.run_shard"

# kombu's Redis transport, for the API's and the workers' connections alike;
# ``BOXCAR_BROKER_TRANSPORT_OPTIONS`` is laid over it. docs/operations.md ("Broker messages")
# says why each value is what it is.
TRANSPORT_OPTIONS: dict[str, Any] = {
    # Workers ask for single jobs and control messages before bulk shards.
    "queue_order_strategy": "priority",
    # An unacked message is delivered again after this. A message only wakes a worker or starts
    # a prepare/finalize step that the batch lease guards, so a second run is harmless; and a
    # message lost with its worker is not waited for (the database polls find the work).
    "visibility_timeout": 3600,
    # A broker that stops answering without closing the connection (a partition, a paused
    # host) fails a send or a read after this, instead of holding the thread forever.
    "socket_timeout": 5.0,
    "socket_connect_timeout": 5.0,
}
# A doorbell is tried twice at most: when it is lost, polling finds the work.
PUBLISH_RETRY_POLICY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2,
                        "interval_max": 0.2}


def queue_names(namespace: str, model: str) -> dict[str, str]:
    """Celery queue names: single jobs and control messages ahead of bulk shards. Shards and
    jobs go to their model's queues, which only that model's workers consume; control messages
    (prepare, finalize, cancel) to one queue every worker shares."""
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", model)
    return {
        "jobs": f"{namespace}.jobs.{tag}",
        "control": f"{namespace}.control",
        "bulk": f"{namespace}.bulk.{tag}",
    }


class TaskQueue(Protocol):
    def batch_changed(self, batch_id: str) -> None: ...

    def shards_ready(self, shard_ids: Iterable[str], *, model: str | None,
                     jobs: bool = False) -> None: ...

    def close(self) -> None: ...


class EmbeddedQueue:
    """Rings listeners in this process (a worker running beside the API); others poll."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def subscribe(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def batch_changed(self, batch_id: str) -> None:
        self._notify()

    def shards_ready(self, shard_ids: Iterable[str], *, model: str | None,
                     jobs: bool = False) -> None:
        self._notify()

    def close(self) -> None:
        pass


class CeleryQueue:
    """Sends task messages by name, so the API needs Celery but not the worker's code."""

    def __init__(self, broker_url: str, *, namespace: str = "boxcar",
                 transport_options: dict[str, Any] | None = None) -> None:
        from celery import Celery

        self._app = Celery("boxcar-api", broker=broker_url, set_as_current=False)
        self._app.conf.update(
            broker_connection_retry_on_startup=True, task_ignore_result=True,
            broker_transport_options={**TRANSPORT_OPTIONS, **(transport_options or {})},
            task_publish_retry_policy=PUBLISH_RETRY_POLICY)
        self._namespace = namespace

    def _send(self, name: str, arg: str, queue: str) -> bool:
        try:
            self._app.send_task(name, args=[arg], queue=queue)
        except Exception as exc:  # the row is committed: polling picks the work up anyway
            log.warning("could not send %s(%s) to %s (%s: %s); the workers' polling finds it",
                        name, arg, queue, type(exc).__name__, exc)
            return False
        return True

    def batch_changed(self, batch_id: str) -> None:
        self._send(TASK_BATCH_CHANGED, batch_id, f"{self._namespace}.control")

    def shards_ready(self, shard_ids: Iterable[str], *, model: str | None,
                     jobs: bool = False) -> None:
        if model is None:  # a shard from before routing: workers find it by polling
            return
        queue = queue_names(self._namespace, model)["jobs" if jobs else "bulk"]
        for shard_id in shard_ids:
            if not self._send(TASK_RUN_SHARD, shard_id, queue):
                return  # the broker is away: each of the rest would wait as long; polling

    def close(self) -> None:
        self._app.close()


def make_queue(broker_url: str | None, *, namespace: str = "boxcar",
               transport_options: dict[str, Any] | None = None) -> TaskQueue:
    if not broker_url:
        return EmbeddedQueue()
    return CeleryQueue(broker_url, namespace=namespace, transport_options=transport_options)
