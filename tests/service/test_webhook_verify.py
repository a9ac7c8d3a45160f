"""The receivers' verification helper (service/webhook_verify.py): the Standard Webhooks
reference vector, boxcar's own signatures, and every way a delivery must be refused:
tampered, wrong secret, stale, from the future, replayed, malformed."""

from __future__ import annotations

import json
import time

import pytest

from service.webhook_verify import ReplayGuard, Webhook, WebhookVerificationError, verify
from service.webhooks import headers_for

# Published with the Standard Webhooks specification and its reference libraries.
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
MSG_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
TIMESTAMP = 1614265330
PAYLOAD = '{"test": 2432232314}'
SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def reference_headers(**overrides: str) -> dict[str, str]:
    headers = {"webhook-id": MSG_ID, "webhook-timestamp": str(TIMESTAMP),
               "webhook-signature": SIGNATURE}
    headers.update(overrides)
    return headers


def test_reference_vector():
    hook = Webhook(SECRET)
    assert hook.sign(MSG_ID, TIMESTAMP, PAYLOAD) == SIGNATURE
    assert hook.verify(PAYLOAD, reference_headers(), now=TIMESTAMP) == {"test": 2432232314}
    assert Webhook(SECRET.removeprefix("whsec_")).verify(
        PAYLOAD.encode(), reference_headers(), now=TIMESTAMP + 299) == {"test": 2432232314}
    # Header names in any case; several signatures (key rotation), unknown schemes skipped.
    mixed = {"Webhook-Id": MSG_ID, "WEBHOOK-TIMESTAMP": str(TIMESTAMP),
             "webhook-signature": f"v1a,abc v1,bm9wZQ== {SIGNATURE}"}
    assert verify(SECRET, PAYLOAD, mixed, now=TIMESTAMP)


@pytest.mark.parametrize("payload,headers,now,reason", [
    ('{"test": 2432232315}', reference_headers(), TIMESTAMP, "no matching signature"),
    (PAYLOAD, reference_headers(**{"webhook-id": "msg_other"}), TIMESTAMP,
     "no matching signature"),
    (PAYLOAD, reference_headers(**{"webhook-timestamp": str(TIMESTAMP + 1)}), TIMESTAMP,
     "no matching signature"),
    (PAYLOAD, reference_headers(**{"webhook-signature": "v2," + SIGNATURE[3:]}), TIMESTAMP,
     "no matching signature"),
    (PAYLOAD, reference_headers(**{"webhook-signature": "v1,not*base64"}), TIMESTAMP,
     "no matching signature"),
    (PAYLOAD, reference_headers(**{"webhook-signature": SIGNATURE[3:]}), TIMESTAMP,
     "no matching signature"),
    (PAYLOAD, reference_headers(), TIMESTAMP + 301, "too old"),
    (PAYLOAD, reference_headers(), TIMESTAMP - 301, "too new"),
    (PAYLOAD, reference_headers(**{"webhook-timestamp": "yesterday"}), TIMESTAMP,
     "not unix seconds"),
    (PAYLOAD, {"webhook-id": MSG_ID, "webhook-signature": SIGNATURE}, TIMESTAMP, "missing"),
    (PAYLOAD, reference_headers(**{"webhook-signature": ""}), TIMESTAMP, "missing"),
])
def test_refused(payload, headers, now, reason):
    with pytest.raises(WebhookVerificationError, match=reason):
        Webhook(SECRET).verify(payload, headers, now=now)


def test_wrong_secret_is_refused():
    other = "whsec_" + "A" * 43 + "="
    with pytest.raises(WebhookVerificationError, match="no matching signature"):
        Webhook(other).verify(PAYLOAD, reference_headers(), now=TIMESTAMP)
    with pytest.raises(ValueError, match="base64"):
        Webhook("whsec_not base64!")


def test_replay_is_refused_but_a_retry_is_not():
    hook = Webhook(SECRET, replay_guard=ReplayGuard())
    hook.verify(PAYLOAD, reference_headers(), now=TIMESTAMP)
    with pytest.raises(WebhookVerificationError, match="replay"):
        hook.verify(PAYLOAD, reference_headers(), now=TIMESTAMP + 10)
    # boxcar's retry: same webhook-id, new timestamp and signature. Accepted; dedupe on the id.
    retry_at = TIMESTAMP + 30
    retry = reference_headers(**{"webhook-timestamp": str(retry_at),
                                 "webhook-signature": hook.sign(MSG_ID, retry_at, PAYLOAD)})
    assert hook.verify(PAYLOAD, retry, now=retry_at + 1) == {"test": 2432232314}
    with pytest.raises(WebhookVerificationError, match="too old"):  # after the window
        hook.verify(PAYLOAD, retry, now=retry_at + 400)


def test_boxcars_signatures_verify():
    body = json.dumps({"type": "batch.completed", "data": {"id": "batch_1"}})
    now = int(time.time())
    headers = headers_for(SECRET, "msg_1", now, body)
    assert verify(SECRET, body.encode(), headers)["data"]["id"] == "batch_1"
