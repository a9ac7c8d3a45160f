"""The chaos run's webhook receiver: an HTTP server on 127.0.0.1 that the tenants' jobs and
webhook endpoints point at, verifying each delivery the way a customer's receiver would
(``service.webhook_verify``, with the tenant's or the endpoint's ``whsec_`` secret) and
recording what came.

A tenant's deliveries go to ``/hooks/<tenant>``; the receiver holds one secret per tenant path
(``secrets``), which the bench fills in from the API (``GET /v1/tenant`` for a job's own
``webhook_url``, the endpoint's secret from its create). A delivery that verifies is answered
204; one that does not is recorded as such and answered 400 (the service then retries it, and
the auditor counts the failure). It never goes away during the run: delivery faults come from
the senders' side (a worker killed mid-send, the database away while a delivery is marked).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from service.webhook_verify import Webhook, WebhookVerificationError


@dataclass(frozen=True)
class Delivery:
    tenant: str
    webhook_id: str
    event_type: str  # "" when it did not verify
    object_id: str
    verified: bool
    error: str = ""


class WebhookReceiver:
    def __init__(self) -> None:
        self.secrets: dict[str, list[str]] = {}  # tenant -> secrets a delivery may be signed by
        self.deliveries: list[Delivery] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def url_for(self, tenant: str) -> str:
        if self._server is None:
            raise RuntimeError("the receiver is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}/hooks/{tenant}"

    def add_secret(self, tenant: str, secret: str) -> None:
        with self._lock:
            self.secrets.setdefault(tenant, []).append(secret)

    def receive(self, path: str, body: bytes, headers: dict[str, str]) -> Delivery:
        """Verify and record one delivery (what the HTTP handler calls)."""
        tenant = path.removeprefix("/hooks/")
        webhook_id = {k.lower(): v for k, v in headers.items()}.get("webhook-id", "")
        with self._lock:
            secrets = list(self.secrets.get(tenant, []))
        error = f"no secret for tenant {tenant!r}"
        delivery = None
        for secret in secrets:
            try:
                event = Webhook(secret).verify(body, headers)
            except WebhookVerificationError as exc:
                error = str(exc)
                continue
            data = event.get("data") or {}
            delivery = Delivery(tenant, webhook_id, str(event.get("type", "")),
                                str(data.get("id", "")), True)
            break
        if delivery is None:
            delivery = Delivery(tenant, webhook_id, "", "", False, error)
        with self._lock:
            self.deliveries.append(delivery)
        return delivery

    def start(self) -> WebhookReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                delivery = receiver.receive(self.path, body, dict(self.headers.items()))
                self.send_response(204 if delivery.verified else 400)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass  # thousands of deliveries: the record is the log

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name="webhook-receiver").start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def received(self) -> dict[tuple[str, str], list[Delivery]]:
        """Verified deliveries by (event type, object id), retries of one message included."""
        found: dict[tuple[str, str], list[Delivery]] = {}
        with self._lock:
            for delivery in self.deliveries:
                if delivery.verified:
                    found.setdefault((delivery.event_type, delivery.object_id),
                                     []).append(delivery)
        return found
