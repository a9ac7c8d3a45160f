"""Expired files in the chaos run: their bytes must leave S3 once the service's cleanup has run.

The service's expiry is OpenAI's (``expires_after`` of an upload, ``output_expires_after`` of a
batch: 1 hour at least, ``service.expiry``), and the workers' housekeeping scan (every
``BOXCAR_FINALIZE_SCAN_INTERVAL`` seconds) deletes expired files' bytes, then their rows (an
input file a batch names keeps its row, ``deleted_at`` set). An hour does not fit in a run, so
the bench moves time instead of the service: ``age`` sets the ``expires_at`` of files that
asked for a lifetime (and nothing else) to a second ago, as if the hour had passed, and the
service's own scan does the rest. During the run it ages uploads no batch names (their
deletes then meet S3 outages and database restarts); after the batches are audited, the
files of finished batches that asked for one. ``audit_expired`` then reads the bucket
directly with boto3 (not through the service) and the API: no aged file's object is left,
and the API answers 404 for it.
"""

from __future__ import annotations

import time

import httpx
from sqlalchemy import create_engine, text

from bench.chaos_audit import Audit
from service.models import BATCH_TERMINAL

# The lifetime the workload asks for: the shortest OpenAI allows. Only files expiring within
# twice that of their creation are aged (the deployment's default is 30 days).
LIFETIME_S = 3600


def age(database_url: str, file_ids: list[str]) -> list[tuple[str, str, str]]:
    """Expire these files now (those that asked for a lifetime and are not deleted yet);
    returns (file id, tenant name, storage key) of each one aged."""
    if not file_ids:
        return []
    engine = create_engine(database_url, connect_args={"connect_timeout": 5})
    try:
        with engine.begin() as conn:
            return [tuple(r) for r in conn.execute(text(
                "UPDATE files f SET expires_at = now() - interval '1 second' FROM tenants t "
                "WHERE t.id = f.tenant_id AND f.id = ANY(:ids) AND f.deleted_at IS NULL "
                "AND f.expires_at IS NOT NULL "
                "AND f.expires_at <= f.created_at + make_interval(secs => :limit) "
                "RETURNING f.id, t.name, f.storage_key"),
                {"ids": file_ids, "limit": 2 * LIFETIME_S}).all()]
    finally:
        engine.dispose()


def finished_batch_files(database_url: str) -> list[str]:
    """Input, output and error files of batches in a final status."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT input_file_id, output_file_id, error_file_id FROM batches "
                "WHERE status = ANY(:final)"), {"final": list(BATCH_TERMINAL)}).all()
    finally:
        engine.dispose()
    return [file_id for row in rows for file_id in row if file_id]


def wait_deleted(database_url: str, file_ids: list[str], timeout_s: float) -> float:
    """Seconds until the service's cleanup marked or removed every one of these files."""
    started = time.monotonic()
    engine = create_engine(database_url)
    try:
        while time.monotonic() - started < timeout_s:
            with engine.connect() as conn:
                left = conn.scalar(text(
                    "SELECT count(*) FROM files WHERE id = ANY(:ids) AND deleted_at IS NULL"),
                    {"ids": file_ids})
            if not left:
                break
            time.sleep(1.0)
    finally:
        engine.dispose()
    return time.monotonic() - started


def audit_expired(result: Audit, aged: list[tuple[str, str, str]], *, s3_client, bucket: str,
                  prefix: str, clients: dict[str, httpx.Client]) -> None:
    """Each aged file: no object under its key in the bucket, and a 404 from the API."""
    from botocore.exceptions import ClientError

    for file_id, tenant, storage_key in aged:
        key = f"{prefix.strip('/')}/{storage_key}" if prefix.strip("/") else storage_key
        try:
            s3_client.head_object(Bucket=bucket, Key=key)
            gone, what = False, f"s3://{bucket}/{key} still there"
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            gone, what = code in ("404", "NoSuchKey", "NotFound"), f"head_object: {code}"
        result.check("expired file's bytes gone from S3", file_id, gone, what)
        status = clients[tenant].get(f"/v1/files/{file_id}").status_code
        result.check("expired file gone from the API", file_id, status == 404, str(status))
