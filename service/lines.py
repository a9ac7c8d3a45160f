"""Request lines from parsed input: the stored body and the prefix sort key."""

from __future__ import annotations

from typing import Any

from openai_format.parse import BatchLine
from openai_format.types import ChatCompletionRequest

SORT_KEY_CHARS = 200


def sort_key(line: BatchLine) -> str:
    """The start of the prompt as text, so lines sharing a prefix (a system prompt, a RAG
    document) sort next to each other and run close together: the prefix cache then hits."""
    body = line.body
    if isinstance(body, ChatCompletionRequest):
        text = "\x1f".join(f"{m['role']}\x1e{m['content']}" for m in body.template_messages())
    else:
        prompt = body.single_prompt
        text = prompt if isinstance(prompt, str) else " ".join(str(t) for t in prompt[:100])
    return text[:SORT_KEY_CHARS]


def stored_body(line: BatchLine) -> dict[str, Any]:
    """The body as it is kept on the row (validated, unknown fields dropped)."""
    return line.body.model_dump(mode="json", exclude_none=True, by_alias=True)
