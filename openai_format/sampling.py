"""The engine's sampling fields for a request body: OpenAI's defaults and names mapped to
``SamplingParams``' keyword arguments (a plain dict: this package never imports the engine)."""

from __future__ import annotations

from typing import Any

from openai_format.embeddings import EmbeddingRequest
from openai_format.responses_request import ResponsesRequest
from openai_format.tools import forced_call
from openai_format.types import ChatCompletionRequest, CompletionRequest

Body = ChatCompletionRequest | CompletionRequest | ResponsesRequest


def to_sampling_kwargs(body: Body) -> dict[str, Any]:
    """The engine's SamplingParams fields for ``body`` (OpenAI defaults: temperature 1, top_p 1).

    ``logprobs`` is the number of alternatives per token: chat's ``top_logprobs`` (0 when only
    ``logprobs: true``), completions' ``logprobs``; None when not asked for.
    ``structured_output`` holds StructuredOutputParams' fields: a JSON response format, or the
    call a ``tool_choice`` forces. A /v1/responses body samples as the chat body it maps to.
    """
    if isinstance(body, ResponsesRequest):
        body = body.as_chat
    structured = body.response_format.structured_output() if body.response_format else None
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        forced = forced_call(body)
        if forced is not None:
            # Compact: a pretty-printing model would spend max_tokens on indentation.
            structured = {"json_schema": forced[0], "strict": forced[1], "compact": True}
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
        "logit_bias": body.logit_bias_ids(),
        "structured_output": structured,
    }


def engine_fields(body: Body | EmbeddingRequest) -> dict[str, Any]:
    """What the engine needs from a validated body, as JSON, stored on the line's row when it
    is validated (upload/prepare, a job's creation) so the drain loop neither parses nor
    validates the body again (``pipeline.engine_adapter.prepare_fields``):

    - ``messages`` and ``tools`` (chat: the chat template's input) or ``prompt`` (completions:
      text or token ids);
    - ``tool_mode`` ("auto", "required", "named" or absent) and ``tool_name`` (a named choice);
    - ``format_field``: the body field a grammar comes from, to name it in an error;
    - ``sampling``: ``to_sampling_kwargs``, its ``logit_bias`` as [token id, bias] pairs (JSON
      object keys are strings);
    - ``response`` (a /v1/responses body only): the request fields its ``Response`` object
      repeats (``ResponsesRequest.echo``). Such a body's other fields are its chat body's, with
      the fields an error names spelled as the Responses API spells them.

    An embeddings body has ``embedding`` instead: its inputs as a list, ``encoding_format`` and
    ``dimensions``.
    """
    if isinstance(body, EmbeddingRequest):
        return {"embedding": {"input": body.inputs(),
                              "encoding_format": body.encoding_format or "float",
                              "dimensions": body.dimensions}}
    if isinstance(body, ResponsesRequest):
        fields = engine_fields(body.as_chat)
        fields["response"] = body.echo()
        if "format_field" in fields:
            fields["format_field"] = ("body.tools[].parameters" if "tool_name" in fields
                                      else "body.text.format.schema")
        return fields
    sampling = to_sampling_kwargs(body)
    bias = sampling["logit_bias"]
    sampling["logit_bias"] = None if bias is None else [[int(t), b] for t, b in bias.items()]
    fields: dict[str, Any] = {"sampling": sampling}
    if body.response_format is not None and body.response_format.type == "json_schema":
        fields["format_field"] = "body.response_format.json_schema.schema"
    if isinstance(body, ChatCompletionRequest):
        fields["messages"] = body.template_messages()
        fields["tools"] = body.template_tools()
        mode = body.tool_mode
        if mode is not None:
            fields["tool_mode"] = mode
        if mode in ("required", "named"):
            fields["tool_name"] = body.forced_tools[0].function.name
            fields["format_field"] = "body.tools[].function.parameters"
    else:
        fields["prompt"] = body.single_prompt
    return fields


def sampling_kwargs(fields: dict[str, Any]) -> dict[str, Any]:
    """``to_sampling_kwargs``' dict back from stored ``engine_fields`` (a copy)."""
    sampling = dict(fields["sampling"])
    bias = sampling.get("logit_bias")
    sampling["logit_bias"] = None if bias is None else {int(t): float(b) for t, b in bias}
    return sampling


# The ``engine_fields`` key naming the LoRA adapter a line runs under: its batch's (or job's)
# model when that is an adapter (docs/lora.md), so the worker needs no batch row to know it.
LORA_FIELD = "lora_name"


def line_engine_fields(body: Any, lora: str | None) -> dict[str, Any]:
    """A stored line's ``engine_fields``: ``engine_fields(body)`` and the adapter, if any."""
    fields = engine_fields(body)
    return fields if lora is None else {**fields, LORA_FIELD: lora}
