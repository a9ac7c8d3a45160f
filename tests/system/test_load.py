"""Load and size on the production stack of private servers (tests/system/stack.py).

- Large uploads stream: the API validates each line as it passes and sends the bytes on to S3,
  the worker reads the file back line by line into rows; neither holds the file, so their peak
  RSS grows by a bounded amount whatever the size. Reported: validation (upload) time, the
  worker's preparation time, the peak RSS of both processes.
- Many concurrent clients submitting single jobs and small batches and polling them on
  loopback: no errors; p50/p99 API latency reported.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from tests.conftest_services import chat_line, wait_for
from tests.figures import record
from tests.system.stack import (
    MULTIPART_HEADERS,
    multipart_upload,
    peak_rss_mb,
    reset_peak_rss,
    rss_mb,
)

WORKERS = ("w1", "w2")
# Generous bounds for two busy cores; the point is that they do not grow with the file.
MAX_API_GROWTH_MB = 150
MAX_WORKER_GROWTH_MB = 250


@pytest.fixture
def stack(private_stack):
    return private_stack.heal(WORKERS)


def _lines(num_lines: int, line_bytes: int):
    for i in range(num_lines):
        line = json.dumps(chat_line(f"big-{i:06d}", "", max_tokens=1))
        pad = max(0, line_bytes - len(line) - 1)
        yield line.replace('"content": ""', f'"content": "{"w" * pad}"', 1).encode() + b"\n"


@pytest.mark.parametrize("num_lines,line_bytes", [
    (5_000, 160),
    pytest.param(50_000, 160, marks=pytest.mark.slow),
    pytest.param(50_000, 4_000, marks=pytest.mark.slow),  # 200 MB
])
def test_large_upload_streams_in_bounded_memory(stack, num_lines, line_bytes):
    client = stack.client(timeout=600)
    api_pid = stack.api.pid
    worker_pids = [stack.workers[name].pid for name in WORKERS]
    api_base = rss_mb(api_pid)
    worker_base = {pid: rss_mb(pid) for pid in worker_pids}
    for pid in (api_pid, *worker_pids):
        reset_peak_rss(pid)
    sent = [0]
    started = time.monotonic()
    response = client.post("/v1/files", content=multipart_upload(
        _lines(num_lines, line_bytes), chunk_bytes=1 << 20, sent=sent),
        headers=MULTIPART_HEADERS)
    upload_s = time.monotonic() - started
    assert response.status_code == 200, response.text
    file = response.json()
    assert file["line_count"] == num_lines and file["error_count"] == 0
    assert file["bytes"] == sent[0]
    api_peak = peak_rss_mb(api_pid)

    started = time.monotonic()
    batch = client.post("/v1/batches", json={"input_file_id": file["id"],
                                             "endpoint": "/v1/chat/completions"}).json()
    wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["status"] != "validating",
             600, 0.1, "the batch to be prepared")
    prepare_s = time.monotonic() - started
    client.post(f"/v1/batches/{batch['id']}/cancel")  # the lines themselves are not the point
    done = wait_for(lambda: (b := client.get(f"/v1/batches/{batch['id']}").json())["status"]
                    in ("cancelled", "completed") and b, 600, 0.2, "the batch to stop")
    counts = done["request_counts"]
    assert counts["total"] == num_lines == counts["completed"] + counts["failed"]
    worker_growth = max(peak_rss_mb(pid) - worker_base[pid] for pid in worker_pids)
    mb = sent[0] / 1e6
    record("Large uploads: streamed, bounded memory", lines=num_lines, file_mb=round(mb, 1),
           upload_validate_s=upload_s, mb_per_s=mb / upload_s, lines_per_s=num_lines / upload_s,
           api_rss_before_mb=api_base, api_peak_rss_mb=api_peak,
           worker_prepare_s=prepare_s, worker_peak_growth_mb=worker_growth)
    assert api_peak - api_base < MAX_API_GROWTH_MB, (api_base, api_peak)
    assert worker_growth < MAX_WORKER_GROWTH_MB, worker_growth


class LoadClient(threading.Thread):
    """Submits single jobs and small inline batches and polls them; times every request."""

    def __init__(self, base_url: str, key: str, num_requests: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.base_url, self.key, self.num_requests = base_url, key, num_requests
        self.random = random.Random(seed)
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.jobs: list[str] = []
        self.batches: list[str] = []

    def call(self, client: httpx.Client, method: str, path: str, **kwargs) -> dict | None:
        started = time.monotonic()
        try:
            response = client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self.errors.append(f"{method} {path}: {type(exc).__name__}: {exc}")
            return None
        self.latencies.append(time.monotonic() - started)
        if response.status_code != 200:
            self.errors.append(f"{method} {path}: {response.status_code} {response.text[:200]}")
            return None
        return response.json()

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60,
                          headers={"Authorization": f"Bearer {self.key}"}) as client:
            for i in range(self.num_requests):
                roll = self.random.random()
                if roll < 0.25 or not self.jobs:
                    job = self.call(client, "POST", "/v1/jobs", json={"body": {
                        "messages": [{"role": "user", "content": f"load {i}"}],
                        "max_tokens": 2}})
                    if job:
                        self.jobs.append(job["id"])
                elif roll < 0.32:
                    batch = self.call(client, "POST", "/v1/batches", json={
                        "endpoint": "/v1/chat/completions", "requests": [
                            {"custom_id": f"r{k}", "body": {"messages": [
                                {"role": "user", "content": f"req {k}"}], "max_tokens": 2}}
                            for k in range(5)]})
                    if batch:
                        self.batches.append(batch["id"])
                elif roll < 0.7:
                    self.call(client, "GET", f"/v1/jobs/{self.random.choice(self.jobs)}")
                elif roll < 0.85 and self.batches:
                    self.call(client, "GET", f"/v1/batches/{self.random.choice(self.batches)}")
                else:
                    self.call(client, "GET", "/v1/batches", params={"limit": 10})


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@pytest.mark.parametrize("num_clients,num_requests", [
    (16, 25),
    pytest.param(64, 100, marks=pytest.mark.slow),
])
def test_concurrent_clients(stack, num_clients, num_requests):
    clients = [LoadClient(stack.base_url, stack.api_key, num_requests, seed)
               for seed in range(num_clients)]
    started = time.monotonic()
    for c in clients:
        c.start()
    for c in clients:
        c.join(600)
    wall = time.monotonic() - started
    latencies = [x for c in clients for x in c.latencies]
    errors = [e for c in clients for e in c.errors]
    jobs = [j for c in clients for j in c.jobs]
    batches = [b for c in clients for b in c.batches]
    with stack.client() as client:
        def all_done() -> bool:
            return (all(client.get(f"/v1/jobs/{j}").json()["status"] == "completed"
                        for j in jobs)
                    and all(client.get(f"/v1/batches/{b}").json()["status"] == "completed"
                            for b in batches))

        drained = time.monotonic()
        wait_for(all_done, 180, 0.5, "the submitted jobs and batches to complete")
        drain_s = time.monotonic() - drained
    record("Concurrent clients on loopback (API: one uvicorn process)", clients=num_clients,
           requests=len(latencies) + len(errors), errors=len(errors),
           req_per_s=len(latencies) / wall, p50_ms=1000 * _percentile(latencies, 0.5),
           p95_ms=1000 * _percentile(latencies, 0.95), p99_ms=1000 * _percentile(latencies, 0.99),
           max_ms=1000 * max(latencies), jobs=len(jobs), batches=len(batches),
           all_done_after_s=wall + drain_s)
    assert not errors, errors[:5]
    assert _percentile(latencies, 0.99) < 5.0
