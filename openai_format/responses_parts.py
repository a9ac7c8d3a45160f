"""The parts of a ``/v1/responses`` body (``openai_format.responses_request``): the ``input``
items (messages with text parts, ``function_call`` and ``function_call_output`` items), the
flat function tools, ``tool_choice`` and ``text.format``, each validated under its own name
(``body.input[2].arguments``)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

from openai_format.types import (
    FUNCTION_NAME,
    INVALID_TYPE,
    _invalid,
    _one_of_shapes,
    _Strict,
)


def _text_only(value: Any, handler: Any) -> Any:
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in (None, "input_text", "output_text"):
                raise _invalid(f"has a {kind!r} part: only input_text and output_text parts are "
                               "supported")
    try:
        return handler(value)
    except ValueError as exc:
        raise PydanticCustomError(
            INVALID_TYPE, "must be a string or a list of {type: 'input_text', text} parts"
        ) from exc


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str


ItemContent = Annotated[str | list[InputText], WrapValidator(_text_only)]


class MessageItem(_Strict):
    """A message: OpenAI's ``EasyInputMessage`` (``type`` may be omitted) or input message, or
    an assistant's earlier output message (``output_text`` parts)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: ItemContent

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    """A function call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    @model_validator(mode="after")
    def _check(self) -> FunctionCallItem:
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError as exc:
            raise _invalid(f"arguments must be a JSON object as text: {exc.msg}") from exc
        if not isinstance(value, dict):
            raise _invalid("arguments must be a JSON object as text")
        return self


class FunctionCallOutputItem(_Strict):
    """What the caller's function returned for ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: ItemContent

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
               "function_call_output": FunctionCallOutputItem}
_NO_STORE = ("item_reference",)


def _input_item(value: Any, handler: Any) -> Any:
    """Dispatch on ``type`` (a message may omit it), so an item's error names its own fields."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        if kind in _NO_STORE:
            raise _invalid("is an item_reference: a batch has no conversation store, send the "
                           "item itself")
        if kind not in _ITEM_TYPES:
            raise _invalid(f"has type {kind!r}: supported are message, function_call and "
                           "function_call_output")
        return _ITEM_TYPES[kind].model_validate(value, strict=True)
    if isinstance(value, InputItem):
        return handler(value)
    raise PydanticCustomError(INVALID_TYPE, "must be an input item object: a message {role, "
                              "content}, a function_call or a function_call_output")


def _input(value: Any, handler: Any) -> Any:
    """A string is one user message (OpenAI's shorthand); a list is validated item by item, so
    an error names the item (``body.input[2].arguments``)."""
    if isinstance(value, str):
        return handler([{"type": "message", "role": "user", "content": value}])
    if not isinstance(value, list):
        raise PydanticCustomError(INVALID_TYPE, "must be a string or a list of input items")
    return handler(value)


Item = Annotated[InputItem, WrapValidator(_input_item)]
Input = Annotated[list[Item], WrapValidator(_input)]


class FunctionTool(_Strict):
    """A function tool, flat as the Responses API declares it."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> FunctionTool:
        if not FUNCTION_NAME.match(self.name):
            raise _invalid(f"function name {self.name!r} must be 1-64 letters, digits, '_' or "
                           "'-'")
        return self


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | FunctionChoice,
    _one_of_shapes("'none', 'auto', 'required' or {type: 'function', name}"),
]


class TextFormat(_Strict):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (flat: name, schema,
    strict, description)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None



class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
