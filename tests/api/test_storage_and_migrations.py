"""Object storage (local folder, S3 on moto and on a real SeaweedFS server) and the Alembic
migrations (they build exactly the models' schema, on SQLite and PostgreSQL)."""

from __future__ import annotations

import pytest

from service.storage import LocalStorage, S3Storage, get_bytes, iter_lines, make_storage, put_bytes
from tests.conftest_services import migrated

PART = 5 << 20


def exercise(storage) -> None:
    put_bytes(storage, "files/a.jsonl", b'{"x": 1}\n{"x": 2}\r\nlast')
    assert storage.exists("files/a.jsonl") and not storage.exists("files/missing")
    assert list(iter_lines(storage, "files/a.jsonl")) == [b'{"x": 1}', b'{"x": 2}', b"last"]
    # A failed write leaves nothing behind.
    with pytest.raises(RuntimeError):
        with storage.writer("files/broken") as writer:
            writer.write(b"partial")
            raise RuntimeError("boom")
    assert not storage.exists("files/broken")
    storage.delete("files/a.jsonl")
    assert not storage.exists("files/a.jsonl")
    storage.check()


def test_local_storage(tmp_path):
    storage = make_storage(str(tmp_path / "objects"))
    assert isinstance(storage, LocalStorage)
    exercise(storage)
    with pytest.raises(ValueError):
        storage.writer("../escape").__enter__()


def test_s3_storage_on_moto():
    import boto3
    from moto import mock_aws

    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        storage = S3Storage("bucket", "prefix", client=client, create_bucket=True)
        exercise(storage)
        put_bytes(storage, "k", b"v")
        assert client.list_objects_v2(Bucket="bucket")["Contents"][0]["Key"] == "prefix/k"


def test_s3_multipart_on_seaweedfs(seaweedfs, s3_bucket, monkeypatch):
    for name, value in seaweedfs.env().items():
        monkeypatch.setenv(name, value)
    storage = make_storage(f"s3://{s3_bucket}/objs", endpoint_url=seaweedfs.endpoint_url)
    assert isinstance(storage, S3Storage)
    exercise(storage)
    # Bigger than one part: a multipart upload, streamed back in order.
    storage = S3Storage(s3_bucket, "objs", endpoint_url=seaweedfs.endpoint_url, part_size=PART)
    line = b"x" * 1023 + b"\n"
    with storage.writer("big.jsonl") as writer:
        for _ in range((PART * 2 + 12345) // len(line)):
            writer.write(line)
    data = get_bytes(storage, "big.jsonl")
    assert len(data) == writer.num_bytes > 2 * PART and set(data.split(b"\n")[:-1]) == {line[:-1]}
    assert storage.client.head_object(Bucket=s3_bucket, Key="objs/big.jsonl")["ETag"].endswith(
        '-3"')


def test_bad_storage_urls():
    with pytest.raises(ValueError):
        make_storage("s3:///no-bucket")
    with pytest.raises(ValueError):
        make_storage("gs://bucket/x")


def test_migrations_build_the_models_schema(any_db_url):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from service.migrate import current
    from service.models import Base

    db = migrated(any_db_url)
    assert current(db) is not None
    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
    migrated(any_db_url)  # idempotent
    db.dispose()
