"""The engine's sampling fields for a request body: OpenAI's defaults and names mapped to
``SamplingParams``' keyword arguments, as JSON (``Sampling``: this package never imports the
engine; ``pipeline.engine_adapter.sampling_params`` builds the engine's from it)."""

from __future__ import annotations

from typing import Any, TypedDict

from openai_format.responses_request import ResponsesRequest
from openai_format.tools import forced_call
from openai_format.types import ChatCompletionRequest, CompletionRequest

Body = ChatCompletionRequest | CompletionRequest | ResponsesRequest


class SamplingArgs(TypedDict):
    """``SamplingParams``' keyword arguments that JSON holds as the engine takes them (mypy
    checks the names and types against ``SamplingParams`` where the pipeline passes them)."""

    n: int
    temperature: float
    top_p: float
    top_k: int | None
    min_p: float
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: list[str]
    stop_token_ids: list[int]
    max_tokens: int | None  # ``effective_max_tokens``: None runs to the model's context
    min_tokens: int
    ignore_eos: bool
    logprobs: int | None


class Sampling(SamplingArgs):
    """A line's sampling as stored (``engine_fields``' ``sampling``): ``SamplingArgs`` and the
    two fields JSON cannot hold as the engine takes them: ``logit_bias`` as [token id, bias]
    pairs (JSON object keys are strings), ``structured_output`` as ``StructuredOutputParams``'
    fields. Rows keep what an earlier version wrote: a field added here needs a value for
    rows stored without it where it is read."""

    logit_bias: list[list[float]] | None
    structured_output: dict[str, Any] | None


def to_sampling_kwargs(body: Body) -> Sampling:
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
    bias = body.logit_bias_ids()
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
        "logit_bias": None if bias is None else [[t, b] for t, b in bias.items()],
        "structured_output": structured,
    }

