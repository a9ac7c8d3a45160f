"""The one request pipeline between a request line and the engine, used by the worker's drain
and by ``boxcar run`` alike: ``prepare`` turns (endpoint, body) into an ``EngineInput`` or a
``PrepareError``, ``add_to_engine`` hands it to the engine (a rerank or score line's input is
``pipeline.scoring``'s), ``response_body`` turns the finished
``RequestOutput`` into an OpenAI response body.

``prepare_fields`` does the same from a stored line's ``EngineFields``
(``openai_format.engine_fields``, validated when the line was stored), so the worker parses no
body; ``prepare`` is ``parse_body`` then ``prepare_fields``, so both give the same input or error.

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

from engine.errors import (
    DimensionsNotSupported,
    EmbeddingInputError,
    InputTooLong,
    LoRAError,
    NotAnEmbeddingModel,
    StructuredOutputError,
)
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.pooling_params import PoolingParams
from engine.protocol import Engine
from engine.sampling_params import SamplingParams, StructuredOutputParams
from openai_format.embeddings import embedding_body
from openai_format.engine_fields import (
    ChatFields,
    EmbeddingArgs,
    EngineFields,
    PromptFields,
    engine_fields,
)
from openai_format.message_object import message_object
from openai_format.parse import (
    BODY_TYPES,
    CONTEXT_LENGTH_EXCEEDED,
    INVALID_REQUEST,
    SERVER_ERROR,
    Body,
    describe_validation_error,
)
from openai_format.reasoning import HarmonyTokens, harmony_tokens, split_harmony
from openai_format.response_object import response_object
from openai_format.responses import (
    ChoiceResult,
    TokenLogprobResult,
    chat_completion_body,
    text_completion_body,
)
from openai_format.sampling import Sampling, SamplingArgs
from openai_format.tools import (
    ToolCallMode,
    harmony_tool_calls,
    template_supports_tools,
    tool_calls_from_text,
)
from openai_format.types import (
    CHAT_URL,
    EMBEDDINGS_URL,
    INVALID_VALUE,
    MESSAGES_URL,
    RERANK_URL,
    RESPONSES_URL,
    SCORE_URL,
)
from pipeline.errors import PrepareError
from pipeline.pooled_input import PooledInput
from pipeline.scoring import ScoreInput, ScoreReadBack, prepare_score

__all__ = ["PrepareError"]  # where its callers have always found it

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
    # A /v1/responses line: the request fields its Response object repeats.
    response_echo: dict[str, Any] | None = None
    # The LoRA adapter the line runs under (its batch's model when that is an adapter).
    lora_name: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt)

    @property
    def encoding_format(self) -> str | None:
        return None

    @property
    def score(self) -> ScoreReadBack | None:
        return None


@dataclass(frozen=True, kw_only=True)
class EmbeddingInput(PooledInput):
    """What the engine gets for one /v1/embeddings line."""

    encoding_format: str = "float"
    score: None = None


def parse_body(endpoint: str, body: dict[str, Any] | Body) -> Body | PrepareError:
    """The typed body (a stored body is validated again into its type)."""
    if not isinstance(body, dict):
        return body
    try:
        return BODY_TYPES[endpoint].model_validate(body)
    except ValidationError as exc:
        code, message = describe_validation_error(exc, root=BODY_TYPES[endpoint].body_name)
        return PrepareError(code, message)


Input = EngineInput | EmbeddingInput | ScoreInput


def prepare(engine: Engine, endpoint: str, body: dict[str, Any] | Body) -> Input | PrepareError:
    """The engine input for one line, or its error. Never raises: whatever goes wrong while
    one line is prepared fails that line (``server_error`` for what no check foresaw)."""
    try:
        return _prepare(engine, endpoint, body)
    except Exception as exc:  # noqa: BLE001 - one line's failure must not escape its line
        log.exception("preparing a request failed")
        return PrepareError(SERVER_ERROR, f"the request could not be prepared: {exc}")


def _prepare(engine: Engine, endpoint: str, body: dict[str, Any] | Body) -> Input | PrepareError:
    request = parse_body(endpoint, body)
    if isinstance(request, PrepareError):
        return request
    return _prepare_fields(engine, engine_fields(request))


def prepare_fields(engine: Engine, fields: EngineFields) -> Input | PrepareError:
    """``prepare`` for a line whose body was validated when it was stored: its
    ``engine_fields`` become the engine input, with no parsing."""
    try:
        return _prepare_fields(engine, fields)
    except Exception as exc:  # noqa: BLE001 - one line's failure must not escape its line
        log.exception("preparing a request failed")
        return PrepareError(SERVER_ERROR, f"the request could not be prepared: {exc}")


def _prepare_fields(engine: Engine, fields: EngineFields) -> Input | PrepareError:
    wrong_kind = _wrong_kind(engine, _line_kind(fields))
    if wrong_kind is not None:
        return wrong_kind
    if "embedding" in fields or "score" in fields:
        lora = fields.get("lora_name")
        if lora is not None:
            what = "an embeddings" if "embedding" in fields else "a rerank or score"
            return PrepareError(INVALID_VALUE, f"body.model: {lora!r} is a LoRA adapter; "
                                f"{what} line runs on a pooling model, with no adapter",
                                "model")
        if "score" in fields:
            return prepare_score(engine, fields["score"])
        return _prepare_embedding(engine, fields["embedding"])
    chat = fields if "messages" in fields else None
    tool_mode = None if chat is None else _tool_call_mode(engine, chat)
    if isinstance(tool_mode, PrepareError):
        return tool_mode
    prompt = _prompt(engine, fields)
    if isinstance(prompt, PrepareError):
        return prompt
    sampling = fields["sampling"]
    too_long = _context_overflow(engine, prompt, sampling["max_tokens"])
    if too_long is not None:
        return PrepareError(CONTEXT_LENGTH_EXCEEDED, too_long)
    vocab = engine.vocab_size
    if max(prompt) >= vocab:
        return PrepareError(INVALID_VALUE, f"body.prompt: token id {max(prompt)} is outside "
                            f"the model's vocabulary (ids 0 to {vocab - 1})", "prompt")
    outside = sorted(int(t) for t, _ in sampling["logit_bias"] or [] if t >= vocab)
    if outside:
        return PrepareError(INVALID_VALUE, f"body.logit_bias: token id {outside[0]} is "
                            f"outside the model's vocabulary (ids 0 to {vocab - 1})",
                            "logit_bias")
    try:
        params = sampling_params(sampling)
    except ValueError as exc:
        return PrepareError(INVALID_VALUE, f"body: {exc}")
    return EngineInput(prompt, params, fields.get("format_field"), tool_mode,
                       None if chat is None else chat.get("response"), fields.get("lora_name"))


def _tool_call_mode(engine: Engine, fields: ChatFields) -> ToolCallMode | PrepareError | None:
    """How the line's tool calls are read back from its output: the model's own syntax for
    "auto" (an error if its chat template writes none), a forced call's JSON otherwise."""
    mode = fields.get("tool_mode")
    if mode is None:
        return None
    if mode == "auto":
        syntax = template_supports_tools(engine.chat_template)
        if syntax is None:
            return PrepareError(
                INVALID_VALUE,
                "body.tool_choice 'auto' (the default when tools are given) needs a model "
                "whose chat template writes tool calls, and this model's does not: set "
                "tool_choice to 'required', {type: 'function', function: {name}} or 'none'",
                "tool_choice")
        return ToolCallMode(syntax)
    return ToolCallMode("forced_name" if mode == "named" else "forced_any", fields["tool_name"])


class _SamplingKwargs(SamplingArgs):
    """``SamplingParams``' keyword arguments: ``Sampling`` with its two JSON-shaped fields in
    the engine's types."""

    logit_bias: dict[int, float] | None
    structured_output: StructuredOutputParams | None


def sampling_params(sampling: Sampling) -> SamplingParams:
    """The engine's ``SamplingParams`` of a line's stored sampling; ValueError: a value the
    engine refuses."""
    bias = sampling["logit_bias"]
    structured = sampling["structured_output"]
    kwargs: _SamplingKwargs = {
        **sampling,
        "logit_bias": None if bias is None else {int(t): float(b) for t, b in bias},
        "structured_output": (None if structured is None
                              else StructuredOutputParams(**structured)),
    }
    return SamplingParams(**kwargs)


# A line's kind, as its engine fields say, and the model kinds that serve it.
GENERATION_LINE, EMBEDDING_LINE, SCORE_LINE = "generation", "embedding", "score"


def _line_kind(fields: EngineFields) -> str:
    if "embedding" in fields:
        return EMBEDDING_LINE
    return SCORE_LINE if "score" in fields else GENERATION_LINE


def _wrong_kind(engine: Engine, line_kind: str) -> PrepareError | None:
    """The line's error when the engine's model is of a kind that cannot serve it: text
    generation lines need a generating model, embeddings lines an embedding model, rerank and
    score lines a cross-encoder or an embedding model."""
    model = engine.model_name
    spec = engine.embedding
    if not engine.is_embedding:
        if line_kind == GENERATION_LINE:
            return None
        url = EMBEDDINGS_URL if line_kind == EMBEDDING_LINE else f"{RERANK_URL} or {SCORE_URL}"
        to = ("an embedding model" if line_kind == EMBEDDING_LINE
              else "a cross-encoder or an embedding model")
        return PrepareError(WRONG_MODEL_KIND, f"model {model} generates text and cannot serve "
                            f"{url}: send this line to {to}", "model")
    if spec is not None and spec.cross_encoder:
        if line_kind == SCORE_LINE:
            return None
        what = EMBEDDINGS_URL if line_kind == EMBEDDING_LINE else "chat or completions"
        return PrepareError(WRONG_MODEL_KIND, f"model {model} is a cross-encoder: it serves "
                            f"{RERANK_URL} and {SCORE_URL} only, not {what}", "model")
    if line_kind != GENERATION_LINE:
        return None
    return PrepareError(WRONG_MODEL_KIND, f"model {model} is an embedding model: it serves "
                        f"{EMBEDDINGS_URL} (and {RERANK_URL}, {SCORE_URL} by cosine), not chat "
                        "or completions", "model")


def _embedding_error(exc: EmbeddingInputError) -> PrepareError:
    if isinstance(exc, DimensionsNotSupported):
        return PrepareError(INVALID_VALUE, f"body.dimensions: {exc}", "dimensions")
    field = "input" if exc.index is None else f"input[{exc.index}]"
    if isinstance(exc, InputTooLong):
        return PrepareError(CONTEXT_LENGTH_EXCEEDED, f"body.{field}: {exc}", "input")
    return PrepareError(INVALID_VALUE, f"body.{field}: {exc}", "input")


def _prepare_embedding(engine: Engine, args: EmbeddingArgs) -> EmbeddingInput | PrepareError:
    """An embeddings line's inputs tokenized and checked against the model (its length limit,
    vocabulary and Matryoshka dimensions) once, by the engine; each problem a line error naming
    the field."""
    try:
        checked = engine.check_embedding(args["input"],
                                         PoolingParams(dimensions=args["dimensions"]))
    except EmbeddingInputError as exc:
        return _embedding_error(exc)
    return EmbeddingInput(inputs=checked, encoding_format=args["encoding_format"])


def add_to_engine(engine: Engine, request_id: str, engine_input: Input, *,
                  priority: int = 0, rank: int = 0,
                  lora_name: str | None = None) -> PrepareError | None:
    """``engine.add_request``; a request the engine refuses (a schema its grammar compiler
    cannot take, an adapter it cannot serve) becomes the line's error. ``lora_name``: the
    line's adapter when it is not in its stored fields (``boxcar run`` reads it off the line)."""
    try:
        engine.add_request(request_id, engine_input.prompt, engine_input.params,
                           priority=priority, rank=rank,
                           lora_name=lora_name or engine_input.lora_name)
    except NotAnEmbeddingModel:
        kind = (EMBEDDING_LINE if isinstance(engine_input, EmbeddingInput) else SCORE_LINE
                if isinstance(engine_input, ScoreInput) else GENERATION_LINE)
        return _wrong_kind(engine, kind) or PrepareError(
            WRONG_MODEL_KIND, f"model {engine.model_name} cannot serve this line", "model")
    except EmbeddingInputError as exc:
        return _embedding_error(exc)
    except StructuredOutputError as exc:
        return PrepareError(INVALID_VALUE, f"{engine_input.format_field or 'body'}: {exc}",
                            engine_input.format_field)
    except LoRAError as exc:  # the adapter the line names as its model cannot be served
        return PrepareError(INVALID_VALUE, str(exc), "model")
    except ValueError as exc:
        return PrepareError(INVALID_VALUE, f"the engine refused the request: {exc}")
    except Exception as exc:  # noqa: BLE001 - e.g. the grammar library failing on one format
        log.exception("adding request %s failed", request_id)
        return PrepareError(SERVER_ERROR, f"the engine could not take the request: {exc}")
    return None


def _prompt(engine: Engine, fields: ChatFields | PromptFields) -> list[int] | PrepareError:
    field = "messages" if "messages" in fields else "prompt"
    try:
        if "messages" in fields:
            prompt_ids = engine.apply_chat_template(fields["messages"], tools=fields["tools"])
        else:
            prompt = fields["prompt"]
            prompt_ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError is no ValueError; a
        # conversation the template rejects is the line's fault, not the worker's.
        return PrepareError(INVALID_REQUEST,
                            f"body.{field} could not be turned into a prompt: "
                            f"{type(exc).__name__}: {exc}", field)
    if not prompt_ids:
        return PrepareError(INVALID_VALUE, "the prompt has no tokens")
    return list(prompt_ids)


def _context_overflow(engine: Engine, prompt: list[int], max_tokens: int | None) -> str | None:
    """Why the prompt, with an explicit max_tokens, cannot fit in the model's context (the
    engine would silently cut the completion short), or None."""
    max_model_len = engine.max_model_len
    if len(prompt) >= max_model_len:
        return (f"the prompt is {len(prompt)} tokens; the model's context is {max_model_len} "
                "tokens, including the completion")
    if max_tokens is None or len(prompt) + max_tokens <= max_model_len:
        return None
    return (f"This model's maximum context length is {max_model_len} tokens, but "
            f"{len(prompt) + max_tokens} were requested ({len(prompt)} in the prompt, "
            f"{max_tokens} in max_tokens); lower max_tokens or shorten the prompt.")


def _logprobs(
    engine: Engine, entries: list[TokenLogprob] | None
) -> list[TokenLogprobResult] | None:
    if entries is None:
        return None
    return [
        TokenLogprobResult(
            token=engine.decode([e.token_id]),
            logprob=e.logprob,
            top=[(engine.decode([tid]), lp) for tid, lp in e.top],
        )
        for e in entries
    ]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def _choice(c: CompletionOutput, engine: Engine, tool_mode: ToolCallMode | None,
            harmony: HarmonyTokens | None = None) -> ChoiceResult:
    text = c.text
    tool_calls: list[dict[str, Any]] = []
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    split = None
    if harmony is not None:
        split = split_harmony(list(c.token_ids), lambda ids: engine.decode(ids, True), harmony)
    if split is not None:  # a harmony chat completion: the final channel is the answer
        text, reasoning, reasoning_tokens = split.content, split.reasoning, split.reasoning_tokens
    if tool_mode is not None and tool_mode.kind == "harmony":
        calls = harmony_tool_calls((call.name, call.arguments) for call in split.tool_calls
                                   ) if split is not None else None
        tool_calls = calls or []
    elif tool_mode is not None and c.finish_reason != "length":
        content, tool_calls = tool_calls_from_text(tool_mode, text)
        text = content or ""
    return ChoiceResult(
        index=c.index, text=text, num_tokens=len(c.token_ids),
        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        logprobs=_logprobs(engine, c.logprobs),
        tool_calls=tool_calls, reasoning=reasoning, reasoning_tokens=reasoning_tokens,
    )


def response_body(
    output: RequestOutput, *, endpoint: str, model: str, engine: Engine, hex_id: str,
    tool_mode: ToolCallMode | None = None, response_echo: dict[str, Any] | None = None,
    encoding_format: str | None = None, score: ScoreReadBack | None = None,
) -> tuple[dict[str, Any], Usage]:
    """The chat.completion, text_completion or response object for a finished request, and
    its usage; ``engine`` decodes logprobs' tokens, ``hex_id`` (random hex) makes the object's
    id. ``response_echo``: a /v1/responses line's ``EngineInput.response_echo``. An embedding
    request's is OpenAI's CreateEmbeddingResponse (``encoding_format`` float or base64), its
    usage the prompt tokens of all its inputs; a rerank or score request's (``score``: its
    ``ScoreInput.score``) is its /v1/rerank or /v1/score body, its usage the same."""
    if output.embeddings is not None and score is not None:
        prompt_tokens = output.metrics.num_prompt_tokens
        body = score.body(output.embeddings, model=model, prompt_tokens=prompt_tokens,
                          hex_id=hex_id, created=int(time.time()))
        return body, Usage(prompt_tokens, 0, 0)
    if output.embeddings is not None:
        prompt_tokens = output.metrics.num_prompt_tokens
        body = embedding_body(output.embeddings, model=model, prompt_tokens=prompt_tokens,
                              encoding_format=encoding_format or "float")
        return body, Usage(prompt_tokens, 0, 0)
    # gpt-oss (harmony): a chat answer splits into the final channel and the reasoning
    harmony = (harmony_tokens(engine.special_token_id)
               if endpoint in (CHAT_URL, RESPONSES_URL, MESSAGES_URL) else None)
    choices = [_choice(c, engine, tool_mode, harmony) for c in output.outputs]
    prompt_tokens = output.metrics.num_prompt_tokens or len(output.prompt_token_ids)
    cached_tokens = output.metrics.num_cached_tokens
    usage = Usage(prompt_tokens, sum(c.num_tokens for c in choices), cached_tokens)
    if endpoint == RESPONSES_URL:
        if response_echo is None:
            raise ValueError("a /v1/responses line reached its output without its echo")
        body = response_object(choices[0], echo=response_echo, model=model,
                               prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                               response_id="resp_" + hex_id, created=int(time.time()))
        return body, usage
    if endpoint == MESSAGES_URL:
        body = message_object(choices[0], model=model, prompt_tokens=prompt_tokens,
                              cached_tokens=cached_tokens, message_id="msg_" + hex_id)
        return body, usage
    build = chat_completion_body if endpoint == CHAT_URL else text_completion_body
    prefix = "chatcmpl-" if endpoint == CHAT_URL else "cmpl-"
    body = build(
        choices, model=model, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
        completion_id=prefix + hex_id, created=int(time.time()),
    )
    return body, usage
