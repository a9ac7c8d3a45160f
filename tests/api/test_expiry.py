"""File expiry: ``expires_after`` on upload and ``output_expires_after`` on batch create, within
OpenAI's bounds; ``expires_at`` on file objects; the housekeeping step that deletes expired files
from object storage and the database, in bounded steps. Time is injected (``now=``), never
slept through."""

from __future__ import annotations

import datetime as dt

from openai.types import FileObject
from sqlalchemy import select

from service.expiry import delete_expired
from service.keys import get_or_create_tenant
from service.models import Batch, File
from service.storage import S3Storage, put_bytes
from tests.conftest_services import chat_line, jsonl
from tests.openai_shapes import strict

HOUR = 3600


def upload(client, lines=None, **form):
    data = {"purpose": "batch", **{f"expires_after[{k}]": str(v) for k, v in form.items()}}
    return client.post("/v1/files", data=data,
                       files={"file": ("in.jsonl", jsonl(lines or [chat_line("a", "x")]))})


def at(file: dict, seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(file["created_at"] + seconds, dt.UTC)


def row_of(ctx, file_id: str) -> File | None:
    with ctx.db.read_session() as session:
        return session.scalars(select(File).where(File.id == file_id)).first()


def test_expires_after_sets_expires_at_within_openais_bounds(client, ctx):
    file = upload(client, anchor="created_at", seconds=HOUR).json()
    strict(FileObject, file)
    assert file["expires_at"] == file["created_at"] + HOUR
    default = upload(client).json()
    assert default["expires_at"] == default["created_at"] + ctx.settings.file_expires_after
    assert client.get(f"/v1/files/{file['id']}").json()["expires_at"] == file["expires_at"]
    for form, param, fragment in (
        ({"anchor": "created_at", "seconds": 3599}, "expires_after.seconds",
         "between 3600 (1 hour) and 2592000 (30 days), got 3599"),
        ({"anchor": "created_at", "seconds": 2592001}, "expires_after.seconds", "got 2592001"),
        ({"anchor": "created_at", "seconds": "soon"}, "expires_after.seconds", "an integer"),
        ({"anchor": "last_active_at", "seconds": HOUR}, "expires_after.anchor",
         "must be 'created_at'"),
        ({"seconds": HOUR}, "expires_after.anchor", "got None"),
    ):
        response = upload(client, **form)
        assert response.status_code == 400, (form, response.text)
        error = response.json()["error"]
        assert error["param"] == param and fragment in error["message"], error
        assert error["code"] == "invalid_expires_after"


def test_output_expires_after_on_batch_create(client, ctx):
    file_id = upload(client).json()["id"]

    def create(**extra):
        return client.post("/v1/batches", json={"input_file_id": file_id, "completion_window":
                                                "24h", "endpoint": "/v1/chat/completions",
                                                **extra})

    bad = create(output_expires_after={"anchor": "created_at", "seconds": 60})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == (
        "output_expires_after.seconds")
    bad = create(output_expires_after={"anchor": "now", "seconds": HOUR})
    assert bad.json()["error"]["param"] == "output_expires_after.anchor"
    assert create(output_expires_after={"seconds": HOUR}).status_code == 400
    ok = create(output_expires_after={"anchor": "created_at", "seconds": 2 * HOUR})
    assert ok.status_code == 200, ok.text
    default_id = create().json()["id"]
    with ctx.db.read_session() as session:
        batch = session.scalars(select(Batch).where(Batch.id == ok.json()["id"])).one()
        assert batch.output_expires_after == 2 * HOUR
        default = session.scalars(select(Batch).where(Batch.id == default_id)).one()
        assert default.output_expires_after == ctx.settings.output_expires_after


def test_an_expired_file_is_deleted_from_storage_and_the_database(client, ctx):
    file = upload(client, anchor="created_at", seconds=HOUR).json()
    kept = upload(client, anchor="created_at", seconds=2 * HOUR).json()
    key = row_of(ctx, file["id"]).storage_key
    assert ctx.storage.exists(key)
    # Not yet: a second before its expiry nothing goes.
    assert delete_expired(ctx.db, ctx.storage, now=at(file, HOUR - 1)) == 0
    assert ctx.storage.exists(key)
    assert delete_expired(ctx.db, ctx.storage, now=at(file, HOUR + 1)) == 1
    assert not ctx.storage.exists(key)  # the bytes are gone
    assert row_of(ctx, file["id"]) is None  # and the row
    assert client.get(f"/v1/files/{file['id']}").status_code == 404
    assert client.get(f"/v1/files/{file['id']}/content").status_code == 404
    assert [f["id"] for f in client.get("/v1/files").json()["data"]] == [kept["id"]]
    assert ctx.storage.exists(row_of(ctx, kept["id"]).storage_key)


def test_a_batch_input_keeps_its_row_and_loses_its_bytes(client, ctx):
    file = upload(client, anchor="created_at", seconds=HOUR).json()
    batch = client.post("/v1/batches", json={"input_file_id": file["id"], "completion_window":
                                             "24h", "endpoint": "/v1/chat/completions"}).json()
    key = row_of(ctx, file["id"]).storage_key
    assert delete_expired(ctx.db, ctx.storage, now=at(file, HOUR + 1)) == 1
    row = row_of(ctx, file["id"])
    assert row is not None and row.deleted_at is not None and row.line_errors is None
    assert not ctx.storage.exists(key)
    assert client.get(f"/v1/files/{file['id']}").status_code == 404
    assert client.get(f"/v1/batches/{batch['id']}").json()["input_file_id"] == file["id"]
    assert delete_expired(ctx.db, ctx.storage, now=at(file, 2 * HOUR)) == 0  # once only


def test_deletion_goes_in_bounded_steps(client, ctx):
    files = [upload(client, anchor="created_at", seconds=HOUR).json() for _ in range(5)]
    later = at(files[-1], HOUR + 1)
    assert [delete_expired(ctx.db, ctx.storage, now=later, limit=2) for _ in range(4)] == [
        2, 2, 1, 0]
    assert all(row_of(ctx, f["id"]) is None for f in files)


def test_the_api_hides_a_file_past_its_expiry_before_the_housekeeper_runs(client, ctx):
    file = upload(client, anchor="created_at", seconds=HOUR).json()
    with ctx.db.session() as session:
        row = session.scalars(select(File).where(File.id == file["id"])).one()
        row.expires_at = row.created_at - dt.timedelta(seconds=1)  # as if an hour had passed
    assert client.get(f"/v1/files/{file['id']}/content").status_code == 404
    assert client.get("/v1/files").json()["data"] == []


def test_expired_objects_leave_s3_on_moto(ctx):
    import boto3
    from moto import mock_aws

    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        storage = S3Storage("bucket", "prefix", client=client, create_bucket=True)
        now = dt.datetime.now(dt.UTC)
        with ctx.db.session() as session:
            tenant = get_or_create_tenant(session, name="acme")
            for name, expires in (("old", now - dt.timedelta(seconds=1)),
                                  ("new", now + dt.timedelta(hours=1))):
                put_bytes(storage, f"files/{name}", b"{}\n")
                session.add(File(id=f"file-{name}", tenant_id=tenant.id, filename=name,
                                 purpose="batch", bytes=3, storage_key=f"files/{name}",
                                 created_at=now - dt.timedelta(hours=2), expires_at=expires))
        assert delete_expired(ctx.db, storage, now=now) == 1
        keys = [o["Key"] for o in client.list_objects_v2(Bucket="bucket").get("Contents", [])]
        assert keys == ["prefix/files/new"]
