"""The chaos run's webhook receiver and its auditors' offline pieces: a delivery signed as the
service signs it (``service.webhooks.headers_for``) verifies over HTTP; one signed with another
secret is refused and recorded; the webhook audit flags an event never received, one queued
twice and a delivery that does not verify; the expired-file audit reads the bucket's answer."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
from botocore.exceptions import ClientError

from bench.chaos_audit import Audit
from bench.chaos_deliveries import check_webhooks
from bench.chaos_expiry import audit_expired
from bench.chaos_webhooks import WebhookReceiver
from bench.scale_worker import register_adapters
from engine.testing.fake_engine import FakeEngine
from service.keys import new_webhook_secret
from service.webhooks import headers_for


def _post(receiver: WebhookReceiver, tenant: str, secret: str, msg_id: str, body: str):
    headers = headers_for(secret, msg_id, _now(), body)
    return httpx.post(receiver.url_for(tenant), content=body.encode(), headers=headers,
                      timeout=10)


def test_receiver_verifies_signed_deliveries_and_records_bad_ones():
    receiver = WebhookReceiver().start()
    secret, other = new_webhook_secret(), new_webhook_secret()
    receiver.add_secret("tenant-a", secret)
    try:
        body = '{"type":"job.completed","timestamp":"t","data":{"id":"job_1"}}'
        assert _post(receiver, "tenant-a", secret, "msg_1", body).status_code == 204
        assert _post(receiver, "tenant-a", secret, "msg_1", body).status_code == 204  # a retry
        assert _post(receiver, "tenant-a", other, "msg_2", body).status_code == 400
        assert _post(receiver, "tenant-b", secret, "msg_3", body).status_code == 400
    finally:
        receiver.close()
    received = receiver.received()
    assert list(received) == [("job.completed", "job_1")]
    assert [d.webhook_id for d in received[("job.completed", "job_1")]] == ["msg_1", "msg_1"]
    bad = [d for d in receiver.deliveries if not d.verified]
    assert [d.webhook_id for d in bad] == ["msg_2", "msg_3"]
    assert "no matching signature" in bad[0].error and "no secret" in bad[1].error


class FakeS3:
    def __init__(self, keys: set[str]) -> None:
        self.keys = keys

    def head_object(self, *, Bucket: str, Key: str) -> dict:  # noqa: N803 (boto3's names)
        if Key not in self.keys:
            raise ClientError({"Error": {"Code": "404"}}, "HeadObject")
        return {}


class FakeFiles:
    def __init__(self, status: int) -> None:
        self.status = status

    def get(self, path: str) -> httpx.Response:
        return httpx.Response(self.status)


def test_expired_audit_flags_bytes_left_in_the_bucket():
    aged = [("file-gone", "t", "files/a"), ("file-left", "t", "files/b")]
    result = Audit()
    audit_expired(result, aged, s3_client=FakeS3({"boxcar/files/b"}), bucket="bx",
                  prefix="boxcar", clients={"t": FakeFiles(404)})
    assert result.checked["expired file's bytes gone from S3"] == 2
    assert [(name, subject) for name, subject, _ in result.violations] == [
        ("expired file's bytes gone from S3", "file-left")]
    result = Audit()
    audit_expired(result, aged[:1], s3_client=FakeS3(set()), bucket="bx", prefix="boxcar",
                  clients={"t": FakeFiles(200)})
    assert [name for name, _, _ in result.violations] == ["expired file gone from the API"]


def test_scale_worker_registers_adapters_with_their_config(tmp_path):
    engine = FakeEngine.paced(None)
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "adapter_config.json").write_text("{}")
    register_adapters(engine, [f"good={tmp_path / 'good'}"])
    assert engine.lora_names == ["good"]
    with pytest.raises(ValueError, match="'bad'.*adapter_config.json is missing"):
        register_adapters(engine, [f"bad={tmp_path / 'missing'}"])


def test_webhook_audit_flags_missing_duplicated_and_unverified_events():
    receiver = WebhookReceiver()
    secret = new_webhook_secret()
    receiver.add_secret("t", secret)
    body = '{"type":"job.completed","timestamp":"t","data":{"id":"job_1"}}'
    receiver.receive("/hooks/t", body.encode(), headers_for(secret, "msg_1", _now(), body))
    url = "http://127.0.0.1:1/hooks/t"
    expected = [("job.completed", "job_1"), ("job.completed", "job_2")]
    queued = Counter({("job.completed", "job_1", url): 1, ("job.completed", "job_2", url): 2})
    result = Audit()
    check_webhooks(result, expected, queued, receiver)
    assert sorted((name, subject) for name, subject, _ in result.violations) == [
        ("event queued once per target", "job_2"),  # two rows: finished twice
        ("webhook delivered and verified", "job_2")]
    receiver.receive("/hooks/t", body.encode(), headers_for(new_webhook_secret(), "msg_9",
                                                            _now(), body))
    result = Audit()
    check_webhooks(result, expected[:1], Counter({("job.completed", "job_1", url): 1}), receiver)
    assert [name for name, _, _ in result.violations] == ["every delivery verifies"]


def _now() -> int:
    import time

    return int(time.time())
