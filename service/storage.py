"""Object storage behind one interface: a local folder, or S3 through boto3 (any S3 server).

Objects are written through a writer that streams: the local writer fills a temporary file and
renames it into place; the S3 writer sends a single PUT for small objects and a multipart upload
(``part_size`` parts) for large ones, so memory stays bounded whatever the size.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol
from urllib.parse import urlparse

CHUNK_SIZE = 1 << 20


class ObjectWriter(Protocol):
    def write(self, data: bytes) -> None: ...

    @property
    def num_bytes(self) -> int: ...


class ObjectStorage(Protocol):
    """Keys are relative paths such as ``files/file-abc``."""

    def writer(self, key: str) -> AbstractContextManager[ObjectWriter]: ...

    def iter_chunks(self, key: str, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]: ...

    def delete(self, key: str) -> None: ...

    def exists(self, key: str) -> bool: ...

    def check(self) -> None: ...


def iter_lines(storage: ObjectStorage, key: str) -> Iterator[bytes]:
    """The object's lines without their line endings; memory bounded by the longest line."""
    tail = b""
    for chunk in storage.iter_chunks(key):
        data = tail + chunk
        lines = data.split(b"\n")
        tail = lines.pop()
        for line in lines:
            yield line.rstrip(b"\r")
    if tail:
        yield tail.rstrip(b"\r")


def put_bytes(storage: ObjectStorage, key: str, data: bytes) -> None:
    with storage.writer(key) as writer:
        writer.write(data)


def get_bytes(storage: ObjectStorage, key: str) -> bytes:
    return b"".join(storage.iter_chunks(key))


class _CountingWriter:
    def __init__(self, sink) -> None:
        self._sink = sink
        self.num_bytes = 0

    def write(self, data: bytes) -> None:
        self._sink(data)
        self.num_bytes += len(data)


class LocalStorage:
    """Objects as files under ``root``."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        path = os.path.abspath(os.path.join(self.root, key))
        if not path.startswith(self.root + os.sep):
            raise ValueError(f"storage key escapes the storage folder: {key!r}")
        return path

    @contextmanager
    def writer(self, key: str) -> Iterator[ObjectWriter]:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                yield _CountingWriter(f.write)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def iter_chunks(self, key: str, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
        with open(self._path(key), "rb") as f:
            while chunk := f.read(chunk_size):
                yield chunk

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def check(self) -> None:
        if not os.access(self.root, os.W_OK):
            raise OSError(f"storage folder {self.root} is not writable")


class _S3Writer:
    def __init__(self, client, bucket: str, key: str, part_size: int) -> None:
        self._client, self._bucket, self._key = client, bucket, key
        self._part_size = part_size
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict] = []
        self.num_bytes = 0

    def write(self, data: bytes) -> None:
        self._buffer += data
        self.num_bytes += len(data)
        while len(self._buffer) >= self._part_size:
            self._send_part(bytes(self._buffer[: self._part_size]))
            del self._buffer[: self._part_size]

    def _send_part(self, data: bytes) -> None:
        if self._upload_id is None:
            response = self._client.create_multipart_upload(Bucket=self._bucket, Key=self._key)
            self._upload_id = response["UploadId"]
        number = len(self._parts) + 1
        response = self._client.upload_part(
            Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number,
            Body=data,
        )
        self._parts.append({"ETag": response["ETag"], "PartNumber": number})

    def commit(self) -> None:
        if self._upload_id is None:
            self._client.put_object(Bucket=self._bucket, Key=self._key, Body=bytes(self._buffer))
            return
        if self._buffer:
            self._send_part(bytes(self._buffer))
        self._client.complete_multipart_upload(
            Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
            MultipartUpload={"Parts": self._parts},
        )

    def abort(self) -> None:
        if self._upload_id is not None:
            self._client.abort_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=self._upload_id
            )


class S3Storage:
    """Objects under ``s3://bucket/prefix``; ``endpoint_url`` selects a non-AWS server."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        client=None,
        part_size: int = 8 << 20,
        create_bucket: bool = False,
    ) -> None:
        if part_size < 5 << 20:
            raise ValueError(f"S3 multipart parts must be >= 5 MiB, got {part_size} bytes")
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.client(
                "s3", endpoint_url=endpoint_url, region_name=region or "us-east-1",
                config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5}),
            )
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_size = part_size
        if create_bucket:
            self._ensure_bucket()

    def _ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            self.client.create_bucket(Bucket=self.bucket)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextmanager
    def writer(self, key: str) -> Iterator[ObjectWriter]:
        writer = _S3Writer(self.client, self.bucket, self._key(key), self.part_size)
        try:
            yield writer
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    def iter_chunks(self, key: str, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        try:
            yield from body.iter_chunks(chunk_size)
        finally:
            body.close()

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError:
            return False
        return True

    def check(self) -> None:
        self.client.head_bucket(Bucket=self.bucket)


def make_storage(
    storage_url: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    create_bucket: bool = False,
) -> ObjectStorage:
    """``s3://bucket/prefix`` or a folder path (``file://`` optional)."""
    parsed = urlparse(storage_url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"storage URL needs a bucket: s3://bucket/prefix, got {storage_url!r}")
        return S3Storage(
            parsed.netloc, parsed.path, endpoint_url=endpoint_url, region=region,
            create_bucket=create_bucket,
        )
    if parsed.scheme == "file":
        return LocalStorage(parsed.path)
    if parsed.scheme and len(parsed.scheme) > 1:  # a Windows drive letter is not a scheme
        raise ValueError(f"storage URL must be s3://bucket/prefix or a folder, got {storage_url!r}")
    return LocalStorage(storage_url)
