"""Pydantic models of a batch line's request body (/v1/chat/completions, /v1/completions).

Types are strict (``"0.7"`` is not a number, ``1`` is not a boolean); unknown fields are ignored,
as OpenAI does. Range errors are raised as ``invalid_value`` custom errors with a short
"must be ..." message that ``openai_format.parse`` prefixes with the field's path; type errors keep
pydantic's types and are reported as ``invalid_request``. Fields we know but cannot honour
(``stream: true``, ``echo: true``, ``suffix``, non-text content parts, JSON response formats)
are rejected rather than silently ignored.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)

# Error types raised by the validators below; openai_format.parse maps them to line error codes.
INVALID_VALUE = "invalid_value"
INVALID_TYPE = "invalid_type"

MAX_LOGPROBS = 20
MAX_N = 128


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError(INVALID_VALUE, message)


def _between(lo: float, hi: float, *, lo_open: bool = False) -> AfterValidator:
    """Inclusive range check (exclusive at ``lo`` when ``lo_open``); NaN and inf fail it."""

    def check(value: float) -> float:
        ok = math.isfinite(value) and (lo < value if lo_open else lo <= value) and value <= hi
        if not ok:
            lo_text = f"greater than {lo:g} and at most" if lo_open else f"between {lo:g} and"
            raise _invalid(f"must be {lo_text} {hi:g}")
        return value

    return AfterValidator(check)


def _at_least(lo: int) -> AfterValidator:
    def check(value: int) -> int:
        if value < lo:
            raise _invalid(f"must be an integer >= {lo}")
        return value

    return AfterValidator(check)


def _one_of_shapes(description: str) -> WrapValidator:
    """Collapse a union's per-member errors into one message naming the accepted shapes."""

    def wrap(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise PydanticCustomError(INVALID_TYPE, f"must be {description}") from exc

    return WrapValidator(wrap)


Temperature = Annotated[float, _between(0, 2)]
Probability = Annotated[float, _between(0, 1)]
TopP = Annotated[float, _between(0, 1, lo_open=True)]
Penalty = Annotated[float, _between(-2, 2)]
RepetitionPenalty = Annotated[float, _between(0, 10, lo_open=True)]
PositiveInt = Annotated[int, _at_least(1)]
NonNegativeInt = Annotated[int, _at_least(0)]
NumChoices = Annotated[int, _between(1, MAX_N)]
LogprobCount = Annotated[int, _between(0, MAX_LOGPROBS)]
Stop = Annotated[str | list[str] | None, _one_of_shapes("a string or a list of strings")]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class SamplingFields(_Strict):
    """Sampling fields both endpoints share, plus vLLM's extras (top_k, min_p, ...)."""

    model: str | None = None  # ignored: the worker serves the model it has loaded
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: NumChoices | None = None
    stop: Stop = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: NonNegativeInt | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[NonNegativeInt] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _check_common(self, max_tokens: int | None) -> None:
        if any(not s for s in self.stop_list()):
            raise _invalid("body.stop must not contain empty strings")
        if self.top_k is not None and self.top_k < -1:
            raise _invalid("body.top_k must be -1 or 0 (disabled) or an integer >= 1")
        if self.min_tokens and max_tokens is not None and self.min_tokens > max_tokens:
            raise _invalid(f"body.min_tokens must be <= max_tokens ({max_tokens})")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


def _text_parts_only(value: Any, handler: Any) -> Any:
    if isinstance(value, list):
        for part in value:
            if isinstance(part, dict) and part.get("type") not in (None, "text"):
                raise _invalid(f"has a {part.get('type')!r} part: only text parts are supported")
    try:
        return handler(value)
    except ValueError as exc:
        raise PydanticCustomError(
            INVALID_TYPE, "must be a string or a list of {type: 'text', text} parts"
        ) from exc


Content = Annotated[str | list[TextPart] | None, WrapValidator(_text_parts_only)]


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Content = None
    name: str | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Strict):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None
    stream: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if not self.messages:
            raise _invalid("body.messages must not be empty")
        for i, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise _invalid(f"body.messages[{i}].content is required for role {message.role!r}")
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("body.top_logprobs requires body.logprobs to be true")
        if self.stream:
            raise _invalid("body.stream must be false: a batch line has one response")
        if self.response_format is not None and self.response_format.type != "text":
            raise _invalid("body.response_format.type must be 'text' (JSON modes are unsupported)")
        self._check_common(self.effective_max_tokens)
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the older ``max_tokens``; None: up to the context."""
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as chat-template dicts; ``developer`` becomes ``system``, as OpenAI does for
        models without a developer role."""
        result = []
        for message in self.messages:
            role = "system" if message.role == "developer" else message.role
            entry = {"role": role, "content": message.text}
            if message.name is not None:
                entry["name"] = message.name
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            result.append(entry)
        return result


Prompt = Annotated[
    str | list[NonNegativeInt] | list[str] | list[list[NonNegativeInt]],
    _one_of_shapes("a string or a list of token ids"),
]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool | None = None
    logprobs: LogprobCount | None = None
    suffix: str | None = None
    best_of: PositiveInt | None = None
    stream: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise _invalid("body.prompt must hold one prompt: send one line per prompt")
        if not self.single_prompt:
            raise _invalid("body.prompt must not be empty")
        if self.echo:
            raise _invalid("body.echo must be false (echo is not supported)")
        if self.suffix:
            raise _invalid("body.suffix is not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise _invalid("body.best_of must equal n (best_of is not supported)")
        if self.stream:
            raise _invalid("body.stream must be false: a batch line has one response")
        self._check_common(self.effective_max_tokens)
        return self

    @property
    def effective_max_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS

    @property
    def single_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids (a one-element list of either is unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            return prompt[0]
        return prompt  # type: ignore[return-value]
