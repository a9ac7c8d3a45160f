"""Celery on Redis: thin tasks over ``WorkerService``.

A message names a shard or a batch and nothing else. Tasks are idempotent (claims and stage
changes are conditional updates in the database) and acknowledged late; the shard leases, not
the broker's visibility timeout, bring a dead worker's work back within seconds. One worker
process holds one engine: run it with ``--pool threads`` (``boxcar worker`` does).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from celery import Celery, signals
from kombu import Queue
from pydantic import StringConstraints, TypeAdapter

from service.queue import TASK_BATCH_CHANGED, TASK_RUN_SHARD, TRANSPORT_OPTIONS, queue_names
from service.served_models import model_id
from service.settings import Settings, get_settings
from worker.process import WorkerService, exit_process

log = logging.getLogger(__name__)

ObjectId = TypeAdapter(Annotated[str, StringConstraints(
    min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_\-]+(:[0-9]+)?$")])


def celery_config(settings: Settings) -> dict[str, Any]:
    # This worker's model's queues, and the shared control queue.
    queues = queue_names(settings.queue_namespace,
                         model_id(settings.model, settings.served_model_name))
    return {
        "broker_url": settings.broker_url,
        "broker_connection_retry_on_startup": True,
        # The worker needs no broker to run (it polls the database): never give up on it.
        "broker_connection_max_retries": None,
        # service.queue.TRANSPORT_OPTIONS says why each is so.
        "broker_transport_options": {**TRANSPORT_OPTIONS, **settings.broker_transport_options},
        "task_queues": [Queue(queues[name]) for name in ("jobs", "control", "bulk")],
        "task_default_queue": queues["bulk"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # A thread cannot be cancelled (Celery would only log that it failed to); the task runs
        # to its end, and its message, which the lost connection can no longer ack, comes back.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # SIGTERM is a warm shutdown: running tasks end (an offer at once, a prepare at its
        # file's end), then the worker hands its shards back; no cold shutdown to soften.
        "worker_soft_shutdown_timeout": 0.0,
        "worker_enable_soft_shutdown_on_idle": False,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "worker_prefetch_multiplier": 1,
        "worker_pool": "threads",
        "worker_concurrency": 4,
        "worker_hijack_root_logger": False,
        "worker_send_task_events": False,
    }


def make_celery(settings: Settings) -> Celery:
    app = Celery("boxcar", set_as_current=True)
    app.conf.update(celery_config(settings))
    return app


def build_app(settings: Settings | None = None) -> Celery:
    """The worker's Celery app: its tasks, and the worker process's ``WorkerService`` started
    when Celery's worker starts and stopped when it stops. Nothing is built at import."""
    settings = settings or get_settings()
    app = make_celery(settings)
    service: WorkerService | None = None

    def get_service() -> WorkerService:
        nonlocal service
        if service is None:  # a task ran before worker_init (e.g. eager mode)
            # A broken engine ends the process (status 70) for the supervisor to restart.
            service = WorkerService(settings, on_fatal=exit_process).start()
        return service

    def start_service(**_kwargs: Any) -> None:
        get_service()

    def stop_service(**_kwargs: Any) -> None:
        if service is not None:
            service.stop()

    @app.task(name=TASK_RUN_SHARD)
    def run_shard(shard_id: str) -> bool:
        """Claim the shard if this worker has room (else a worker's polling will)."""
        return get_service().offer_shard(ObjectId.validate_python(shard_id))

    @app.task(name=TASK_BATCH_CHANGED)
    def batch_changed(batch_id: str) -> str | None:
        """Prepare a new batch, or finalize a cancelled or finished one."""
        return get_service().handle_batch(ObjectId.validate_python(batch_id))

    # weak=False: the handlers are closures of this call, kept alive by the signals.
    signals.worker_init.connect(start_service, weak=False)
    signals.worker_shutdown.connect(stop_service, weak=False)
    return app
