"""The OpenAI Batch file format: parse and check input lines, map them to sampling fields,
build output and error lines. Pure and engine-free, shared by ``boxcar run`` and the service.

Input line: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}``. ``parse_line`` never raises on user input: it returns a ``BatchLine`` or a
``LineError`` whose message names the line and the field ("line 7: body.temperature must be
between 0 and 2").
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from openai_format.types import (
    CHAT_URL,
    COMPLETIONS_URL,
    ENDPOINTS,
    INVALID_TYPE,
    INVALID_VALUE,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    TextPart,
)

__all__ = [
    "CHAT_URL",
    "COMPLETIONS_URL",
    "ENDPOINTS",
    "BatchLine",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChoiceResult",
    "CompletionRequest",
    "CustomIdTracker",
    "LineError",
    "SamplingFields",
    "TextPart",
    "TokenLogprobResult",
    "chat_completion_body",
    "error_line",
    "new_request_id",
    "output_line",
    "parse_line",
    "text_completion_body",
    "to_sampling_kwargs",
]

# Line error codes.
INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
MISSING_CUSTOM_ID = "missing_custom_id"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
INVALID_METHOD = "invalid_method"
INVALID_URL = "invalid_url"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
SERVER_ERROR = "server_error"


@dataclass(frozen=True)
class BatchLine:
    """One valid input line."""

    custom_id: str
    url: str
    body: ChatCompletionRequest | CompletionRequest
    line_no: int

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL


@dataclass(frozen=True)
class LineError:
    """Why one input line cannot run. ``message`` starts with ``line N:``."""

    code: str
    message: str
    line_no: int
    custom_id: str | None = None

    def to_line(self) -> dict[str, Any]:
        return error_line(self.custom_id, self.code, self.message)


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
            return LineError(
                DUPLICATE_CUSTOM_ID,
                f"line {line_no}: custom_id {custom_id!r} is used by an earlier line",
                line_no,
                custom_id,
            )
        self._seen.add(custom_id)
        return None


def parse_line(
    raw: str | bytes, *, line_no: int, endpoint: str | None = None
) -> BatchLine | LineError:
    """Parse and check one input line; ``endpoint``, when given, is the batch's only URL."""

    def error(code: str, what: str, custom_id: str | None = None) -> LineError:
        return LineError(code, f"line {line_no}: {what}", line_no, custom_id)

    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return error(INVALID_JSON, f"not valid UTF-8 (byte {exc.start})")
    if not raw.strip():
        return error(INVALID_JSON, "empty line")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return error(INVALID_JSON, f"not valid JSON: {exc.msg} (column {exc.colno})")
    except RecursionError:
        return error(INVALID_JSON, "not valid JSON: nested too deeply")
    if not isinstance(data, dict):
        return error(INVALID_REQUEST, f"expected a JSON object, got {_json_type(data)}")

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
            INVALID_URL, f"url must be {CHAT_URL!r} or {COMPLETIONS_URL!r}, got {url!r}", custom_id
        )
    if endpoint is not None and url != endpoint:
        return error(
            INVALID_URL, f"url {url!r} does not match the batch's endpoint {endpoint!r}", custom_id
        )
    body = data.get("body")
    if not isinstance(body, dict):
        what = "is missing" if body is None else f"must be an object, got {_json_type(body)}"
        return error(INVALID_REQUEST, f"body {what}", custom_id)

    model = ChatCompletionRequest if url == CHAT_URL else CompletionRequest
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        code, what = _describe(exc)
        return error(code, what, custom_id)
    return BatchLine(custom_id, url, parsed, line_no)


def _describe(exc: ValidationError) -> tuple[str, str]:
    """The first pydantic error as (code, "body.field must be ...")."""
    err = exc.errors(include_url=False)[0]
    path = _path(err["loc"])
    kind = err["type"]
    if kind == INVALID_VALUE:
        # Model-level checks already name their fields.
        return INVALID_VALUE, err["msg"] if path == "body" else f"{path} {err['msg']}"
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


def _path(loc: Sequence[int | str]) -> str:
    path = "body"
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


def to_sampling_kwargs(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The engine's SamplingParams fields for ``body`` (OpenAI defaults: temperature 1, top_p 1).

    ``logprobs`` is the number of alternatives per token: chat's ``top_logprobs`` (0 when only
    ``logprobs: true``), completions' ``logprobs``; None when not asked for.
    """
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    return {
        "n": body.n or 1,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k if body.top_k is not None and body.top_k >= 1 else None,
        "min_p": body.min_p or 0.0,
        "seed": body.seed,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": (
            1.0 if body.repetition_penalty is None else body.repetition_penalty
        ),
        "stop": body.stop_list(),
        "stop_token_ids": list(body.stop_token_ids or []),
        "max_tokens": body.effective_max_tokens,
        "min_tokens": body.min_tokens or 0,
        "ignore_eos": bool(body.ignore_eos),
        "logprobs": logprobs,
    }


# ---------------------------------------------------------------------------------------------
# Output


@dataclass(frozen=True)
class TokenLogprobResult:
    """One generated token's text, log-probability and best alternatives (text, logprob)."""

    token: str
    logprob: float
    top: Sequence[tuple[str, float]] = ()
    # The token's raw bytes when they are not valid UTF-8 on their own (part of a character).
    token_bytes: bytes | None = None


@dataclass(frozen=True)
class ChoiceResult:
    """One generated sequence, engine-free: what the builders below need."""

    index: int
    text: str
    num_tokens: int
    finish_reason: str | None
    logprobs: Sequence[TokenLogprobResult] | None = None


def new_request_id() -> str:
    return uuid.uuid4().hex


def _finish_reason(reason: str | None) -> str:
    # The engine says "stop" (EOS, stop string or stop token) or "length"; anything else
    # (an abort) is reported as a stop, the only other value OpenAI clients accept here.
    return "length" if reason == "length" else "stop"


def _usage(choices: Sequence[ChoiceResult], prompt_tokens: int, cached_tokens: int) -> dict:
    completion_tokens = sum(c.num_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _bytes(entry: TokenLogprobResult | tuple[str, float]) -> list[int]:
    if isinstance(entry, TokenLogprobResult):
        raw = entry.token_bytes if entry.token_bytes is not None else entry.token.encode()
        return list(raw)
    return list(entry[0].encode())


def _chat_logprobs(entries: Sequence[TokenLogprobResult]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _bytes(e),
                "top_logprobs": [
                    {"token": text, "logprob": lp, "bytes": _bytes((text, lp))}
                    for text, lp in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def _completion_logprobs(entries: Sequence[TokenLogprobResult]) -> dict[str, Any]:
    offsets, offset = [], 0
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    top = []
    for e in entries:
        # Legacy completions list the alternatives and the chosen token together.
        alternatives = dict(e.top)
        alternatives.setdefault(e.token, e.logprob)
        top.append(alternatives)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _completion_object(
    object_name: str, id_prefix: str, choices: list[dict[str, Any]],
    source: Sequence[ChoiceResult], *, model: str, prompt_tokens: int, cached_tokens: int,
    completion_id: str | None, created: int | None,
) -> dict[str, Any]:
    """The envelope both completion objects share around their ``choices``."""
    return {
        "id": completion_id or f"{id_prefix}-{new_request_id()}",
        "object": object_name,
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": _usage(source, prompt_tokens, cached_tokens),
        "system_fingerprint": None,
    }


def chat_completion_body(
    choices: Sequence[ChoiceResult],
    *,
    model: str,
    prompt_tokens: int,
    cached_tokens: int = 0,
    completion_id: str | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` object, as OpenAI's /v1/chat/completions returns it."""
    rendered = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text, "refusal": None},
            "logprobs": None if c.logprobs is None else _chat_logprobs(c.logprobs),
            "finish_reason": _finish_reason(c.finish_reason),
        }
        for c in choices
    ]
    return _completion_object("chat.completion", "chatcmpl", rendered, choices, model=model,
                              prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                              completion_id=completion_id, created=created)


def text_completion_body(
    choices: Sequence[ChoiceResult],
    *,
    model: str,
    prompt_tokens: int,
    cached_tokens: int = 0,
    completion_id: str | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """A ``text_completion`` object, as OpenAI's /v1/completions returns it."""
    rendered = [
        {
            "index": c.index,
            "text": c.text,
            "logprobs": None if c.logprobs is None else _completion_logprobs(c.logprobs),
            "finish_reason": _finish_reason(c.finish_reason),
        }
        for c in choices
    ]
    return _completion_object("text_completion", "cmpl", rendered, choices, model=model,
                              prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                              completion_id=completion_id, created=created)


def output_line(custom_id: str, body: dict[str, Any], *, request_id: str) -> dict[str, Any]:
    """A successful line of a batch output file."""
    return {
        "id": f"batch_req_{new_request_id()}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """A failed line of a batch error file (``custom_id`` is None when the line had none)."""
    return {
        "id": f"batch_req_{new_request_id()}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
