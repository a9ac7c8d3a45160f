"""The ``Response`` object of a finished ``/v1/responses`` line, as OpenAI's Responses API
returns it: ``output`` holds a ``message`` item of ``output_text`` parts, or one
``function_call`` item per call the model made; ``status`` is ``incomplete`` with
``incomplete_details.reason: "max_output_tokens"`` when the budget cut the output."""

from __future__ import annotations

import time
from typing import Any

from openai_format.ids import new_id
from openai_format.responses import ChoiceResult


def _message(text: str, *, complete: bool) -> dict[str, Any]:
    return {"id": new_id("msg_"), "type": "message", "role": "assistant",
            "status": "completed" if complete else "incomplete",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _function_call(call: dict[str, Any]) -> dict[str, Any]:
    """A chat ``tool_calls`` entry as a Responses ``function_call`` item (its ``call_id`` is
    the chat call's id, what a later ``function_call_output`` answers)."""
    return {"id": new_id("fc_"), "type": "function_call", "status": "completed",
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"]}


def response_object(
    choice: ChoiceResult, *, echo: dict[str, Any], model: str, prompt_tokens: int,
    cached_tokens: int, response_id: str, created: int | None = None,
) -> dict[str, Any]:
    """The ``Response`` for one finished request; ``echo`` is ``ResponsesRequest.echo()``."""
    created_at = int(time.time()) if created is None else created
    complete = choice.finish_reason != "length"
    output = []
    if choice.text or not choice.tool_calls:
        output.append(_message(choice.text, complete=complete))
    output.extend(_function_call(call) for call in choice.tool_calls)
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": created_at,
        "status": "completed" if complete else "incomplete",
        "background": False,
        "error": None,
        "incomplete_details": None if complete else {"reason": "max_output_tokens"},
        "model": model,
        "output": output,
        "previous_response_id": None,
        **echo,
        "usage": {
            "input_tokens": prompt_tokens,
            # Boxcar has no explicit cache writes: its prefix cache keeps full blocks as a
            # side effect of computing them.
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": choice.num_tokens,
            "output_tokens_details": {"reasoning_tokens": choice.reasoning_tokens or 0},
            "total_tokens": prompt_tokens + choice.num_tokens,
        },
    }
