"""Pydantic models of a batch line's request body (/v1/chat/completions, /v1/completions).

Types are strict (``"0.7"`` is not a number, ``1`` is not a boolean); unknown fields are ignored,
as OpenAI does. Range errors are raised as ``invalid_value`` custom errors with a short
"must be ..." message that ``openai_format.parse`` prefixes with the field's path; type errors keep
pydantic's types and are reported as ``invalid_request``. Fields we know but cannot honour
(``stream: true``, ``echo: true``, ``suffix``, non-text content parts, ``UNSUPPORTED_FIELDS``)
are rejected rather than silently ignored: so are unknown fields (OpenAI answers "Unrecognized
request argument"), except the few OpenAI documents as not affecting the output
(``OUTPUT_NEUTRAL_FIELDS``).
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
RESPONSES_URL = "/v1/responses"  # openai_format.responses_request
EMBEDDINGS_URL = "/v1/embeddings"  # its body type: openai_format.embeddings
RERANK_URL = "/v1/rerank"  # its body type, and /v1/score's: openai_format.scoring
SCORE_URL = "/v1/score"
MESSAGES_URL = "/v1/messages"  # Anthropic's Messages API: openai_format.messages_request
SCORING_ENDPOINTS = (RERANK_URL, SCORE_URL)
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, RESPONSES_URL, EMBEDDINGS_URL, *SCORING_ENDPOINTS,
             MESSAGES_URL)
GENERATION_ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, RESPONSES_URL, MESSAGES_URL)

# Error types raised by the validators below; openai_format.parse maps them to line error codes.
INVALID_VALUE = "invalid_value"
INVALID_TYPE = "invalid_type"

MAX_LOGPROBS = 20
MAX_N = 128
MAX_LOGIT_BIAS = 100  # the same limit as engine.sampling_params.MAX_LOGIT_BIAS
MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# OpenAI's limits on ``metadata`` (a batch's, a job's, a /v1/responses body's).
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
TOKEN_ID_KEY = re.compile(r"^[0-9]{1,10}$")

# Fields OpenAI documents as not affecting the output: accepted and not used.
OUTPUT_NEUTRAL_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention",
})
# Known OpenAI fields this server does not honour, with the reason given in the line error.
UNSUPPORTED_FIELDS = {
    "functions": "use tools",
    "function_call": "use tool_choice",
    "reasoning_effort": "the served models do not reason",
    "verbosity": "the served models have no verbosity setting",
    "prediction": "predicted outputs are not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "web_search_options": "web search is not supported",
    "stream_options": "a batch line is not streamed",
}


def metadata_problem(value: dict[str, str]) -> str | None:
    """What breaks OpenAI's limits on metadata ("must hold at most 16 pairs, got 17"), or
    None."""
    if len(value) > MAX_METADATA_PAIRS:
        return f"must hold at most {MAX_METADATA_PAIRS} pairs, got {len(value)}"
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            return (f"keys must be at most {MAX_METADATA_KEY_CHARS} characters, got {len(key)} "
                    f"in {key[:20]!r}...")
        if len(item) > MAX_METADATA_VALUE_CHARS:
            return (f"values must be at most {MAX_METADATA_VALUE_CHARS} characters, got "
                    f"{len(item)} for key {key!r}")
    return None


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


class _Body(_Strict):
    """A request body: a field it does not declare gets a line error naming it."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)

    # Known fields refused with the reason, and fields accepted without effect.
    unsupported_fields: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS
    neutral_fields: ClassVar[frozenset[str]] = OUTPUT_NEUTRAL_FIELDS
    # What the errors call the body (Anthropic's Messages API calls it ``params``).
    body_name: ClassVar[str] = "body"

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        names = _field_names(cls)
        if names.issuperset(data):  # most lines: no unknown, unsupported or neutral field
            return data
        for name in data:
            if name in cls.unsupported_fields:
                raise _invalid(f"{cls.body_name}.{name} is not supported "
                               f"({cls.unsupported_fields[name]})")
            if name not in names and name not in cls.neutral_fields:
                raise _invalid(f"{cls.body_name}.{name} is not a supported parameter")
        return {k: v for k, v in data.items() if k in names}


@cache
def _field_names(cls: type[BaseModel]) -> frozenset[str]:
    """A model's field names, read once: pydantic's ``model_fields`` on the class goes through
    a descriptor that costs more than the rest of the check (prepare runs it on every line)."""
    return frozenset(cls.model_fields)


def _logit_bias(value: dict[str, float]) -> dict[str, float]:
    for key, bias in value.items():
        if not TOKEN_ID_KEY.match(key):
            raise _invalid(f"keys must be token ids as strings (\"123\"), got {key!r}")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise _invalid(f"values must be between -{MAX_LOGIT_BIAS} and {MAX_LOGIT_BIAS}, "
                           f"got {bias:g} for token {key}")
    return value


LogitBias = Annotated[
    dict[str, Annotated[float, Field(strict=False)]], AfterValidator(_logit_bias)
]


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, populate_by_name=True)


class ResponseFormat(_Strict):
    """``text``, ``json_object`` or ``json_schema`` (with ``json_schema: {name, schema,
    strict}``), as OpenAI's chat API takes them."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise _invalid("body.response_format.json_schema is required for type "
                               "'json_schema'")
            if not FUNCTION_NAME.match(self.json_schema.name):
                raise _invalid("body.response_format.json_schema.name must be 1-64 letters, "
                               "digits, '_' or '-'")
        return self

    def structured_output(self) -> dict[str, Any] | None:
        """The engine's StructuredOutputParams fields, or None for plain text."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            assert self.json_schema is not None
            schema = self.json_schema.schema_
            return {"json_schema": {"type": "object"} if schema is None else schema,
                    "strict": bool(self.json_schema.strict)}
        return None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> FunctionDefinition:
        if not FUNCTION_NAME.match(self.name):
            raise _invalid(f"function name {self.name!r} must be 1-64 letters, digits, '_' or "
                           "'-'")
        return self

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """OpenAI: omitted parameters mean a function without arguments."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice,
    _one_of_shapes("'none', 'auto', 'required' or {type: 'function', function: {name}}"),
]
# How a chat body's tools are used (``ChatCompletionRequest.tool_mode``): the model may call
# one ("auto"), must call one of them ("required") or must call the one named ("named").
ToolMode = Literal["auto", "required", "named"]


class SamplingFields(_Body):
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
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None

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
        if self.constrained and (self.min_tokens or self.ignore_eos):
            raise _invalid("body.min_tokens and body.ignore_eos cannot be used with a JSON "
                           "response_format or a forced tool call (the output ends with its JSON)")

    @property
    def constrained(self) -> bool:
        """The output is constrained by a grammar (a JSON response format or a tool call)."""
        return self.response_format is not None and self.response_format.type != "text"

    def logit_bias_ids(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        return {int(k): float(v) for k, v in self.logit_bias.items()}


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


class FunctionCall(_Strict):
    name: str
    arguments: str

    @model_validator(mode="after")
    def _check(self) -> FunctionCall:
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError as exc:
            raise _invalid(f"function.arguments must be a JSON object as text: {exc.msg}") from exc
        if not isinstance(value, dict):
            raise _invalid("function.arguments must be a JSON object as text")
        return self


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Content = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None

    @property
    def template_role(self) -> str:
        """The role for the chat template: ``developer`` becomes ``system``, as OpenAI does for
        models without a developer role."""
        return "system" if self.role == "developer" else self.role

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None
    stream: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if not self.messages:
            raise _invalid("body.messages must not be empty")
        for i, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise _invalid(f"body.messages[{i}].content is required for role {message.role!r}")
            if message.tool_calls and message.role != "assistant":
                raise _invalid(f"body.messages[{i}].tool_calls is only allowed on assistant "
                               "messages")
            if message.role == "tool" and message.tool_call_id is None:
                raise _invalid(f"body.messages[{i}].tool_call_id is required for role 'tool'")
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("body.top_logprobs requires body.logprobs to be true")
        if self.stream:
            raise _invalid("body.stream must be false: a batch line has one response")
        self._check_tools()
        self._check_common(self.effective_max_tokens)
        return self

    def _check_tools(self) -> None:
        if self.tools is None and self.tool_choice is None:
            return  # most lines: nothing below applies
        tools = self.tools or []
        if len(tools) > MAX_TOOLS:
            raise _invalid(f"body.tools must hold at most {MAX_TOOLS} functions")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise _invalid("body.tools must not name a function twice")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not tools:
            raise _invalid("body.tool_choice requires body.tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _invalid(f"body.tool_choice names {choice.function.name!r}, which is not in "
                           "body.tools")
        if self.forced_tools and self.response_format is not None and (
                self.response_format.type != "text"):
            raise _invalid("body.response_format must be 'text' when body.tool_choice forces a "
                           "tool call")

    @property
    def tool_mode(self) -> ToolMode | None:
        """None (no tools, or tool_choice 'none'), 'auto', 'required' or 'named'."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice is None or self.tool_choice == "auto":
            return "auto"
        return "required" if self.tool_choice == "required" else "named"

    @property
    def forced_tools(self) -> list[Tool]:
        """The tools one of which must be called: all for 'required', one for a named choice."""
        mode = self.tool_mode
        if mode == "required":
            return list(self.tools or [])
        if mode == "named":
            assert isinstance(self.tool_choice, NamedToolChoice)
            name = self.tool_choice.function.name
            return [t for t in self.tools or [] if t.function.name == name]
        return []

    @property
    def constrained(self) -> bool:
        return super().constrained or bool(self.forced_tools)

    @property
    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the older ``max_tokens``; None: up to the context."""
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as chat-template dicts (``ChatMessage.template_role``). An assistant's
        ``tool_calls`` keep OpenAI's shape with the arguments as an object (what Hugging Face
        chat templates expect)."""
        result = []
        for message in self.messages:
            entry: dict[str, Any] = {"role": message.template_role, "content": message.text}
            if message.name is not None:
                entry["name"] = message.name
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            if message.tool_calls:
                entry["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name,
                                  "arguments": json.loads(c.function.arguments)}}
                    for c in message.tool_calls
                ]
            result.append(entry)
        return result

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` in OpenAI's shape for the chat template (None: the template gets none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(mode="json", exclude_none=True) for t in self.tools]


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
