"""Uploads: a multipart body streamed into object storage while each JSONL line is checked.

Nothing holds the whole file: the multipart parser hands the file part over in chunks, each
complete line is validated as it passes (``openai_format.parse.parse_line``), and the bytes go on
to the storage writer. The file record keeps the counts and the first line-level problems.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy.orm import Session

from api.errors import ApiError
from openai_format.embeddings import MAX_BATCH_EMBEDDING_INPUTS
from openai_format.parse import CustomIdTracker, LineError, parse_line
from service import ids
from service.db import utcnow
from service.expiry import expires_at
from service.lines import EmbeddingInputBudget, ModelTracker, enqueued_tokens
from service.models import File
from service.storage import ObjectStorage

MAX_RECORDED_ERRORS = 100
MAX_LINE_BYTES = 32 << 20


def file_storage_key(file_id: str) -> str:
    return f"files/{file_id}"


def file_too_large(max_bytes: int, *, param: str = "file") -> ApiError:
    """The 400 of a batch file over ``max_bytes`` (OpenAI answers a 400 naming the field, not a
    413), whether its declared length says so or its streamed bytes pass the limit."""
    return ApiError(400, f"'{param}' is larger than the limit of {max_bytes:,} bytes per batch "
                    "file.", code="file_too_large", param=param)


@dataclass
class JsonlIngest:
    """Streams bytes into storage and checks them line by line. ``feed`` raises ``ApiError``."""

    storage: ObjectStorage
    file_id: str
    max_bytes: int
    max_lines: int
    max_embedding_inputs: int = MAX_BATCH_EMBEDDING_INPUTS
    num_bytes: int = 0
    num_lines: int = 0  # non-blank lines
    num_objects: int = 0  # lines that are JSON objects (valid or not)
    num_errors: int = 0
    num_tokens: int = 0  # enqueued tokens of the valid lines (service.lines.enqueued_tokens)
    errors: list[dict[str, Any]] = field(default_factory=list)
    _tail: bytearray = field(default_factory=bytearray)
    _line_no: int = 0
    _ids: CustomIdTracker = field(default_factory=CustomIdTracker)
    _models: ModelTracker = field(default_factory=ModelTracker)
    _cm: Any = None
    _writer: Any = None
    _inputs: EmbeddingInputBudget | None = None

    param: str = "file"  # the request field the lines came in (``requests`` when inline)

    @property
    def storage_key(self) -> str:
        return file_storage_key(self.file_id)

    def feed(self, data: bytes) -> None:
        if self._writer is None:
            self._cm = self.storage.writer(self.storage_key)
            self._writer = self._cm.__enter__()
        self.num_bytes += len(data)
        if self.num_bytes > self.max_bytes:
            raise file_too_large(self.max_bytes, param=self.param)
        self._writer.write(data)
        self._tail += data
        start = 0
        while (end := self._tail.find(b"\n", start)) != -1:
            self._check_length(end - start, self._line_no + 1)
            self._check(bytes(self._tail[start:end]))
            start = end + 1
        del self._tail[:start]
        self._check_length(len(self._tail), self._line_no + 1)

    @staticmethod
    def _check_length(num_bytes: int, line_no: int) -> None:
        if num_bytes > MAX_LINE_BYTES:
            raise ApiError(
                400, f"Line {line_no} is longer than {MAX_LINE_BYTES} bytes: "
                "is this a JSONL file?", code="invalid_file", param="file",
            )

    def _check(self, raw: bytes) -> None:
        self._line_no += 1
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            return
        self.num_lines += 1
        if self.num_lines > self.max_lines:
            raise ApiError(
                400, f"'{self.param}' has more than {self.max_lines:,} lines, the limit per "
                "batch file.", code="too_many_lines", param=self.param,
            )
        result = parse_line(raw, line_no=self._line_no)
        if isinstance(result, LineError):
            if result.is_object:
                self.num_objects += 1
            self._record(result)
            return
        self.num_objects += 1
        if self._inputs is None:
            self._inputs = EmbeddingInputBudget(self.max_embedding_inputs)
        problem = (self._ids.check(result.custom_id, line_no=self._line_no)
                   or self._models.check(result) or self._inputs.check(result))
        if problem is not None:
            self._record(problem)
        else:
            self.num_tokens += enqueued_tokens(result)

    def _record(self, error: LineError) -> None:
        self.num_errors += 1
        if len(self.errors) < MAX_RECORDED_ERRORS:
            self.errors.append(
                {"line": error.line_no, "code": error.code, "message": error.message,
                 "custom_id": error.custom_id}
            )

    def finish(self) -> None:
        """Check the last line and commit the object; raises ``ApiError`` for a non-JSONL file."""
        if self._writer is None:
            self.feed(b"")
        if self._tail:
            self._check(bytes(self._tail))
            self._tail.clear()
        if self.num_lines == 0:
            raise ApiError(400, "File is empty: expected JSONL, one request per line.",
                           code="invalid_file", param="file")
        if self.num_objects == 0:
            first = self.errors[0]["message"] if self.errors else ""
            raise ApiError(
                400, f"File is not JSONL: no line is a JSON object ({first}).",
                code="invalid_file", param="file",
            )
        cm, self._cm, self._writer = self._cm, None, None
        cm.__exit__(None, None, None)

    def abort(self) -> None:
        """Discard what was written (safe to call at any point, or twice)."""
        if self._cm is not None:
            cm, self._cm, self._writer = self._cm, None, None
            try:
                cm.__exit__(RuntimeError, RuntimeError("upload aborted"), None)
            except RuntimeError:
                pass

    def to_file(self, *, tenant_id: str, filename: str, purpose: str) -> File:
        return File(
            id=self.file_id, tenant_id=tenant_id, filename=filename, purpose=purpose,
            bytes=self.num_bytes, storage_key=self.storage_key, num_lines=self.num_lines,
            num_errors=self.num_errors, line_errors=self.errors, model=self._models.model,
            enqueued_tokens=self.num_tokens,
        )


class _SinkError(Exception):
    """Carries an exception of the file-data callback through the multipart parser."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class MultipartStream:
    """A push parser for ``multipart/form-data``: small fields are collected, the part named
    ``file`` goes to ``on_file_data`` chunk by chunk."""

    MAX_FIELD_BYTES = 4096

    def __init__(self, content_type: str | None, on_file_data: Callable[[bytes], None]) -> None:
        kind, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise ApiError(400, "Expected a multipart/form-data body with 'file' and 'purpose'.",
                           code="invalid_request")
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.saw_file = False
        self._on_file_data = on_file_data
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._is_file = False
        self._value = bytearray()
        self._parser = MultipartParser(boundary, {
            "on_part_begin": self._part_begin,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_header_field": lambda d, s, e: self._header_field.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self._header_value.extend(d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
        })

    def _part_begin(self) -> None:
        self._headers.clear()
        self._value.clear()
        self._name, self._is_file = None, False

    def _header_end(self) -> None:
        self._headers[bytes(self._header_field).lower()] = bytes(self._header_value)
        self._header_field.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = params.get(b"name", b"").decode("utf-8", "replace")
        self._is_file = self._name == "file"
        if self._is_file:
            self.saw_file = True
            raw = params.get(b"filename")
            self.filename = raw.decode("utf-8", "replace") if raw else "upload.jsonl"

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            try:
                self._on_file_data(data[start:end])
            except Exception as exc:  # the file's own problem or storage's, not the body's
                raise _SinkError(exc) from exc
            return
        self._value += data[start:end]
        if len(self._value) > self.MAX_FIELD_BYTES:
            raise ApiError(400, f"Form field {self._name!r} is too long.", code="invalid_request")

    def _part_end(self) -> None:
        if not self._is_file and self._name:
            self.fields[self._name] = self._value.decode("utf-8", "replace")

    def feed(self, data: bytes) -> None:
        try:
            self._parser.write(data)
        except _SinkError as exc:
            raise exc.error from None
        except ApiError:
            raise
        except Exception as exc:  # the parser's own errors: a malformed body
            raise ApiError(400, f"Malformed multipart body: {exc}", code="invalid_request") from exc

    def finish(self) -> None:
        try:
            self._parser.finalize()
        except _SinkError as exc:
            raise exc.error from None


class InlineRequestsFile:
    """Inline requests written as a batch input file as they come, checked like an upload's
    lines (``store_inline_requests`` for a list at hand; a Message Batch's create streams)."""

    def __init__(self, storage: ObjectStorage, *, endpoint: str, max_bytes: int, max_lines: int,
                 max_embedding_inputs: int = MAX_BATCH_EMBEDDING_INPUTS) -> None:
        self.endpoint = endpoint
        self.ingest = JsonlIngest(storage, ids.file_id(), max_bytes, max_lines,
                                  max_embedding_inputs, param="requests")

    def add(self, request: dict[str, Any]) -> None:
        line = {"custom_id": request.get("custom_id"), "method": request.get("method", "POST"),
                "url": request.get("url") or self.endpoint, "body": request.get("body")}
        self.ingest.feed(json.dumps(line, ensure_ascii=False).encode() + b"\n")

    def abort(self) -> None:
        self.ingest.abort()

    def store(self, session: Session, *, tenant_id: str, expires_after: int | None) -> File:
        """The file row, its object complete in storage; it expires ``expires_after`` seconds
        from now (None: never)."""
        self.ingest.finish()
        row = self.ingest.to_file(tenant_id=tenant_id, filename="inline-requests.jsonl",
                                  purpose="batch")
        row.created_at = utcnow()
        row.expires_at = expires_at(row.created_at, expires_after)
        session.add(row)
        session.flush()
        return row


def store_inline_requests(
    session: Session,
    storage: ObjectStorage,
    *,
    tenant_id: str,
    endpoint: str,
    requests: Iterable[dict[str, Any]],
    max_bytes: int,
    max_lines: int,
    expires_after: int | None,
    max_embedding_inputs: int = MAX_BATCH_EMBEDDING_INPUTS,
) -> File:
    """Write an inline ``requests`` array as a batch input file, checked like an upload, that
    expires ``expires_after`` seconds from now (None: never)."""
    file = InlineRequestsFile(storage, endpoint=endpoint, max_bytes=max_bytes,
                              max_lines=max_lines, max_embedding_inputs=max_embedding_inputs)
    try:
        for request in requests:
            file.add(request)
        return file.store(session, tenant_id=tenant_id, expires_after=expires_after)
    except BaseException:
        file.abort()
        raise
