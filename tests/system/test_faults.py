"""Fault injection against the production stack on private servers (tests/system/stack.py):
PostgreSQL, Redis, SeaweedFS, the API and two Celery workers with the real engine on the tiny
model. Each case runs a batch of a few hundred lines, injects one fault mid-run, and checks that
every custom_id appears exactly once across the output and error files (none lost, none
repeated) and how long the service took to recover once the fault cleared.

Recovery is measured from the moment the fault clears (the process is back, the outage ends) to
the first progress after it: a line completed, or the batch's final status. The figures are
printed as a table at the end of the run (tests/figures.py).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from sqlalchemy import create_engine, text

from service.settings import Settings
from tests.conftest_services import chat_line, jsonl, wait_for
from tests.figures import record
from tests.system.audit import exactly_once, read_results
from tests.system.stack import MULTIPART_HEADERS, multipart_upload

TABLE = "Faults: every custom_id exactly once (tiny model, real PostgreSQL/Redis/SeaweedFS)"
TERMINAL = ("completed", "failed", "expired", "cancelled")
MAX_RECOVERY_S = 30.0
WORKERS = ("w1", "w2")


@pytest.fixture
def stack(private_stack):
    """The private stack, healed: every server up, the API up, both workers running."""
    return private_stack.heal(WORKERS)


def batch_lines(tag: str, num_lines: int = 300, max_tokens: int = 120) -> list[dict]:
    return [chat_line(f"{tag}-{i:04d}", f"Item {i} of {tag}: describe it", max_tokens=max_tokens,
                      ignore_eos=True, temperature=0) for i in range(num_lines)]


def upload(client: httpx.Client, lines: list[dict], name: str = "in.jsonl") -> str:
    response = client.post("/v1/files", data={"purpose": "batch"},
                           files={"file": (name, jsonl(lines))})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def create_batch(client: httpx.Client, file_id: str, window: str = "24h") -> dict:
    response = client.post("/v1/batches", json={
        "input_file_id": file_id, "endpoint": "/v1/chat/completions",
        "completion_window": window})
    assert response.status_code == 200, response.text
    return response.json()


@dataclass
class Watch:
    """Polls one batch in a thread and keeps (time, completed, status) samples."""

    base_url: str
    api_key: str
    batch_id: str
    samples: list[tuple[float, int, str]] = field(default_factory=list)
    codes: dict[int, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=5,
                          headers={"Authorization": f"Bearer {self.api_key}"}) as client:
            while not self._stop.is_set():
                try:
                    response = client.get(f"/v1/batches/{self.batch_id}")
                    self.codes[response.status_code] = self.codes.get(response.status_code, 0) + 1
                    if response.status_code == 200:
                        body = response.json()
                        self.samples.append((time.monotonic(),
                                             body["request_counts"]["completed"], body["status"]))
                        if body["status"] in TERMINAL:
                            return
                except httpx.HTTPError:
                    self.codes[0] = self.codes.get(0, 0) + 1  # no answer (the API is down)
                self._stop.wait(0.1)

    def latest(self) -> tuple[float, int, str]:
        return self.samples[-1] if self.samples else (0.0, 0, "")

    def wait(self, predicate, timeout: float, what: str):
        return wait_for(lambda: self.samples and predicate(*self.latest()), timeout, 0.05, what)

    def done(self, timeout: float = 120) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"batch {self.batch_id} did not finish: {self.latest()}"

    def stop(self) -> None:
        self._stop.set()

    def progress_after(self, t0: float) -> float | None:
        """Seconds from ``t0`` to the first new completed line (or the final status) after it;
        0 when the batch had already finished by ``t0`` (the fault never held it up)."""
        before = [(c, s) for t, c, s in self.samples if t <= t0]
        if before and before[-1][1] in TERMINAL:
            return 0.0
        base = before[-1][0] if before else 0
        for t, completed, status in self.samples:
            if t > t0 and (completed > base or status in TERMINAL):
                return t - t0
        return None

    def max_stall(self, t0: float) -> float:
        """The longest time after ``t0`` without a newly completed line."""
        last, longest, count = t0, 0.0, None
        for t, completed, status in self.samples:
            if t < t0:
                count = completed
                continue
            if count is None or completed > count or status in TERMINAL:
                longest = max(longest, t - last)
                last, count = t, completed
        return longest


def outcome(client: httpx.Client, batch_id: str, expected: list[str]) -> dict:
    """The final batch and the exactly-once figures over its output and error files."""
    batch = client.get(f"/v1/batches/{batch_id}").json()
    results = read_results(client, batch)
    counts = batch["request_counts"]
    assert counts["total"] == len(expected)
    assert counts["completed"] + counts["failed"] == len(results.custom_ids)
    return {"batch": batch, **exactly_once(expected, results.custom_ids),
            "error_codes": results.error_codes}


def report(fault: str, result: dict, *, outage_s: float | None, recovery_s: float | None,
           stall_s: float | None, batch_s: float, note: str = "") -> None:
    batch = result["batch"]
    record(TABLE, fault=fault, status=batch["status"], lines=batch["request_counts"]["total"],
           completed=batch["request_counts"]["completed"],
           failed=batch["request_counts"]["failed"], lost=result["lost"],
           duplicates=result["duplicates"], outage_s=outage_s, recovery_s=recovery_s,
           max_stall_s=stall_s, batch_s=batch_s, note=note)
    assert result["lost"] == 0 and result["duplicates"] == 0 and result["unknown"] == 0, result
    assert recovery_s is not None and recovery_s <= MAX_RECOVERY_S, recovery_s


def sql(stack, query: str, **params):
    engine = create_engine(stack.pg.url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(query), params).all()
    finally:
        engine.dispose()


def start_batch(stack, tag: str, **kwargs) -> tuple[httpx.Client, dict, list[str], Watch, float]:
    client = stack.client()
    lines = batch_lines(tag, **{k: v for k, v in kwargs.items() if k != "window"})
    file_id = upload(client, lines)
    started = time.monotonic()
    batch = create_batch(client, file_id, kwargs.get("window", "24h"))
    watch = Watch(stack.base_url, stack.api_key, batch["id"])
    return client, batch, [line["custom_id"] for line in lines], watch, started


# ---------------------------------------------------------------------------------------------


def test_sigkill_one_of_two_workers(stack):
    client, batch, expected, watch, started = start_batch(stack, "kill1")
    watch.wait(lambda t, c, s: c >= 40, 60, "some progress")
    pid = stack.kill_worker("w1")
    killed = time.monotonic()

    def taken_over() -> bool:  # no shard left under the dead worker's lease
        return not sql(stack, "SELECT 1 FROM shards WHERE status = 'running' AND "
                       "lease_owner LIKE :owner", owner=f"%:{pid}:%")

    wait_for(taken_over, 60, 0.1, "the dead worker's shards to be taken over")
    recovery = time.monotonic() - killed
    watch.done()
    result = outcome(client, batch["id"], expected)
    report("worker SIGKILL (1 of 2)", result, outage_s=0.0, recovery_s=recovery,
           stall_s=watch.max_stall(killed), batch_s=watch.latest()[0] - started,
           note="recovery: until its leased shards ran elsewhere")
    assert result["batch"]["status"] == "completed"


def test_sigkill_only_worker_then_restart(stack):
    stack.stop_workers()
    stack.start_worker("w1")
    client, batch, expected, watch, started = start_batch(stack, "kill2")
    watch.wait(lambda t, c, s: c >= 40, 60, "some progress")
    killed = time.monotonic()
    stack.kill_worker("w1")
    stack.start_worker("w1")
    back = time.monotonic()
    watch.done()
    result = outcome(client, batch["id"], expected)
    report("worker SIGKILL (only one), restarted", result, outage_s=back - killed,
           recovery_s=watch.progress_after(back), stall_s=watch.max_stall(killed),
           batch_s=watch.latest()[0] - started, note="outage: kill to new worker ready")
    assert result["batch"]["status"] == "completed"


def test_redis_restart(stack):
    client, batch, expected, watch, started = start_batch(stack, "redis")
    watch.wait(lambda t, c, s: c >= 40, 60, "some progress")
    stopped = time.monotonic()
    stack.redis.stop()
    assert watch.latest()[2] == "in_progress"
    # Work submitted while the broker is down is found by the workers' database polling.
    late_lines = batch_lines("redis-late", num_lines=40, max_tokens=8)
    late_file = upload(client, late_lines)
    t = time.monotonic()
    late = create_batch(client, late_file)
    create_s = time.monotonic() - t
    time.sleep(max(0.0, 3.0 - (time.monotonic() - stopped)))
    stack.redis.start()
    back = time.monotonic()
    watch.done()
    late_watch = Watch(stack.base_url, stack.api_key, late["id"])
    late_watch.done()
    result = outcome(client, batch["id"], expected)
    late_result = outcome(client, late["id"], [x["custom_id"] for x in late_lines])
    assert late_result["lost"] == late_result["duplicates"] == 0
    assert late_result["batch"]["status"] == "completed"
    for name in WORKERS:
        assert stack.workers[name].poll() is None, f"{name} died:\n{stack.log_of(name)[-2000:]}"
    recovery = watch.progress_after(back)
    report("Redis restarted", result, outage_s=back - stopped, recovery_s=recovery,
           stall_s=watch.max_stall(stopped), batch_s=watch.latest()[0] - started,
           note=f"batch created during the outage in {create_s:.2f}s, completed too")
    assert result["batch"]["status"] == "completed"


def test_postgres_restart(stack):
    client, batch, expected, watch, started = start_batch(stack, "pg")
    watch.wait(lambda t, c, s: c >= 40, 60, "some progress")
    stopped = time.monotonic()
    stack.pg.stop("fast")
    down = time.monotonic()
    # The batch's poll and the first page of the list may be answered from the API's read of
    # them for up to this long after the database's last answer (api.poll_snapshots); every
    # other call needs the database.
    snapshot_s = Settings().api_poll_snapshot_seconds
    answers: list[tuple[str, int, str | None]] = []
    probes = [("GET", f"/v1/batches/{batch['id']}", None), ("GET", "/v1/batches", None),
              ("POST", "/v1/batches", {"input_file_id": "file-x", "endpoint":
                                       "/v1/chat/completions", "completion_window": "24h"}),
              ("GET", "/v1/files", None), ("GET", "/readyz", None)]
    while time.monotonic() - stopped < 5.0:
        for method, path, body in probes:
            asked = time.monotonic()
            response = client.request(method, path, json=body)
            answers.append((path, response.status_code, response.headers.get("retry-after")))
            if (response.status_code == 200 and path in (probes[0][1], probes[1][1])
                    and asked - down < snapshot_s):
                continue
            assert response.status_code == 503, (path, response.status_code, response.text)
            if path.startswith("/v1/"):
                assert response.headers.get("retry-after"), path
                assert response.json()["error"]["code"] == "database_unavailable"
        time.sleep(0.2)
    stack.pg.start()
    back = time.monotonic()
    watch.done()
    result = outcome(client, batch["id"], expected)
    report("PostgreSQL restarted", result, outage_s=back - stopped,
           recovery_s=watch.progress_after(back), stall_s=watch.max_stall(stopped),
           batch_s=watch.latest()[0] - started,
           note=f"{len(answers)} API calls during the outage: 503 + Retry-After, but "
                f"{sum(code == 200 for _, code, _ in answers)} polls from the API's fresh read")
    assert result["batch"]["status"] == "completed"


@pytest.mark.parametrize("outage", [5, pytest.param(30, marks=pytest.mark.slow)])
def test_s3_outage(stack, outage):
    client = stack.client()
    lines_a = batch_lines("s3a", num_lines=200, max_tokens=16)
    lines_b = batch_lines("s3b", num_lines=100, max_tokens=16)
    file_a, file_b = upload(client, lines_a), upload(client, lines_b)
    started = time.monotonic()
    batch_a = create_batch(client, file_a)
    watch_a = Watch(stack.base_url, stack.api_key, batch_a["id"])
    watch_a.wait(lambda t, c, s: s == "in_progress", 60, "batch A to start")
    stopped = time.monotonic()
    stack.weed.stop()
    # A runs on (the database only); its finalize and B's prepare need storage and must wait.
    batch_b = create_batch(client, file_b)
    watch_b = Watch(stack.base_url, stack.api_key, batch_b["id"])
    refused = client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("x.jsonl", jsonl(lines_b[:3]))})
    assert refused.status_code == 503, refused.text
    assert refused.headers.get("retry-after")
    assert refused.json()["error"]["code"] == "object_storage_unavailable"
    content = client.get(f"/v1/files/{file_a}/content")
    assert content.status_code == 503, content.text
    time.sleep(max(0.0, outage - (time.monotonic() - stopped)))
    assert watch_a.latest()[2] != "completed" and watch_b.latest()[2] != "in_progress"
    stack.weed.start()
    back = time.monotonic()
    watch_a.done()
    watch_b.done()
    prepared_b = next(t for t, _, s in watch_b.samples if s != "validating")
    recovery = max(watch_a.latest()[0], prepared_b) - back
    for watch, lines in ((watch_a, lines_a), (watch_b, lines_b)):
        result = outcome(client, watch.batch_id, [x["custom_id"] for x in lines])
        assert result["batch"]["status"] == "completed", result["batch"]
        assert result["lost"] == result["duplicates"] == 0
    result = outcome(client, batch_a["id"], [x["custom_id"] for x in lines_a])
    report(f"S3 server stopped {outage}s", result, outage_s=back - stopped, recovery_s=recovery,
           stall_s=None, batch_s=watch_a.latest()[0] - started,
           note="recovery: A finalized and B prepared after S3 returned; uploads got 503")


def big_lines(num_lines: int):
    for i in range(num_lines):
        yield json.dumps(chat_line(f"big-{i}", "x" * 1000)).encode() + b"\n"


def test_api_killed_during_upload(stack):
    client = stack.client()
    before = {r[0] for r in sql(stack, "SELECT id FROM files")}
    sent = [0]
    failure: list[BaseException] = []

    def send() -> None:
        try:
            with httpx.Client(timeout=60) as c:
                c.post(f"{stack.base_url}/v1/files",
                       content=multipart_upload(big_lines(22_000), chunk_bytes=64 << 10,
                                                sent=sent, pause=0.002),
                       headers={"Authorization": f"Bearer {stack.api_key}",
                                **MULTIPART_HEADERS})
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    wait_for(lambda: sent[0] >= 12 << 20, 60, 0.01, "12 MiB of the upload")
    killed = time.monotonic()
    stack.kill_api()
    thread.join(30)
    assert failure, "the upload finished although the API was killed"
    start_s = stack.start_api()
    back = time.monotonic()
    lines = batch_lines("upl", num_lines=100, max_tokens=8)
    file_id = upload(client, lines)
    recovery = time.monotonic() - back + start_s
    after = {r[0] for r in sql(stack, "SELECT id FROM files")}
    assert after - before == {file_id}, "the killed upload left a file record"
    keys = {r[0] for r in sql(stack, "SELECT storage_key FROM files")}
    s3 = stack.weed.server.client()
    stored = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=stack.bucket,
                                                            Prefix="boxcar/files/"):
        stored |= {o["Key"].removeprefix("boxcar/") for o in page.get("Contents", [])}
    assert stored <= keys, f"objects without a file record: {stored - keys}"
    try:
        pending = len(s3.list_multipart_uploads(Bucket=stack.bucket).get("Uploads", []))
    except Exception:
        pending = None
    listed = {f["id"] for f in client.get("/v1/files").json()["data"]}
    assert listed == after
    batch = create_batch(client, file_id)
    Watch(stack.base_url, stack.api_key, batch["id"]).done()
    result = outcome(client, batch["id"], [x["custom_id"] for x in lines])
    report("API SIGKILL during a 24 MB upload", result, outage_s=back - killed,
           recovery_s=recovery, stall_s=None, batch_s=0.0,
           note=f"killed at {sent[0] >> 20} MiB: no file row, no object; "
                f"{pending} unfinished multipart upload(s) left for the bucket's lifecycle")


def test_cancel_racing_completion(stack):
    client, batch, expected, watch, started = start_batch(stack, "cancel", max_tokens=40)
    watch.wait(lambda t, c, s: c >= 270, 60, "the batch to be nearly done")
    cancelled_at = time.monotonic()
    response = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert response.status_code in (200, 409), response.text  # 409: it completed first
    watch.done()
    result = outcome(client, batch["id"], expected)
    assert result["batch"]["status"] in ("cancelled", "completed")
    assert set(result["error_codes"]) <= {"batch_cancelled"}
    report("cancel racing completion", result, outage_s=None,
           recovery_s=watch.latest()[0] - cancelled_at, stall_s=None,
           batch_s=watch.latest()[0] - started,
           note=f"cancelled at {watch.samples[-2][1] if len(watch.samples) > 1 else '?'}/300; "
                "recovery: cancel to final status")
    after = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert after.status_code == (200 if result["batch"]["status"] == "cancelled" else 409)


def test_expiry_racing_completion(stack):
    # Far more work than 4 s allows, so the window ends while lines are still finishing.
    client, batch, expected, watch, started = start_batch(stack, "expire", window="4s",
                                                          num_lines=400, max_tokens=200)
    expires = started + 4.0
    watch.done()
    result = outcome(client, batch["id"], expected)
    final = result["batch"]
    assert final["status"] == "expired", final
    assert 0 < final["request_counts"]["completed"] < len(expected)
    assert set(result["error_codes"]) == {"batch_expired"}
    report("expiry racing completion (4s window)", result, outage_s=None,
           recovery_s=watch.latest()[0] - expires, stall_s=None,
           batch_s=watch.latest()[0] - started, note="recovery: window end to final status")
