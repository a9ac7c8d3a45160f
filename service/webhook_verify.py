"""Verify boxcar's webhook deliveries on the receiving side (the Standard Webhooks algorithm).

Standard library only, so a receiver can use it without the rest of boxcar (or copy the file)::

    from service.webhook_verify import ReplayGuard, Webhook, WebhookVerificationError

    hook = Webhook(secret, replay_guard=ReplayGuard())   # the endpoint's or tenant's whsec_...
    try:
        event = hook.verify(raw_body, request.headers)    # the parsed JSON payload
    except WebhookVerificationError:
        return 400

A delivery carries ``webhook-id``, ``webhook-timestamp`` (unix seconds) and
``webhook-signature`` (space-separated ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``).
It is accepted when a ``v1`` signature matches (compared in constant time) and the timestamp is
within ``tolerance`` seconds of now, either way (the reference's 5 minutes), which is what makes
an old captured message useless. Within that window a ``ReplayGuard`` refuses a message seen
before (same id and timestamp). boxcar retries a failed delivery with the same ``webhook-id``
and a new timestamp and signature: that is accepted, and the id is the key to deduplicate on.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_SECONDS = 5 * 60


class WebhookVerificationError(Exception):
    """The delivery is not authentic, is stale, or was replayed."""


class ReplayGuard:
    """The (id, timestamp) pairs accepted in the last ``2 * tolerance`` seconds, in memory.

    A receiver with several processes shares this state instead (e.g. Redis ``SET NX EX``)."""

    def __init__(self, tolerance: float = DEFAULT_TOLERANCE_SECONDS,
                 max_entries: int = 100_000) -> None:
        self._keep = 2 * tolerance
        self._max_entries = max_entries
        self._seen: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._lock = threading.Lock()

    def check_and_remember(self, msg_id: str, timestamp: int, *, now: float) -> None:
        key = (msg_id, timestamp)
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now - self._keep
                                  or len(self._seen) >= self._max_entries):
                self._seen.popitem(last=False)
            if key in self._seen:
                raise WebhookVerificationError(
                    f"message {msg_id} at {timestamp} was already received: a replay")
            self._seen[key] = now


def _secret_bytes(secret: str | bytes) -> bytes:
    if isinstance(secret, bytes):
        return secret
    if not secret:
        raise ValueError("the webhook secret is empty")
    try:
        return base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except binascii.Error as exc:
        raise ValueError("the webhook secret must be whsec_ followed by base64") from exc


class Webhook:
    """Signs and verifies with one secret (``whsec_...``, the base64 part, or raw bytes)."""

    def __init__(self, secret: str | bytes, *, tolerance: float = DEFAULT_TOLERANCE_SECONDS,
                 replay_guard: ReplayGuard | None = None) -> None:
        self._key = _secret_bytes(secret)
        self.tolerance = tolerance
        self.replay_guard = replay_guard

    def sign(self, msg_id: str, timestamp: int, payload: str | bytes) -> str:
        """The ``webhook-signature`` value for one message: ``v1,<base64>``."""
        body = payload if isinstance(payload, bytes) else payload.encode()
        signed = f"{msg_id}.{timestamp}.".encode() + body
        digest = hmac.new(self._key, signed, hashlib.sha256).digest()
        return "v1," + base64.b64encode(digest).decode()

    def verify(self, payload: str | bytes, headers: Mapping[str, str], *,
               now: float | None = None) -> Any:
        """The parsed JSON payload of an authentic, fresh, first-seen delivery; otherwise
        ``WebhookVerificationError`` saying why."""
        headers = {k.lower(): v for k, v in headers.items()}
        msg_id = headers.get("webhook-id")
        timestamp_text = headers.get("webhook-timestamp")
        signatures = headers.get("webhook-signature")
        if not (msg_id and timestamp_text and signatures):
            raise WebhookVerificationError(
                "missing webhook-id, webhook-timestamp or webhook-signature header")
        try:
            timestamp = int(timestamp_text)
        except ValueError:
            raise WebhookVerificationError(
                f"webhook-timestamp is not unix seconds: {timestamp_text!r}") from None
        now = time.time() if now is None else now
        if timestamp < now - self.tolerance:
            raise WebhookVerificationError("message timestamp too old (a stale or replayed "
                                           f"message: {now - timestamp:.0f}s)")
        if timestamp > now + self.tolerance:
            raise WebhookVerificationError(
                f"message timestamp too new ({timestamp - now:.0f}s in the future)")
        expected = base64.b64decode(self.sign(msg_id, timestamp, payload).split(",", 1)[1])
        matched = False
        for candidate in signatures.split(" "):
            version, _, encoded = candidate.partition(",")
            if version != "v1":
                continue  # other schemes (v1a, ...) are not ours to check
            try:
                offered = base64.b64decode(encoded, validate=True)
            except binascii.Error:
                continue
            matched = hmac.compare_digest(expected, offered) or matched
        if not matched:
            raise WebhookVerificationError("no matching signature found")
        if self.replay_guard is not None:
            self.replay_guard.check_and_remember(msg_id, timestamp, now=now)
        body = payload if isinstance(payload, str) else payload.decode()
        try:
            return json.loads(body)
        except json.JSONDecodeError as exc:
            raise WebhookVerificationError(f"the payload is not JSON: {exc}") from exc


def verify(secret: str | bytes, payload: str | bytes, headers: Mapping[str, str], *,
           tolerance: float = DEFAULT_TOLERANCE_SECONDS, now: float | None = None) -> Any:
    """One-off verification without replay tracking (see ``Webhook``)."""
    return Webhook(secret, tolerance=tolerance).verify(payload, headers, now=now)
