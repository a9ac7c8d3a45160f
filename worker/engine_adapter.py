"""Between request lines and the engine: a stored body becomes a prompt and SamplingParams, a
finished RequestOutput becomes an OpenAI response body."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from openai_format.responses import (
    ChoiceResult,
    TokenLogprobResult,
    chat_completion_body,
    text_completion_body,
)
from openai_format.sampling import to_sampling_kwargs
from openai_format.types import CHAT_URL, ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class EngineInput:
    prompt: str | list[int]
    params: SamplingParams


def to_engine_input(engine: Any, endpoint: str, body: dict[str, Any]) -> EngineInput:
    """The prompt (chat messages rendered by the model's template) and sampling parameters.

    Raises ``ValueError`` when the body cannot run (bad messages for the template, bad values).
    """
    if endpoint == CHAT_URL:
        request: ChatCompletionRequest | CompletionRequest = (
            ChatCompletionRequest.model_validate(body)
        )
        prompt: str | list[int] = engine.apply_chat_template(request.template_messages())
    else:
        request = CompletionRequest.model_validate(body)
        prompt = request.single_prompt
    return EngineInput(prompt, SamplingParams(**to_sampling_kwargs(request)))


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


def response_body(
    output: RequestOutput, *, endpoint: str, model: str, tokenizer: Any, hex_id: str
) -> tuple[dict[str, Any], Usage]:
    """The chat.completion or text_completion object for a finished request, and its usage;
    ``hex_id`` (random hex) makes the object's id."""
    choices = [
        ChoiceResult(
            index=c.index, text=c.text, num_tokens=len(c.token_ids),
            finish_reason=c.finish_reason, logprobs=_logprobs(tokenizer, c.logprobs),
        )
        for c in output.outputs
    ]
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
