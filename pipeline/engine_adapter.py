"""The one request pipeline between a request line and the engine, used by the worker's drain
and by ``boxcar run`` alike: ``prepare`` turns (endpoint, body) into an ``EngineInput`` or a
``PrepareError``, ``add_to_engine`` hands it to the engine, ``response_body`` turns the finished
``RequestOutput`` into an OpenAI response body.

``prepare_fields`` does the same from a stored line's ``engine_fields``
(``openai_format.sampling``, validated when the line was stored), so the worker parses no body;
``prepare`` is ``parse_body`` then ``prepare_fields``, so both give the same input or error.

Neither raises on a line's content: a template that rejects the conversation (jinja's
``raise_exception``), a prompt longer than the context, a token id outside the vocabulary, a
schema the grammar compiler refuses, each becomes that line's error, with the same code and
message on both paths.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engine.embedding_inputs import (
    EmbeddingInputError,
    InputTooLong,
    NotAnEmbeddingModel,
    check_dimensions,
    encode_inputs,
)
from engine.outputs import RequestOutput, TokenLogprob
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams, StructuredOutputParams
from engine.structured_output import StructuredOutputError
from openai_format.embeddings import embedding_body
from openai_format.parse import (
    BODY_TYPES,
    CONTEXT_LENGTH_EXCEEDED,
    INVALID_REQUEST,
    SERVER_ERROR,
    Body,
    describe_validation_error,
)
from openai_format.responses import (
    ChoiceResult,
    TokenLogprobResult,
    chat_completion_body,
    text_completion_body,
)
from openai_format.sampling import engine_fields, sampling_kwargs
from openai_format.tools import ToolCallMode, template_supports_tools, tool_calls_from_text
from openai_format.types import CHAT_URL, EMBEDDINGS_URL, INVALID_VALUE

# A line error code of its own, as the model routing's: the line met a model of the other kind.
WRONG_MODEL_KIND = "wrong_model_kind"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineInput:
    """What the engine gets for one line, and how its output is read back."""

    prompt: list[int]
    params: SamplingParams
    # The body field a grammar came from, to name it when the engine cannot compile it.
    format_field: str | None = None
    tool_mode: ToolCallMode | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt)

    @property
    def encoding_format(self) -> str | None:
        return None


@dataclass(frozen=True)
class EmbeddingInput:
    """What the engine gets for one /v1/embeddings line: its inputs' token ids."""

    token_ids: list[list[int]]
    params: PoolingParams
    encoding_format: str = "float"
    tool_mode: None = None

    @property
    def prompt(self) -> list[list[int]]:
        return self.token_ids

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


@dataclass(frozen=True)
class PrepareError:
    """Why a line cannot run: a line error code, a message naming the field, the field."""

    code: str
    message: str
    param: str | None = None


def parse_body(endpoint: str, body: dict[str, Any] | Body) -> Body | PrepareError:
    """The typed body (a stored body is validated again into its type)."""
    if not isinstance(body, dict):
        return body
    try:
        return BODY_TYPES[endpoint].model_validate(body)
    except ValidationError as exc:
        code, message = describe_validation_error(exc)
        return PrepareError(code, message)


Input = EngineInput | EmbeddingInput


def prepare(engine: Any, endpoint: str, body: dict[str, Any] | Body) -> Input | PrepareError:
    """The engine input for one line, or its error. Never raises: whatever goes wrong while
    one line is prepared fails that line (``server_error`` for what no check foresaw)."""
    try:
        return _prepare(engine, endpoint, body)
    except Exception as exc:  # noqa: BLE001 - one line's failure must not escape its line
        log.exception("preparing a request failed")
        return PrepareError(SERVER_ERROR, f"the request could not be prepared: {exc}")


def _prepare(engine: Any, endpoint: str, body: dict[str, Any] | Body) -> Input | PrepareError:
    request = parse_body(endpoint, body)
    if isinstance(request, PrepareError):
        return request
    return _prepare_fields(engine, engine_fields(request))


def prepare_fields(engine: Any, fields: dict[str, Any]) -> Input | PrepareError:
    """``prepare`` for a line whose body was validated when it was stored: its
    ``engine_fields`` (``openai_format.sampling``) become the engine input, with no parsing."""
    try:
        return _prepare_fields(engine, fields)
    except Exception as exc:  # noqa: BLE001 - one line's failure must not escape its line
        log.exception("preparing a request failed")
        return PrepareError(SERVER_ERROR, f"the request could not be prepared: {exc}")


def _prepare_fields(engine: Any, fields: dict[str, Any]) -> Input | PrepareError:
    embedding = fields.get("embedding")
    if bool(getattr(engine, "is_embedding", False)) != (embedding is not None):
        return _wrong_kind(engine, embedding is not None)
    if embedding is not None:
        return _prepare_embedding(engine, embedding)
    tool_mode: ToolCallMode | None = None
    format_field = fields.get("format_field")
    mode = fields.get("tool_mode")
    if mode == "auto":
        syntax = template_supports_tools(getattr(engine.tokenizer, "chat_template", None))
        if syntax is None:
            return PrepareError(
                INVALID_VALUE,
                "body.tool_choice 'auto' (the default when tools are given) needs a model "
                "whose chat template writes tool calls, and this model's does not: set "
                "tool_choice to 'required', {type: 'function', function: {name}} or 'none'",
                "tool_choice")
        tool_mode = ToolCallMode(syntax)
    elif mode is not None:
        tool_mode = ToolCallMode("forced_name" if mode == "named" else "forced_any",
                                 fields["tool_name"])
    prompt = _prompt(engine, fields)
    if isinstance(prompt, PrepareError):
        return prompt
    kwargs = sampling_kwargs(fields)
    too_long = _context_overflow(engine, prompt, kwargs["max_tokens"])
    if too_long is not None:
        return PrepareError(CONTEXT_LENGTH_EXCEEDED, too_long)
    vocab = _vocab_size(engine)
    if vocab is not None:
        if max(prompt) >= vocab:
            return PrepareError(INVALID_VALUE, f"body.prompt: token id {max(prompt)} is outside "
                                f"the model's vocabulary (ids 0 to {vocab - 1})", "prompt")
        outside = sorted(t for t in kwargs["logit_bias"] or {} if t >= vocab)
        if outside:
            return PrepareError(INVALID_VALUE, f"body.logit_bias: token id {outside[0]} is "
                                f"outside the model's vocabulary (ids 0 to {vocab - 1})",
                                "logit_bias")
    try:
        structured = kwargs.pop("structured_output")
        params = SamplingParams(
            **kwargs,
            structured_output=None if structured is None else StructuredOutputParams(**structured),
        )
    except ValueError as exc:
        return PrepareError(INVALID_VALUE, f"body: {exc}")
    return EngineInput(prompt, params, format_field, tool_mode)


def _wrong_kind(engine: Any, wants_embedding: bool) -> PrepareError:
    model = getattr(engine, "model_name", "the served model")
    if wants_embedding:
        return PrepareError(WRONG_MODEL_KIND, f"model {model} generates text and cannot serve "
                            f"{EMBEDDINGS_URL}: send this line to an embedding model", "model")
    return PrepareError(WRONG_MODEL_KIND, f"model {model} is an embedding model: it serves "
                        f"{EMBEDDINGS_URL} only, not chat or completions", "model")


def _embedding_error(exc: EmbeddingInputError) -> PrepareError:
    field = "input" if exc.index is None else f"input[{exc.index}]"
    if isinstance(exc, InputTooLong):
        return PrepareError(CONTEXT_LENGTH_EXCEEDED, f"body.{field}: {exc}", "input")
    return PrepareError(INVALID_VALUE, f"body.{field}: {exc}", "input")


def _prepare_embedding(engine: Any, fields: dict[str, Any]) -> EmbeddingInput | PrepareError:
    """An embeddings line's inputs tokenized and checked against the model (its length limit,
    vocabulary and Matryoshka dimensions), each problem a line error naming the field."""
    dimensions = fields.get("dimensions")
    try:
        check_dimensions(engine, dimensions)
    except EmbeddingInputError as exc:
        return PrepareError(INVALID_VALUE, f"body.dimensions: {exc}", "dimensions")
    try:
        token_ids = encode_inputs(engine, fields["input"])
    except EmbeddingInputError as exc:
        return _embedding_error(exc)
    return EmbeddingInput(token_ids, PoolingParams(dimensions=dimensions),
                          fields.get("encoding_format") or "float")


def add_to_engine(engine: Any, request_id: str, engine_input: Input,
                  **kwargs: Any) -> PrepareError | None:
    """``engine.add_request``; a request the engine refuses (a schema its grammar compiler
    cannot take) becomes the line's error."""
    try:
        engine.add_request(request_id, engine_input.prompt, engine_input.params, **kwargs)
    except NotAnEmbeddingModel:
        return _wrong_kind(engine, isinstance(engine_input, EmbeddingInput))
    except EmbeddingInputError as exc:
        return _embedding_error(exc)
    except StructuredOutputError as exc:
        return PrepareError(INVALID_VALUE, f"{engine_input.format_field or 'body'}: {exc}",
                            engine_input.format_field)
    except ValueError as exc:
        return PrepareError(INVALID_VALUE, f"the engine refused the request: {exc}")
    except Exception as exc:  # noqa: BLE001 - e.g. the grammar library failing on one format
        log.exception("adding request %s failed", request_id)
        return PrepareError(SERVER_ERROR, f"the engine could not take the request: {exc}")
    return None


def _prompt(engine: Any, fields: dict[str, Any]) -> list[int] | PrepareError:
    chat = "messages" in fields
    try:
        if chat:
            tools = fields.get("tools")
            if tools is None:
                prompt_ids = engine.apply_chat_template(fields["messages"])
            else:
                prompt_ids = engine.apply_chat_template(fields["messages"], tools=tools)
        else:
            prompt = fields["prompt"]
            prompt_ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError is no ValueError; a
        # conversation the template rejects is the line's fault, not the worker's.
        field = "messages" if chat else "prompt"
        return PrepareError(INVALID_REQUEST,
                            f"body.{field} could not be turned into a prompt: "
                            f"{type(exc).__name__}: {exc}", field)
    if not prompt_ids:
        return PrepareError(INVALID_VALUE, "the prompt has no tokens")
    return list(prompt_ids)


def _vocab_size(engine: Any) -> int | None:
    runner = getattr(engine, "model_runner", None)
    vocab = getattr(runner, "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def _context_overflow(engine: Any, prompt: list[int], max_tokens: int | None) -> str | None:
    """Why the prompt, with an explicit max_tokens, cannot fit in the model's context (the
    engine would silently cut the completion short), or None."""
    max_model_len = getattr(engine, "max_model_len", None)
    if not isinstance(max_model_len, int):
        return None
    if len(prompt) >= max_model_len:
        return (f"the prompt is {len(prompt)} tokens; the model's context is {max_model_len} "
                "tokens, including the completion")
    if max_tokens is None or len(prompt) + max_tokens <= max_model_len:
        return None
    return (f"This model's maximum context length is {max_model_len} tokens, but "
            f"{len(prompt) + max_tokens} were requested ({len(prompt)} in the prompt, "
            f"{max_tokens} in max_tokens); lower max_tokens or shorten the prompt.")


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _logprobs(
    tokenizer: Any, entries: list[TokenLogprob] | None
) -> list[TokenLogprobResult] | None:
    if entries is None:
        return None
    return [
        TokenLogprobResult(
            token=_token_text(tokenizer, e.token_id),
            logprob=e.logprob,
            top=[(_token_text(tokenizer, tid), lp) for tid, lp in e.top],
        )
        for e in entries
    ]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def _choice(c: Any, tokenizer: Any, tool_mode: ToolCallMode | None) -> ChoiceResult:
    text, tool_calls = c.text, []
    if tool_mode is not None and c.finish_reason != "length":
        content, tool_calls = tool_calls_from_text(tool_mode, c.text)
        text = content or ""
    return ChoiceResult(
        index=c.index, text=text, num_tokens=len(c.token_ids),
        finish_reason=c.finish_reason, logprobs=_logprobs(tokenizer, c.logprobs),
        tool_calls=tool_calls,
    )


def response_body(
    output: RequestOutput, *, endpoint: str, model: str, tokenizer: Any, hex_id: str,
    tool_mode: ToolCallMode | None = None, encoding_format: str | None = None,
) -> tuple[dict[str, Any], Usage]:
    """The chat.completion or text_completion object for a finished request, and its usage;
    ``hex_id`` (random hex) makes the object's id. An embedding request's is OpenAI's
    CreateEmbeddingResponse (``encoding_format`` float or base64), its usage the prompt tokens
    of all its inputs."""
    if output.embeddings is not None:
        prompt_tokens = output.metrics.num_prompt_tokens
        body = embedding_body(output.embeddings, model=model, prompt_tokens=prompt_tokens,
                              encoding_format=encoding_format or "float")
        return body, Usage(prompt_tokens, 0, 0)
    choices = [_choice(c, tokenizer, tool_mode) for c in output.outputs]
    prompt_tokens = output.metrics.num_prompt_tokens or len(output.prompt_token_ids)
    cached_tokens = output.metrics.num_cached_tokens
    build = chat_completion_body if endpoint == CHAT_URL else text_completion_body
    prefix = "chatcmpl-" if endpoint == CHAT_URL else "cmpl-"
    body = build(
        choices, model=model, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
        completion_id=prefix + hex_id, created=int(time.time()),
    )
    usage = Usage(prompt_tokens, sum(c.num_tokens for c in choices), cached_tokens)
    return body, usage
