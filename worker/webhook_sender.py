"""Sends queued webhook deliveries, signed (Standard Webhooks), retried with backoff.

A due delivery is claimed by pushing its ``next_attempt_at`` forward (a conditional UPDATE, so
two workers never send the same attempt), sent, and its outcome logged on the row: delivered on
a 2xx, else retried after ``retry_delays[attempt]`` seconds until they run out (then failed).
Addresses are checked at send time too: a name that resolves to a private address is refused.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time

import httpx
from sqlalchemy import exists, select, update

from metrics.counters import WEBHOOK_ATTEMPTS
from service.db import Database, utcnow
from service.loop import RoundLoop
from service.models import DELIVERY_DELIVERED, DELIVERY_FAILED, DELIVERY_PENDING, WebhookDelivery
from service.webhooks import check_url_target, delivery_secret, headers_for

log = logging.getLogger(__name__)

CLAIM_SECONDS = 120.0


def _claim_due(db: Database, *, limit: int) -> tuple[list[int], bool]:
    """Deliveries due now, claimed for this sender; and whether any delivery is pending."""
    now = utcnow()
    claimed = []
    with db.session() as session:
        pks = session.scalars(
            select(WebhookDelivery.pk).where(WebhookDelivery.status == DELIVERY_PENDING,
                                             WebhookDelivery.next_attempt_at <= now)
            .order_by(WebhookDelivery.next_attempt_at).limit(limit)
        ).all()
        if not pks:
            pending = session.scalar(select(exists().where(
                WebhookDelivery.status == DELIVERY_PENDING))) or False
            return [], bool(pending)
        for pk in pks:
            won = session.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.pk == pk, WebhookDelivery.status == DELIVERY_PENDING,
                       WebhookDelivery.next_attempt_at <= now)
                .values(next_attempt_at=now + dt.timedelta(seconds=CLAIM_SECONDS))
                .execution_options(synchronize_session=False)
            ).rowcount
            if won:
                claimed.append(pk)
    return claimed, True


def send_one(
    db: Database,
    pk: int,
    *,
    client: httpx.Client,
    allow_private: bool,
    retry_delays: list[float],
) -> str:
    """Attempt one delivery and record it; returns the delivery's status afterwards."""
    with db.read_session() as session:
        delivery = session.get(WebhookDelivery, pk)
        secret = delivery_secret(session, delivery)
        url, msg_id, payload = delivery.url, delivery.id, delivery.payload
    started = time.monotonic()
    status_code: int | None = None
    error: str | None = None
    try:
        check_url_target(url, allow_private=allow_private)
        headers = headers_for(secret, msg_id, int(time.time()), payload)
        response = client.post(url, content=payload.encode(), headers=headers)
        status_code = response.status_code
        if not 200 <= status_code < 300:
            error = f"HTTP {status_code}"
    except (ValueError, httpx.HTTPError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    WEBHOOK_ATTEMPTS.labels("ok" if error is None else "error").inc()
    now = utcnow()
    entry = {"at": now.isoformat(), "status_code": status_code, "error": error,
             "duration_ms": round(1000 * (time.monotonic() - started))}
    with db.session() as session:
        delivery = session.get(WebhookDelivery, pk)
        delivery.attempts += 1
        delivery.last_status_code = status_code
        delivery.last_error = error
        delivery.attempt_log = [*(delivery.attempt_log or []), entry]
        if error is None:
            delivery.status = DELIVERY_DELIVERED
            delivery.delivered_at = now
            delivery.next_attempt_at = None
        elif delivery.attempts > len(retry_delays):
            delivery.status = DELIVERY_FAILED
            delivery.next_attempt_at = None
        else:
            delay = retry_delays[delivery.attempts - 1]
            delivery.next_attempt_at = now + dt.timedelta(seconds=delay)
        return delivery.status


class WebhookSender(RoundLoop):
    """A thread that sends due deliveries every ``interval`` seconds."""

    round_name = "webhook delivery round"

    def __init__(
        self,
        db: Database,
        *,
        allow_private: bool,
        retry_delays: list[float],
        timeout: float = 10.0,
        interval: float = 0.5,
        idle_interval: float | None = None,
    ) -> None:
        super().__init__(interval, idle_interval=idle_interval)
        self._pending = True
        self._db = db
        self._allow_private = allow_private
        self._retry_delays = retry_delays
        self._client = httpx.Client(timeout=timeout, follow_redirects=False)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self.run, args=(self._stopped,),
                                        name="boxcar-webhooks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 15.0) -> None:
        self._stopped.set()
        self.wake()
        self._thread.join(timeout)
        self._client.close()

    def run_round(self) -> bool:
        return self.run_once() > 0

    def is_idle(self) -> bool:
        """No delivery pending, not even a retry due later: the sender may back off."""
        return not self._pending

    def run_once(self) -> int:
        pks, self._pending = _claim_due(self._db, limit=20)
        for pk in pks:
            send_one(self._db, pk, client=self._client, allow_private=self._allow_private,
                     retry_delays=self._retry_delays)
        return len(pks)


