"""Parse and check one line of an OpenAI Batch input file.

Input line: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions"
| "/v1/responses" | "/v1/embeddings" | "/v1/rerank" | "/v1/score" | "/v1/messages", "body": {...}}``
(a /v1/messages body is Anthropic's ``params``, and its errors name it so).
``parse_line`` never raises on user input: it returns a ``BatchLine`` or a ``LineError`` whose
message names the line and the field ("line 7: body.temperature must be between 0 and 2").
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from openai_format.embeddings import EmbeddingRequest
from openai_format.messages_request import MessagesRequest
from openai_format.responses import failed_line
from openai_format.responses_request import ResponsesRequest
from openai_format.scoring import RerankRequest, ScoreRequest
from openai_format.types import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    ENDPOINTS,
    INVALID_TYPE,
    INVALID_VALUE,
    MESSAGES_URL,
    RERANK_URL,
    RESPONSES_URL,
    SCORE_URL,
    ChatCompletionRequest,
    CompletionRequest,
)

Body = (ChatCompletionRequest | CompletionRequest | ResponsesRequest | EmbeddingRequest
        | RerankRequest | ScoreRequest | MessagesRequest)
# The body type of each endpoint.
BODY_TYPES: dict[str, type[Body]] = {
    CHAT_URL: ChatCompletionRequest, COMPLETIONS_URL: CompletionRequest,
    RESPONSES_URL: ResponsesRequest, EMBEDDINGS_URL: EmbeddingRequest,
    RERANK_URL: RerankRequest, SCORE_URL: ScoreRequest, MESSAGES_URL: MessagesRequest,
}

# Line error codes.
INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
MISSING_CUSTOM_ID = "missing_custom_id"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
INVALID_METHOD = "invalid_method"
INVALID_URL = "invalid_url"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
SERVER_ERROR = "server_error"

UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class BatchLine:
    """One valid input line."""

    custom_id: str
    url: str
    body: Body
    line_no: int

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL


@dataclass(frozen=True)
class LineError:
    """Why one input line cannot run: ``detail`` names the field, ``message`` the line too
    (``line N: detail``). ``is_object`` is False when the line is not a JSON object at all."""

    code: str
    detail: str
    line_no: int
    custom_id: str | None = None
    is_object: bool = True
    # False for errors found when the line is prepared for the engine: the worker writes
    # those without the line number (it runs rows, not file lines), and so does `boxcar run`.
    numbered: bool = True
    param: str | None = None  # the body field at fault, where one is known

    @property
    def message(self) -> str:
        return f"line {self.line_no}: {self.detail}" if self.numbered else self.detail

    def to_line(self, *, request_id: str) -> dict[str, Any] | None:
        """The error file's line (OpenAI's shape for a refused request), or None for a line
        without a custom_id: that one is reported by its line number only (a batch's
        ``errors.data``, ``boxcar run``'s summary)."""
        if self.custom_id is None:
            return None
        return failed_line(self.custom_id, self.code, self.message, request_id=request_id,
                           param=self.param, status_code=status_code(self.code))


def status_code(code: str) -> int:
    """The HTTP status a request failing with ``code`` gets."""
    return 500 if code == SERVER_ERROR else 400


class CustomIdTracker:
    """Remembers the custom_ids seen while streaming a file; a repeat is an error line."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, custom_id: object) -> bool:
        return custom_id in self._seen

    def check(self, custom_id: str, *, line_no: int) -> LineError | None:
        """Record ``custom_id``; return an error if it was already seen."""
        if custom_id in self._seen:
            return LineError(DUPLICATE_CUSTOM_ID,
                             f"custom_id {custom_id!r} is used by an earlier line", line_no,
                             custom_id)
        self._seen.add(custom_id)
        return None


def parse_line(
    raw: str | bytes, *, line_no: int, endpoint: str | None = None
) -> BatchLine | LineError:
    """Parse and check one input line; ``endpoint``, when given, is the batch's only URL."""

    def error(code: str, what: str, custom_id: str | None = None) -> LineError:
        return LineError(code, what, line_no, custom_id)

    def not_an_object(code: str, what: str) -> LineError:
        return LineError(code, what, line_no, is_object=False)

    if isinstance(raw, bytes):
        if line_no == 1 and raw.startswith(UTF8_BOM):
            raw = raw[len(UTF8_BOM):]
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return not_an_object(INVALID_JSON, f"not valid UTF-8 (byte {exc.start})")
    elif line_no == 1 and raw.startswith("\ufeff"):
        raw = raw[1:]  # a file saved with a byte order mark (Windows editors write one)
    if not raw.strip():
        return not_an_object(INVALID_JSON, "empty line")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return not_an_object(INVALID_JSON, f"not valid JSON: {exc.msg} (column {exc.colno})")
    except RecursionError:
        return not_an_object(INVALID_JSON, "not valid JSON: nested too deeply")
    if not isinstance(data, dict):
        return not_an_object(INVALID_REQUEST, f"expected a JSON object, got {_json_type(data)}")
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        # Valid JSON and a valid Python str, but no Unicode text: no column, tokenizer or
        # output file can hold it.
        custom_id = data.get("custom_id")
        return error(INVALID_REQUEST, "a string holds a lone surrogate escape (\\ud800-\\udfff "
                     "without its pair): not valid Unicode text",
                     custom_id if isinstance(custom_id, str) and custom_id
                     and not _has_lone_surrogate(custom_id) else None)

    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        what = "is missing" if custom_id is None else "must be a non-empty string"
        return error(MISSING_CUSTOM_ID, f"custom_id {what}")
    method = data.get("method")
    if method != "POST":
        return error(INVALID_METHOD, f"method must be 'POST', got {method!r}", custom_id)
    url = data.get("url")
    if url not in ENDPOINTS:
        return error(
            INVALID_URL, f"url must be one of {', '.join(map(repr, ENDPOINTS))}, got {url!r}",
            custom_id)
    if endpoint is not None and url != endpoint:
        return error(
            INVALID_URL, f"url {url!r} does not match the batch's endpoint {endpoint!r}", custom_id
        )
    body = data.get("body")
    if not isinstance(body, dict):
        what = "is missing" if body is None else f"must be an object, got {_json_type(body)}"
        return error(INVALID_REQUEST, f"body {what}", custom_id)

    try:
        parsed = BODY_TYPES[url].model_validate(body)
    except ValidationError as exc:
        code, what = describe_validation_error(exc, root=BODY_TYPES[url].body_name)
        return error(code, what, custom_id)
    return BatchLine(custom_id, url, parsed, line_no)


def describe_validation_error(exc: ValidationError, *, root: str = "body") -> tuple[str, str]:
    """The first pydantic error as (code, "body.field must be ..."); ``root`` names the body."""
    err = exc.errors(include_url=False)[0]
    path = _path(err["loc"], root)
    kind = err["type"]
    if kind == INVALID_VALUE:
        # Model-level checks already name their fields.
        return INVALID_VALUE, err["msg"] if path == root else f"{path} {err['msg']}"
    if kind == INVALID_TYPE:
        return INVALID_REQUEST, f"{path} {err['msg']}"
    if kind == "missing":
        return INVALID_REQUEST, f"{path} is required"
    if kind == "literal_error":
        return INVALID_VALUE, f"{path} must be {err['ctx']['expected']}, got {err['input']!r}"
    if kind in _TYPE_NAMES:
        got = _json_type(err["input"])
        return INVALID_REQUEST, f"{path} must be {_TYPE_NAMES[kind]}, got {got}"
    return INVALID_REQUEST, f"{path}: {err['msg']}"


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # only such lines need the walk below


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a string in ``value`` holds a surrogate that json.loads left unpaired."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


_TYPE_NAMES = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _path(loc: Sequence[int | str], root: str) -> str:
    path = root
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
