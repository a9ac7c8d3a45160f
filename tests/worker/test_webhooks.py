"""Webhooks: signed deliveries to a batch's own URL and to tenant endpoints, retries with
backoff, the delivery log, and the guard against private addresses."""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.testing.fake_engine import FakeEngine
from service.webhook_verify import ReplayGuard, Webhook, WebhookVerificationError, verify
from service.webhooks import check_url_literal, check_url_target
from tests.conftest_services import chat_line, wait_for


class Receiver:
    """A local HTTP server that records what it receives; fails the first ``fail_first``."""

    def __init__(self, fail_first: int = 0) -> None:
        self.received: list[tuple[str, dict[str, str], str]] = []
        self.fail_first = fail_first
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"])).decode()
                receiver.received.append((self.path, {k.lower(): v for k, v in
                                                      self.headers.items()}, body))
                failing = receiver.fail_first > 0
                receiver.fail_first -= 1
                self.send_response(500 if failing else 204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def receiver():
    r = Receiver(fail_first=1)
    yield r
    r.close()


def test_batch_and_job_events_are_signed_and_retried(make_stack, sqlite_url, receiver):
    stack = make_stack(sqlite_url)
    stack.add_worker(FakeEngine())
    endpoint = stack.client.post("/v1/webhook_endpoints", json={
        "url": f"{receiver.url}/endpoint", "events": ["batch.completed"]}).json()
    assert endpoint["secret"].startswith("whsec_")
    tenant_secret = stack.client.get("/v1/tenant").json()["webhook_secret"]
    batch = stack.create_batch([chat_line("w1", "hello")], webhook_url=f"{receiver.url}/batch")
    stack.wait_status(batch["id"], "completed")
    job = stack.client.post("/v1/jobs", json={
        "body": {"prompt": "abc", "max_tokens": 2}, "webhook_url": f"{receiver.url}/job"}).json()

    wait_for(lambda: {"/batch", "/endpoint", "/job"} <= {p for p, _, _ in receiver.received
                                                       if p},
             20, 0.05, "three deliveries")
    wait_for(lambda: len(receiver.received) >= 4, 10, 0.05, "the retry of the failed one")
    secrets = {"/batch": tenant_secret, "/job": tenant_secret, "/endpoint": endpoint["secret"]}
    for path, headers, body in receiver.received:
        assert verify(secrets[path], body, headers)["type"], path
        assert headers["webhook-signature"].startswith("v1,")
    events = {path: json.loads(body) for path, _, body in receiver.received}
    assert events["/batch"]["type"] == "batch.completed"
    assert events["/batch"]["data"]["id"] == batch["id"]
    assert events["/batch"]["data"]["request_counts"]["completed"] == 1
    assert events["/endpoint"]["data"]["id"] == batch["id"]
    assert events["/job"]["type"] == "job.completed" and events["/job"]["data"]["id"] == job["id"]
    # The same message id on the retry (receivers deduplicate on it).
    first_path, first_headers, _ = receiver.received[0]
    retried = [h for p, h, _ in receiver.received[1:] if p == first_path]
    assert retried and retried[0]["webhook-id"] == first_headers["webhook-id"]

    log = wait_for(lambda: (d := stack.client.get("/v1/webhook_deliveries").json()["data"])
                   and all(x["status"] == "delivered" for x in d) and len(d) == 3 and d,
                   10, 0.05, "a settled delivery log")
    attempts = sorted(d["attempts"] for d in log)
    assert attempts == [1, 1, 2]
    retried_entry = next(d for d in log if d["attempts"] == 2)
    assert [a["status_code"] for a in retried_entry["attempt_log"]] == [500, 204]


def test_private_addresses_are_refused_unless_allowed():
    with pytest.raises(ValueError, match="non-public"):
        check_url_target("http://localhost:8080/x", allow_private=False)
    with pytest.raises(ValueError):
        check_url_literal("http://10.1.2.3/x", allow_private=False)
    with pytest.raises(ValueError):
        check_url_literal("http://[::1]/x", allow_private=False)
    with pytest.raises(ValueError):
        check_url_literal("http://169.254.169.254/latest", allow_private=False)
    check_url_literal("https://example.com/hook", allow_private=False)
    check_url_target("http://127.0.0.1:1/x", allow_private=True)


def _resolves_to_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, 80, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def test_delivery_to_a_private_address_fails_without_sending(make_stack, sqlite_url, receiver):
    stack = make_stack(sqlite_url, webhook_allow_private=False, webhook_retry_delays=[0.1])
    stack.add_worker(FakeEngine())
    # Accepted by name at creation time; refused once resolved at delivery time.
    host = socket.gethostname()
    if not _resolves_to_loopback(host):
        pytest.skip(f"this machine's name {host!r} does not resolve to a loopback address")
    url = receiver.url.replace("127.0.0.1", host) + "/x"
    assert stack.client.post("/v1/webhook_endpoints", json={"url": url}).status_code == 200
    refused = stack.client.post("/v1/webhook_endpoints", json={"url": receiver.url})
    assert refused.status_code == 400
    batch = stack.create_batch([chat_line("p1", "x")])
    stack.wait_status(batch["id"], "completed")
    log = wait_for(lambda: (d := stack.client.get("/v1/webhook_deliveries").json()["data"])
                   and d[0]["status"] == "failed" and d, 10, 0.05, "the delivery to fail")
    assert "non-public" in log[0]["last_error"] and log[0]["attempts"] == 2
    assert receiver.received == []


def test_real_deliveries_verify_and_replays_do_not(make_stack, sqlite_url):
    receiver = Receiver(fail_first=1)  # the first attempt fails: a retry follows
    try:
        stack = make_stack(sqlite_url)
        stack.add_worker(FakeEngine())
        endpoint = stack.client.post("/v1/webhook_endpoints", json={
            "url": f"{receiver.url}/hook", "events": ["batch.completed"]}).json()
        stack.create_batch([chat_line("a", "hi", max_tokens=2)])
        wait_for(lambda: len(receiver.received) >= 2, 30, 0.05, "a delivery and its retry")
        hook = Webhook(endpoint["secret"], replay_guard=ReplayGuard())
        (_, first, body1), (_, second, body2) = receiver.received[:2]
        assert first["webhook-id"] == second["webhook-id"]
        for headers, body in ((first, body1), (second, body2)):
            if headers["webhook-timestamp"] == first["webhook-timestamp"] and headers is second:
                continue  # both attempts in one second: the retry is byte-for-byte the same
            assert hook.verify(body, headers)["type"] == "batch.completed"
        with pytest.raises(WebhookVerificationError, match="replay"):
            hook.verify(body2, second)
        with pytest.raises(WebhookVerificationError):
            Webhook(stack.client.get("/v1/tenant").json()["webhook_secret"]).verify(body1, first)
    finally:
        receiver.close()
