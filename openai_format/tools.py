"""Tool calls: the JSON a forced call is constrained to, and the ``tool_calls`` read back.

``tool_choice`` "required" or a named function constrains the output (the engine's grammar) to
one call: a named function's output is its arguments object; "required" produces
``{"name": ..., "arguments": {...}}`` with ``name`` one of the tools (an ``anyOf``, one branch
per tool). The call is compact JSON, no whitespace between tokens: a model that pretty-prints
would spend ``max_tokens`` on indentation and have its call cut. ``tool_choice`` "auto" leaves
the choice to the model: its chat template gets the tools, and a family's own call syntax is
parsed from the text (``HERMES_TOOL_CALL``: Qwen2/2.5/3 and Hermes models write
``<tool_call>{"name", "arguments"}</tool_call>``) or, for gpt-oss's harmony format
(``HARMONY_TOOL_CALL``), from its messages to ``functions.{name}``
(``openai_format.reasoning.split_harmony``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from openai_format.ids import new_id
from openai_format.types import ChatCompletionRequest

# How a chat template that writes Hermes-style calls can be recognised.
HERMES_TOOL_CALL = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# ... and one that renders gpt-oss's harmony calls (``to=functions.{name}`` ... ``<|call|>``).
HARMONY_TOOL_CALL = "<|call|>"


@dataclass(frozen=True)
class ToolCallMode:
    """How the text of a chat line's output becomes tool calls: ``forced_name`` (the text is
    the named function's arguments), ``forced_any`` (the text is ``{"name", "arguments"}``) or
    ``hermes`` (calls between ``<tool_call>`` tags inside free text) or ``harmony`` (the
    completion's messages to functions, ``harmony_tool_calls``)."""

    kind: str
    name: str | None = None


def forced_call(body: ChatCompletionRequest) -> tuple[dict[str, Any], bool, ToolCallMode] | None:
    """(JSON schema, strict, mode) of the call ``tool_choice`` forces, or None."""
    tools = body.forced_tools
    if not tools:
        return None
    if body.tool_mode == "named":
        function = tools[0].function
        return (function.parameters_schema, bool(function.strict),
                ToolCallMode("forced_name", function.name))
    branches = [
        {"type": "object",
         "properties": {"name": {"const": t.function.name},
                        "arguments": t.function.parameters_schema},
         "required": ["name", "arguments"], "additionalProperties": False}
        for t in tools
    ]
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return schema, all(bool(t.function.strict) for t in tools), ToolCallMode("forced_any")


def template_supports_tools(chat_template: Any) -> str | None:
    """The call syntax a chat template teaches the model (``"hermes"``), or None."""
    if isinstance(chat_template, dict):  # named templates: the tool_use one, else the default
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    if not isinstance(chat_template, str) or "tools" not in chat_template:
        return None
    if HERMES_TOOL_CALL in chat_template:
        return "hermes"
    if HARMONY_TOOL_CALL in chat_template and "functions." in chat_template:
        return "harmony"
    return None


def harmony_tool_calls(calls: Iterable[tuple[str, str]]) -> list[dict] | None:
    """OpenAI ``tool_calls`` for harmony's (name, arguments text) calls; None if any call's
    arguments are not a JSON object (the completion is then left as it is)."""
    out = []
    for name, text in calls:
        arguments = _json_object(text)
        if arguments is None or not name:
            return None
        out.append(_call(name, arguments))
    return out


def tool_calls_from_text(mode: ToolCallMode, text: str) -> tuple[str | None, list[dict]]:
    """(the content left, OpenAI ``tool_calls``) for one choice's text; no calls when the text
    holds none that parse (a cut-off call stays as content)."""
    if mode.kind == "forced_name":
        arguments = _json_object(text)
        if arguments is None:
            return text, []
        return None, [_call(mode.name or "", arguments)]
    if mode.kind == "forced_any":
        call = _json_object(text)
        if call is None or not isinstance(call.get("name"), str) or not isinstance(
                call.get("arguments"), dict):
            return text, []
        return None, [_call(call["name"], call["arguments"])]
    calls = []
    for match in _HERMES_CALL.finditer(text):
        call = _json_object(match.group(1))
        if call is None or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _json_object(arguments)
        if not isinstance(arguments, dict):
            return text, []
        calls.append(_call(call["name"], arguments))
    if not calls:
        return text, []
    content = text[: text.index(HERMES_TOOL_CALL)].strip()
    return content or None, calls


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _call(name: str, arguments: dict) -> dict[str, Any]:
    return {"id": new_id("call_"), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
