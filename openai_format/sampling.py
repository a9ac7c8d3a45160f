"""The engine's sampling fields for a request body: OpenAI's defaults and names mapped to
``SamplingParams``' keyword arguments (a plain dict: this package never imports the engine)."""

from __future__ import annotations

from typing import Any

from openai_format.tools import forced_call
from openai_format.types import ChatCompletionRequest, CompletionRequest


def to_sampling_kwargs(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The engine's SamplingParams fields for ``body`` (OpenAI defaults: temperature 1, top_p 1).

    ``logprobs`` is the number of alternatives per token: chat's ``top_logprobs`` (0 when only
    ``logprobs: true``), completions' ``logprobs``; None when not asked for.
    ``structured_output`` holds StructuredOutputParams' fields: a JSON response format, or the
    call a ``tool_choice`` forces.
    """
    structured = body.response_format.structured_output() if body.response_format else None
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        forced = forced_call(body)
        if forced is not None:
            structured = {"json_schema": forced[0], "strict": forced[1]}
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
