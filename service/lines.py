"""Request lines from parsed input: the stored body and the prefix sort key."""

from __future__ import annotations

from typing import Any

from openai_format.embeddings import EmbeddingRequest
from openai_format.messages_request import MessagesRequest
from openai_format.parse import BatchLine, LineError
from openai_format.responses_request import ResponsesRequest
from openai_format.scoring import RerankRequest, ScoreRequest
from openai_format.types import ChatCompletionRequest

SORT_KEY_CHARS = 200
# A line's output length before any line of its batch has finished, when it sets no max_tokens
# (the engine would run to the context): a guess the batch's finished lines soon replace.
DEFAULT_OUTPUT_TOKENS = 256
CHARS_PER_TOKEN = 4  # English text in a BPE vocabulary; chat templates add ~4 a message
MODEL_MISMATCH = "model_mismatch"  # OpenAI's code for a line naming another model
TOO_MANY_INPUTS = "too_many_inputs"  # a batch's embedding inputs beyond its limit


def sort_key(line: BatchLine) -> str:
    """The start of the prompt as text, so lines sharing a prefix (a system prompt, a RAG
    document) sort next to each other and run close together: the prefix cache then hits.
    Without NUL characters: a PostgreSQL text column refuses them (the whole chunk's COPY)."""
    body = line.body
    if isinstance(body, EmbeddingRequest):  # no prefix to share: group by length instead
        inputs = body.inputs()
        return f"\x01embedding {sum(len(i) for i in inputs):010d}"
    if isinstance(body, RerankRequest | ScoreRequest):  # the same: pooled, no KV cache
        return f"\x01score {sum(_pair_chars(body)):010d}"
    if isinstance(body, ResponsesRequest | MessagesRequest):
        body = body.as_chat  # the messages it runs as
    if isinstance(body, ChatCompletionRequest):
        # The roles and texts of ``template_messages``, without building its dicts (prepare
        # runs this on every line).
        text = "\x1f".join(f"{m.template_role}\x1e{m.text}" for m in body.messages)
    else:
        prompt = body.single_prompt
        text = prompt if isinstance(prompt, str) else " ".join(str(t) for t in prompt[:100])
    return text[:SORT_KEY_CHARS].replace("\x00", "")


def stored_body(line: BatchLine) -> dict[str, Any]:
    """The body as it is kept on the row (validated, unknown fields dropped)."""
    return line.body.model_dump(mode="json", exclude_none=True, by_alias=True)


def estimate_tokens(line: BatchLine) -> tuple[int, int]:
    """(prompt tokens, output tokens) of a line before it runs, without a tokenizer: what the
    ETA of its batch starts from (``api.eta``)."""
    body = line.body
    if isinstance(body, EmbeddingRequest):  # prefill only: nothing is generated
        return sum(len(i) // CHARS_PER_TOKEN + 2 if isinstance(i, str) else len(i)
                   for i in body.inputs()), 0
    if isinstance(body, RerankRequest | ScoreRequest):  # a cross-encoder's pairs; nothing generated
        return sum(chars // CHARS_PER_TOKEN + 3 for chars in _pair_chars(body)), 0
    if isinstance(body, ResponsesRequest | MessagesRequest):
        body = body.as_chat
    if isinstance(body, ChatCompletionRequest):
        chars = sum(len(m.text) for m in body.messages)
        prompt = chars // CHARS_PER_TOKEN + 4 * len(body.messages) + 1
    else:
        single = body.single_prompt
        prompt = len(single) // CHARS_PER_TOKEN + 1 if isinstance(single, str) else len(single)
    max_tokens = body.effective_max_tokens
    return prompt, max_tokens if max_tokens is not None else DEFAULT_OUTPUT_TOKENS


def _pair_chars(body: RerankRequest | ScoreRequest) -> list[int]:
    """Each pair's characters, both texts together."""
    if isinstance(body, RerankRequest):
        return [len(body.query) + len(text) for text in body.texts()]
    texts_1, texts_2 = body.texts_1(), body.texts_2()
    return [len(texts_1[0 if len(texts_1) == 1 else i]) + len(b) for i, b in enumerate(texts_2)]


def enqueued_tokens(line: BatchLine) -> int:
    """What a line holds against its tenant's quota (``service.quotas``) until it closes: its
    prompt and output estimates (a line without max_tokens counts ``DEFAULT_OUTPUT_TOKENS``).
    The upload, prepare and a job's creation count with this one function."""
    prompt, output = estimate_tokens(line)
    return prompt + output


class EmbeddingInputBudget:
    """OpenAI's rule that a batch's embeddings lines hold at most ``limit`` inputs in all
    (``Settings.max_batch_embedding_inputs``): the line that would go past it, and every later
    one that would, is a line error; the lines before it run. The upload and the batch's
    preparation count the same way."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_inputs = 0

    def check(self, line: BatchLine) -> LineError | None:
        body = line.body
        if not isinstance(body, EmbeddingRequest):
            return None
        count = body.num_inputs
        if self.num_inputs + count > self.limit:
            return LineError(TOO_MANY_INPUTS, f"body.input: this line's {count} inputs would take "
                             f"the batch past {self.limit} embedding inputs in all (the limit "
                             f"for a batch; {self.num_inputs} are already in it)",
                             line.line_no, line.custom_id, param="input")
        self.num_inputs += count
        return None
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
        return LineError(MODEL_MISMATCH, f"{line.body.body_name}.model {name!r} differs from "
                         f"{self.model!r}, the model of the file's other lines: a batch's lines "
                         "all name one model",
                         line.line_no, line.custom_id)
