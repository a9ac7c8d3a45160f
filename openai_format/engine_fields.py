"""A line's engine fields: what the engine needs from a validated body, as the JSON stored on
the line's row (``request_lines.engine_fields``), so the drain loop neither parses nor validates
the body again.

``engine_fields`` writes them where a line is validated (a batch's prepare, a job's creation;
``pipeline.engine_adapter.prepare`` in memory, for ``boxcar run``);
``pipeline.engine_adapter.prepare_fields`` turns them into the engine's input, and the worker's
forecast reads from them the output budget the engine gets (``max_output_tokens``). Both ends
name one type, ``EngineFields``, so mypy checks the keys the writer sets and the readers read.

A line's kind is its shape, decided once, here, from its body's type (its endpoint's, at parse):
``ChatFields`` (/v1/chat/completions, and /v1/responses and /v1/messages as the chat bodies they
run as),
``PromptFields`` (/v1/completions), ``EmbeddingFields`` (/v1/embeddings) or ``ScoreFields``
(/v1/rerank, /v1/score). Readers tell them apart by the key only that kind has (``"embedding" in
fields``, ``"score" in fields``, ``"messages" in fields``), which mypy narrows: the types are
final.

Rows outlive the code that wrote them: these are the keys, with the meanings, every version
since 0005_scale has written (rows from before it have none: the drain parses their body). A
key added later must be ``NotRequired``, read with its default, so older rows stay readable.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict, final

from openai_format.embeddings import EmbeddingRequest
from openai_format.messages_request import MessagesRequest
from openai_format.parse import Body
from openai_format.responses_request import ResponsesRequest
from openai_format.sampling import Sampling, to_sampling_kwargs
from openai_format.scoring import RerankRequest, ScoreKind, ScoreRequest
from openai_format.types import ChatCompletionRequest, CompletionRequest, ToolMode


class EmbeddingArgs(TypedDict):
    """An embeddings line's inputs as a list (``EmbeddingRequest.inputs``), its encoding and
    its Matryoshka ``dimensions`` (checked against the model when the line meets it)."""

    input: list[str | list[int]]
    encoding_format: Literal["float", "base64"]
    dimensions: int | None


class _LineFields(TypedDict):
    # The LoRA adapter the line runs under: its batch's (or job's) model when that is an
    # adapter (docs/lora.md), so the worker needs no batch row to know it.
    lora_name: NotRequired[str]


class _GenerationFields(_LineFields):
    sampling: Sampling
    # The body field a grammar comes from, to name it when the engine cannot compile it.
    format_field: NotRequired[str]


@final
class ChatFields(_GenerationFields):
    """A chat line: the chat template's input (``messages``, ``tools``: None when the template
    gets none), how its tools are used (``tool_mode``; absent: no tools in use), the function a
    forced call names (``tool_name``: the named one, or the first for "required") and, for a
    /v1/responses line, the request fields its ``Response`` object repeats (``response``,
    ``ResponsesRequest.echo``)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_mode: NotRequired[ToolMode]
    tool_name: NotRequired[str]
    response: NotRequired[dict[str, Any]]


@final
class PromptFields(_GenerationFields):
    """A /v1/completions line: its one prompt, text or token ids."""

    prompt: str | list[int]


@final
class EmbeddingFields(_LineFields):
    """A /v1/embeddings line."""

    embedding: EmbeddingArgs


class ScoreArgs(TypedDict):
    """A rerank or score line's pairs: ``text_1`` (a rerank's one query, or a score's texts:
    one, paired with every ``text_2``, or one per ``text_2``) and ``text_2`` (the documents);
    a rerank's ``top_n`` (None: every document) and whether its results repeat the documents."""

    kind: ScoreKind
    text_1: list[str]
    text_2: list[str]
    top_n: int | None
    return_documents: bool


@final
class ScoreFields(_LineFields):
    """A /v1/rerank or /v1/score line."""

    score: ScoreArgs


PoolingFields = EmbeddingFields | ScoreFields
EngineFields = ChatFields | PromptFields | EmbeddingFields | ScoreFields

# The fields a grammar comes from, as the body spells them (an engine error names them).
_SCHEMA_FIELD = "body.response_format.json_schema.schema"
_TOOL_FIELD = "body.tools[].function.parameters"
_RESPONSES_SCHEMA_FIELD = "body.text.format.schema"
_RESPONSES_TOOL_FIELD = "body.tools[].parameters"
_MESSAGES_TOOL_FIELD = "params.tools[].input_schema"


def engine_fields(body: Body, *, lora: str | None = None) -> EngineFields:
    """What the engine needs from a validated body (``lora``: the adapter the line runs
    under). A /v1/responses body's fields are its chat body's, with its echo and with the
    fields an error names spelled as the Responses API spells them."""
    fields = _fields(body)
    if lora is not None:
        fields["lora_name"] = lora
    return fields


def _fields(body: Body) -> EngineFields:
    if isinstance(body, RerankRequest):
        return {"score": {"kind": "rerank", "text_1": [body.query], "text_2": body.texts(),
                          "top_n": body.top_n,
                          "return_documents": body.return_documents is not False}}
    if isinstance(body, ScoreRequest):
        return {"score": {"kind": "score", "text_1": body.texts_1(), "text_2": body.texts_2(),
                          "top_n": None, "return_documents": False}}
    if isinstance(body, EmbeddingRequest):
        return {"embedding": {"input": body.inputs(),
                              "encoding_format": body.encoding_format or "float",
                              "dimensions": body.dimensions}}
    if isinstance(body, ResponsesRequest):
        chat = _chat_fields(body.as_chat)
        chat["response"] = body.echo()
        if "format_field" in chat:
            chat["format_field"] = (_RESPONSES_TOOL_FIELD if "tool_name" in chat
                                    else _RESPONSES_SCHEMA_FIELD)
        return chat
    if isinstance(body, MessagesRequest):
        chat = _chat_fields(body.as_chat)
        if "format_field" in chat:  # only a forced tool makes a grammar
            chat["format_field"] = _MESSAGES_TOOL_FIELD
        return chat
    if isinstance(body, ChatCompletionRequest):
        return _chat_fields(body)
    fields: PromptFields = {"sampling": to_sampling_kwargs(body), "prompt": body.single_prompt}
    if _has_schema(body):
        fields["format_field"] = _SCHEMA_FIELD
    return fields


def _chat_fields(body: ChatCompletionRequest) -> ChatFields:
    fields: ChatFields = {"sampling": to_sampling_kwargs(body),
                          "messages": body.template_messages(), "tools": body.template_tools()}
    if _has_schema(body):
        fields["format_field"] = _SCHEMA_FIELD
    mode = body.tool_mode
    if mode is not None:
        fields["tool_mode"] = mode
    if mode == "required" or mode == "named":
        fields["tool_name"] = body.forced_tools[0].function.name
        fields["format_field"] = _TOOL_FIELD
    return fields


def _has_schema(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return body.response_format is not None and body.response_format.type == "json_schema"


def max_output_tokens(fields: EngineFields) -> int | None:
    """The most tokens the engine generates for the line, the number it gets: its sampling's
    ``max_tokens``, the body's ``effective_max_tokens`` (``max_completion_tokens``, else
    ``max_tokens``; /v1/completions' default 16; None: up to the model's context); 0 for an
    embeddings, rerank or score line."""
    if "embedding" in fields or "score" in fields:
        return 0
    return fields["sampling"]["max_tokens"]


def ignores_eos(fields: EngineFields) -> bool:
    """Whether the line generates exactly ``max_output_tokens`` (``ignore_eos``)."""
    if "embedding" in fields or "score" in fields:
        return False
    return fields["sampling"]["ignore_eos"]
