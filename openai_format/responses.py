"""Output of an OpenAI Batch: ``chat.completion`` and ``text_completion`` objects from
engine-free results, and the lines of the output and error files."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from openai_format.ids import new_id


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
    # OpenAI ``tool_calls`` read from the text; ``text`` is then the content left (may be "").
    tool_calls: Sequence[dict[str, Any]] = ()
    # A reasoning model's thinking (gpt-oss's analysis channel), kept out of ``text``: the
    # message's ``reasoning_content``; ``reasoning_tokens`` of ``num_tokens`` were spent on it.
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    # The stop string (or stop token id) that ended it, where one did.
    stop_reason: str | int | None = None


def _finish_reason(reason: str | None) -> str:
    # The engine says "stop" (EOS, stop string or stop token) or "length"; anything else
    # (an abort) is reported as a stop, the only other value OpenAI clients accept here.
    return "length" if reason == "length" else "stop"


def _usage(choices: Sequence[ChoiceResult], prompt_tokens: int, cached_tokens: int) -> dict:
    completion_tokens = sum(c.num_tokens for c in choices)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    reasoning = [c.reasoning_tokens for c in choices if c.reasoning_tokens is not None]
    if reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(reasoning)}
    return usage


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


def _chat_choice(c: ChoiceResult) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
    if c.reasoning is not None:
        message["reasoning_content"] = c.reasoning
    finish_reason = _finish_reason(c.finish_reason)
    if c.tool_calls:
        message["content"] = c.text or None
        message["tool_calls"] = list(c.tool_calls)
        finish_reason = "tool_calls"
    return {
        "index": c.index,
        "message": message,
        "logprobs": None if c.logprobs is None else _chat_logprobs(c.logprobs),
        "finish_reason": finish_reason,
    }


def _text_choice(c: ChoiceResult) -> dict[str, Any]:
    return {
        "index": c.index,
        "text": c.text,
        "logprobs": None if c.logprobs is None else _completion_logprobs(c.logprobs),
        "finish_reason": _finish_reason(c.finish_reason),
    }


@dataclass(frozen=True)
class _CompletionKind:
    object_name: str
    id_prefix: str
    render_choice: Callable[[ChoiceResult], dict[str, Any]]


def _completion_body(
    kind: _CompletionKind,
    choices: Sequence[ChoiceResult],
    *,
    model: str,
    prompt_tokens: int,
    cached_tokens: int = 0,
    completion_id: str | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """A completion object of ``kind``: the envelope both kinds share around their choices."""
    return {
        "id": completion_id or f"{kind.id_prefix}-{new_id()}",
        "object": kind.object_name,
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [kind.render_choice(c) for c in choices],
        "usage": _usage(choices, prompt_tokens, cached_tokens),
        "system_fingerprint": None,
    }


# A ``chat.completion`` object, as OpenAI's /v1/chat/completions returns it.
chat_completion_body = partial(
    _completion_body, _CompletionKind("chat.completion", "chatcmpl", _chat_choice))
# A ``text_completion`` object, as OpenAI's /v1/completions returns it.
text_completion_body = partial(
    _completion_body, _CompletionKind("text_completion", "cmpl", _text_choice))


def output_line(custom_id: str, body: dict[str, Any], *, request_id: str) -> dict[str, Any]:
    """A successful line of a batch output file."""
    return {
        "id": f"batch_req_{new_id()}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def output_line_json(custom_id: str, body_json: str, *, request_id: str) -> str | None:
    """``json.dumps(output_line(custom_id, body, request_id=...), ensure_ascii=False)`` where
    ``body_json`` is ``json.dumps(body)`` (how a response is stored), without decoding and
    encoding the body again; None when the stored text holds a ``\\u`` escape (non-ASCII text
    that the output file writes unescaped): decode it then."""
    if "\\u" in body_json:
        return None
    dump = json.dumps
    return (f'{{"id": "batch_req_{new_id()}", "custom_id": {dump(custom_id, ensure_ascii=False)}, '
            f'"response": {{"status_code": 200, "request_id": '
            f'{dump(request_id, ensure_ascii=False)}, "body": {body_json}}}, "error": null}}')


def failed_line(
    custom_id: str, code: str, message: str, *, request_id: str, param: str | None = None,
    status_code: int = 400,
) -> dict[str, Any]:
    """A request that was refused or failed, as OpenAI writes it in the error file: the HTTP
    error the request would have got, inside ``response``."""
    kind = "server_error" if status_code >= 500 else "invalid_request_error"
    return {
        "id": f"batch_req_{new_id()}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id,
                     "body": {"error": {"message": message, "type": kind, "param": param,
                                        "code": code}}},
        "error": None,
    }


def error_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line that never ran (``batch_expired``, ``batch_cancelled``): no response."""
    return {
        "id": f"batch_req_{new_id()}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
