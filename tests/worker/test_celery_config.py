"""The worker's Celery settings that the redelivery traps depend on (docs/operations.md,
"Broker messages"; tests/system/test_redelivery.py runs them against Redis)."""

from __future__ import annotations

from service.queue import TRANSPORT_OPTIONS, CeleryQueue
from service.settings import Settings
from worker.celery_app import celery_config


def test_late_acks_and_no_cancel_of_running_threads():
    config = celery_config(Settings(broker_url="redis://localhost:1/0"))
    assert config["task_acks_late"] and config["task_reject_on_worker_lost"]
    assert config["worker_cancel_long_running_tasks_on_connection_loss"] is False
    assert config["worker_soft_shutdown_timeout"] == 0.0
    assert config["broker_connection_max_retries"] is None
    assert config["worker_prefetch_multiplier"] == 1
    assert config["broker_transport_options"] == TRANSPORT_OPTIONS


def test_transport_options_setting_is_laid_over_the_defaults(monkeypatch):
    monkeypatch.setenv("BOXCAR_BROKER_TRANSPORT_OPTIONS",
                       '{"visibility_timeout": 2, "unacked_restore_interval": 1}')
    options = celery_config(Settings(broker_url="redis://localhost:1/0"))[
        "broker_transport_options"]
    assert options == {**TRANSPORT_OPTIONS, "visibility_timeout": 2,
                       "unacked_restore_interval": 1}
    assert TRANSPORT_OPTIONS["visibility_timeout"] == 3600  # the default is not changed


def test_a_doorbell_that_fails_stops_the_rest():
    """A broker that is away costs one send's timeout, not one per shard: polling finds them."""
    tried: list[str] = []

    class DownApp:
        def send_task(self, name, args, queue):
            tried.append(args[0])
            raise OSError("timed out")

    queue = CeleryQueue.__new__(CeleryQueue)
    queue._app, queue._namespace = DownApp(), "ns"
    queue.shards_ready([f"b:{i}" for i in range(10)], model="m")
    assert tried == ["b:0"]
