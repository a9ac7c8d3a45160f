"""The body of a ``/v1/responses`` line (OpenAI's Responses API, what the ``openai`` SDK's
``client.responses.create`` sends), and its one mapping onto the chat request the engine path
already runs.

A ``ResponsesRequest`` is validated like a chat body (strict types, value ranges, every field it
does not declare refused by name) and, once valid, holds the equivalent ``ChatCompletionRequest``
(``as_chat``): ``instructions`` becomes the first system message, ``input`` items become
messages (``function_call`` items an assistant's ``tool_calls``, ``function_call_output`` items
``tool`` messages), ``max_output_tokens`` the completion budget, ``text.format`` the response
format, the flat function ``tools`` and ``tool_choice`` the chat ones. From there prompt,
sampling, grammar and tool-call parsing are the chat path's; only the output object differs
(``openai_format.response_object``); the body's parts are ``openai_format.responses_parts``.
Fields OpenAI has that a batch line cannot honour are refused with the reason
(``RESPONSES_UNSUPPORTED``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import PrivateAttr, ValidationError, WrapValidator, model_validator

from openai_format.responses_parts import (
    FunctionCallItem,
    FunctionChoice,
    FunctionTool,
    Input,
    MessageItem,
    TextConfig,
    TextFormat,
    ToolChoice,
)
from openai_format.types import (
    FUNCTION_NAME,
    MAX_TOOLS,
    ChatCompletionRequest,
    PositiveInt,
    Temperature,
    TopP,
    _Body,
    _invalid,
    metadata_problem,
)

# Fields OpenAI's Responses API has that a batch line cannot honour, with the reason.
RESPONSES_UNSUPPORTED = {
    "previous_response_id": "a batch has no conversation store: send the earlier turns in "
                            "input (function_call and function_call_output items included)",
    "conversation": "a batch has no conversation store: send the earlier turns in input",
    "background_options": "a batch line already runs in the background",
    "stream_options": "a batch line is not streamed",
    "prompt": "stored prompt templates are not supported: send the text in input",
    "reasoning": "the served models do not reason",
    "include": "no extra output data is available",
    "top_logprobs": "logprobs are not supported on /v1/responses lines (use "
                    "/v1/chat/completions with logprobs)",
    "max_tool_calls": "a forced tool_choice already makes one call",
    "context_management": "context compaction is not supported",
    "moderation": "moderation is not supported",
    "image": "image input is not supported",
    "access_programs": "access programs are not supported",
}
# Fields OpenAI documents as not affecting the output: accepted and not used.
RESPONSES_NEUTRAL = frozenset({
    "user", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options",
})


def _metadata(value: dict[str, str]) -> dict[str, str]:
    problem = metadata_problem(value)
    if problem is not None:
        raise _invalid(problem)
    return value


Metadata = Annotated[dict[str, str], WrapValidator(
    lambda value, handler: _metadata(handler(value)))]


class ResponsesRequest(_Body):
    """A ``/v1/responses`` body. ``as_chat`` is the chat request it runs as."""

    unsupported_fields: ClassVar[dict[str, str]] = RESPONSES_UNSUPPORTED
    neutral_fields: ClassVar[frozenset[str]] = RESPONSES_NEUTRAL

    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: Metadata | None = None
    stream: bool | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None

    _chat: ChatCompletionRequest | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.stream:
            raise _invalid("body.stream must be false: a batch line has one response")
        if self.background:
            raise _invalid("body.background must be false: a batch line already runs in the "
                           "background, and its response is in the batch's output file")
        if self.truncation == "auto":
            raise _invalid("body.truncation 'auto' is not supported: input is never dropped to "
                           "fit the context (a line too long fails with "
                           "context_length_exceeded)")
        if not self.input:
            raise _invalid("body.input must not be empty")
        self._check_text()
        self._check_tools()
        try:
            self._chat = ChatCompletionRequest.model_validate(self._chat_body())
        except ValidationError as exc:
            # Each part was checked above under its own name; what is left is a combination
            # the chat path refuses (its message names the chat field).
            raise _invalid(f"body cannot run: {exc.errors(include_url=False)[0]['msg']}") from exc
        return self

    def _check_text(self) -> None:
        if self.text is None:
            return
        if self.text.verbosity is not None:
            raise _invalid("body.text.verbosity is not supported (the served models have no "
                           "verbosity setting)")
        fmt = self.text.format
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise _invalid("body.text.format.schema is required for type 'json_schema'")
            if fmt.name is None or not FUNCTION_NAME.match(fmt.name):
                raise _invalid("body.text.format.name must be 1-64 letters, digits, '_' or '-'")

    def _check_tools(self) -> None:
        if self.tools is None and self.tool_choice is None:
            return
        tools = self.tools or []
        if len(tools) > MAX_TOOLS:
            raise _invalid(f"body.tools must hold at most {MAX_TOOLS} functions")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise _invalid("body.tools must not name a function twice")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not tools:
            raise _invalid("body.tool_choice requires body.tools")
        if isinstance(choice, FunctionChoice) and choice.name not in names:
            raise _invalid(f"body.tool_choice names {choice.name!r}, which is not in body.tools")
        forces = tools and (choice == "required" or isinstance(choice, FunctionChoice))
        fmt = self.text.format if self.text is not None else None
        if forces and fmt is not None and fmt.type != "text":
            raise _invalid("body.text.format must be 'text' when body.tool_choice forces a "
                           "function call")

    @property
    def as_chat(self) -> ChatCompletionRequest:
        assert self._chat is not None  # set by the validator of every valid instance
        return self._chat

    def _chat_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": self._messages()}
        if self.model is not None:
            body["model"] = self.model
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.top_p is not None:
            body["top_p"] = self.top_p
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        if self.tools is not None:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(
                    exclude={"type"}, exclude_none=True, by_alias=True)}
                for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        return body

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                # Calls of one turn (and the text before them) are one assistant message.
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None,
                                     "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.text})
        return messages

    def echo(self) -> dict[str, Any]:
        """The request's fields a ``Response`` object repeats (OpenAI's defaults filled in)."""
        fmt = self.text.format if self.text is not None else None
        choice = self.tool_choice
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": dict(self.metadata or {}),
            "parallel_tool_calls": True if self.parallel_tool_calls is None
            else self.parallel_tool_calls,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "text": {"format": {"type": "text"} if fmt is None
                     else fmt.model_dump(exclude_none=True, by_alias=True)},
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "tool_choice": ("auto" if choice is None
                            else choice.model_dump() if isinstance(choice, FunctionChoice)
                            else choice),
            "truncation": "disabled",
        }


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}
