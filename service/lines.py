"""Request lines from parsed input: the stored body and the prefix sort key."""

from __future__ import annotations

from typing import Any

from openai_format.parse import BatchLine, LineError
from openai_format.types import ChatCompletionRequest

SORT_KEY_CHARS = 200
MODEL_MISMATCH = "model_mismatch"  # OpenAI's code for a line naming another model


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


class ModelTracker:
    """The one model a batch's lines name (OpenAI's rule): the first valid line naming one fixes
    it, unless ``model`` is given; a later line naming another is a line error. Lines naming
    none run on the batch's model. The upload and the batch's preparation check the same way."""

    def __init__(self, model: str | None = None) -> None:
        self.model = model

    def check(self, line: BatchLine) -> LineError | None:
        name = line.body.model
        if name is None:
            return None
        if self.model is None:
            self.model = name
            return None
        if name == self.model:
            return None
        return LineError(MODEL_MISMATCH, f"body.model {name!r} differs from {self.model!r}, the "
                         "model of the file's other lines: a batch's lines all name one model",
                         line.line_no, line.custom_id)
