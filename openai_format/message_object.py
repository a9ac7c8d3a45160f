"""The ``Message`` object of a finished ``/v1/messages`` line, as Anthropic's Messages API
returns it: ``content`` holds a ``text`` block and one ``tool_use`` block per call the model made;
``stop_reason`` is ``tool_use``, ``max_tokens``, ``stop_sequence`` (``stop_sequence`` naming the
one that matched) or ``end_turn``. ``usage.input_tokens`` counts the prompt tokens the prefix
cache did not serve; those it served are ``cache_read_input_tokens``."""

from __future__ import annotations

import json
from typing import Any

from openai_format.responses import ChoiceResult


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A chat ``tool_calls`` entry as a ``tool_use`` block (its arguments as an object)."""
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {}}


def stop_reason(choice: ChoiceResult) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finished sequence."""
    if choice.tool_calls:
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def message_object(choice: ChoiceResult, *, model: str, prompt_tokens: int,
                   cached_tokens: int, message_id: str) -> dict[str, Any]:
    """The ``Message`` for one finished request."""
    content: list[dict[str, Any]] = []
    if choice.text or not choice.tool_calls:
        content.append({"type": "text", "text": choice.text})
    content.extend(_tool_use(call) for call in choice.tool_calls)
    reason, sequence = stop_reason(choice)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": prompt_tokens - cached_tokens,
            # Boxcar has no explicit cache writes: its prefix cache keeps full blocks as a
            # side effect of computing them.
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens,
            "output_tokens": choice.num_tokens,
        },
    }
