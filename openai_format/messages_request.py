"""The body of a ``/v1/messages`` line: the ``params`` of one request of Anthropic's Message
Batches API (a Messages API body), and its one mapping onto the chat request the engine path
already runs.

A ``MessagesRequest`` is validated like a chat body (strict types, value ranges, every field it
does not declare refused by name) and, once valid, holds the equivalent ``ChatCompletionRequest``
(``as_chat``): ``system`` becomes the first system message, ``text`` blocks message text,
an assistant's ``tool_use`` blocks its ``tool_calls``, a user's ``tool_result`` blocks ``tool``
messages, ``tools`` (``input_schema``) function tools, ``tool_choice`` {auto, any, tool, none}
the chat one (any: "required"), ``stop_sequences`` the stop strings. From there prompt, sampling,
grammar and tool-call parsing are the chat path's; only the output object differs
(``openai_format.message_object``). Anthropic calls the body ``params``, so the errors name its
fields ``params.*`` (``openai_format.parse`` roots the path there for this endpoint).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, model_validator

from openai_format.types import (
    FUNCTION_NAME,
    MAX_TOOLS,
    ChatCompletionRequest,
    PositiveInt,
    TopP,
    _between,
    _Body,
    _invalid,
)

# Anthropic's limits on a Message Batch (a create request holds at most these).
MAX_MESSAGE_BATCH_REQUESTS = 100_000
MAX_MESSAGE_BATCH_BYTES = 256 * 1024 * 1024
CUSTOM_ID = r"^[a-zA-Z0-9_-]{1,64}$"

# Fields of the Messages API a batch line cannot honour, with the reason.
MESSAGES_UNSUPPORTED = {
    "thinking": "the served models do not think in blocks",
    "mcp_servers": "MCP servers are not supported",
    "container": "code execution containers are not supported",
    "context_management": "context management is not supported",
    "output_format": "use a tool with tool_choice {type: tool} for structured output",
}
# Fields accepted without effect.
MESSAGES_NEUTRAL = frozenset({"service_tier", "inference_geo"})
# Content block types a message may hold and what they are refused with.
_REFUSED_BLOCKS = {
    "image": "image blocks are not supported (no vision model is served)",
    "document": "document blocks are not supported (no document model is served)",
    "thinking": "thinking blocks are not supported",
    "redacted_thinking": "redacted_thinking blocks are not supported",
    "search_result": "search_result blocks are not supported",
    "server_tool_use": "server tools are not supported",
    "web_search_tool_result": "server tools are not supported",
}

Temperature01 = Annotated[float, _between(0, 1)]


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class ToolParam(_Part):
    """A client tool: its JSON schema is ``input_schema``."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None


class ToolChoiceParam(_Part):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MetadataParam(_Part):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    user_id: str | None = None


class MessageParam(_Part):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Body):
    """A ``/v1/messages`` body (a Message Batch request's ``params``). ``as_chat`` is the chat
    request it runs as."""

    unsupported_fields: ClassVar[dict[str, str]] = MESSAGES_UNSUPPORTED
    neutral_fields: ClassVar[frozenset[str]] = MESSAGES_NEUTRAL
    body_name: ClassVar[str] = "params"

    model: str | None = None
    max_tokens: PositiveInt
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: Temperature01 | None = None
    top_p: TopP | None = None
    top_k: PositiveInt | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    metadata: MetadataParam | None = None
    stream: bool | None = None

    _chat: ChatCompletionRequest | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> MessagesRequest:
        if self.stream:
            raise _invalid("params.stream must be false: a batch request has one response")
        if not self.messages:
            raise _invalid("params.messages must not be empty")
        if self.messages[-1].role != "user":
            raise _invalid("params.messages: the last message must be the user's (an "
                           "assistant prefill is not supported)")
        if any(not s for s in self.stop_sequences or []):
            raise _invalid("params.stop_sequences must not contain empty strings")
        self._check_tools()
        try:
            self._chat = ChatCompletionRequest.model_validate(self._chat_body())
        except ValidationError as exc:
            # Each part was checked above under its own name; what is left is a combination
            # the chat path refuses (its message names the chat field).
            raise _invalid(f"params cannot run: {exc.errors(include_url=False)[0]['msg']}"
                           ) from exc
        return self

    def _check_tools(self) -> None:
        tools = self.tools or []
        if len(tools) > MAX_TOOLS:
            raise _invalid(f"params.tools must hold at most {MAX_TOOLS} tools")
        for i, tool in enumerate(tools):
            if not FUNCTION_NAME.match(tool.name):
                raise _invalid(f"params.tools[{i}].name must be 1-64 letters, digits, '_' or "
                               f"'-', got {tool.name!r}")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise _invalid("params.tools must not name a tool twice")
        choice = self.tool_choice
        if choice is None:
            return
        if choice.type in ("any", "tool") and not tools:
            raise _invalid(f"params.tool_choice {choice.type!r} requires params.tools")
        if choice.type == "tool" and choice.name not in names:
            raise _invalid(f"params.tool_choice.name {choice.name!r} is not in params.tools")

    @property
    def as_chat(self) -> ChatCompletionRequest:
        assert self._chat is not None  # set by the validator of every valid instance
        return self._chat

    def _chat_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": self._chat_messages(), "max_tokens": self.max_tokens}
        if self.model is not None:
            body["model"] = self.model
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = list(self.stop_sequences)
        if self.tools is not None:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {})}}
                for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required",
                                       "none": "none"}[choice.type]
            if choice.disable_parallel_tool_use is not None and self.tools:
                body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return body

    def _chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            system = (self.system if isinstance(self.system, str)
                      else _text_of(self.system, "params.system", allowed=("text",))[0])
            messages.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            where = f"params.messages[{i}].content"
            if isinstance(message.content, str):
                messages.append({"role": message.role, "content": message.content})
                continue
            if message.role == "assistant":
                text, calls = _assistant_blocks(message.content, where)
                turn: dict[str, Any] = {"role": "assistant", "content": text or None}
                if calls:
                    turn["tool_calls"] = calls
                elif not text:
                    turn["content"] = ""
                messages.append(turn)
                continue
            text, results = _user_blocks(message.content, where)
            messages.extend(results)
            if text or not results:
                messages.append({"role": "user", "content": text})
        return messages


def _block_type(block: dict[str, Any], where: str) -> str:
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _invalid(f"{where}.type is required (a string)")
    if kind in _REFUSED_BLOCKS:
        raise _invalid(f"{where}.type {kind!r}: {_REFUSED_BLOCKS[kind]}")
    return kind


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _invalid(f"{where}.text is required (a string)")
    return text


def _text_of(blocks: list[dict[str, Any]], where: str,
             allowed: tuple[str, ...]) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
    """The text of ``blocks``' text blocks joined, and the other blocks (of ``allowed``) by
    index; any other type is refused naming the block."""
    texts: list[str] = []
    others: list[tuple[int, dict[str, Any]]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _block_type(block, at)
        if kind not in allowed:
            raise _invalid(f"{at}.type must be one of {', '.join(map(repr, allowed))}, "
                           f"got {kind!r}")
        if kind == "text":
            texts.append(_text(block, at))
        else:
            others.append((j, block))
    return "\n".join(texts), others


def _assistant_blocks(blocks: list[dict[str, Any]],
                      where: str) -> tuple[str, list[dict[str, Any]]]:
    text, others = _text_of(blocks, where, allowed=("text", "tool_use"))
    calls = []
    for j, block in others:
        at = f"{where}[{j}]"
        call_id, name, args = block.get("id"), block.get("name"), block.get("input")
        if not isinstance(call_id, str) or not isinstance(name, str):
            raise _invalid(f"{at}: a tool_use block needs id and name (strings)")
        if not isinstance(args, dict):
            raise _invalid(f"{at}.input must be an object")
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args)}})
    return text, calls


def _user_blocks(blocks: list[dict[str, Any]],
                 where: str) -> tuple[str, list[dict[str, Any]]]:
    text, others = _text_of(blocks, where, allowed=("text", "tool_result"))
    results = []
    for j, block in others:
        at = f"{where}[{j}]"
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str):
            raise _invalid(f"{at}.tool_use_id is required (a string)")
        content = block.get("content", "")
        if isinstance(content, list):
            content = _text_of(content, f"{at}.content", allowed=("text",))[0]
        elif not isinstance(content, str):
            raise _invalid(f"{at}.content must be a string or a list of text blocks")
        if block.get("is_error") is True:
            content = f"Error: {content}"
        results.append({"role": "tool", "tool_call_id": call_id, "content": content})
    return text, results
