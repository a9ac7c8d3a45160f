"""Every refusal a caller maps to a line error: a request the engine will not take, typed, with a
message that names what is wrong. No torch here: the service catches these before (or without)
building an engine."""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names it and says why."""

    def __init__(self, name: str, reason: str) -> None:
        self.adapter = name
        super().__init__(f"LoRA adapter {name!r}: {reason}")


class StructuredOutputError(ValueError):
    """The requested format cannot be compiled: a bad or unsupported schema or grammar."""


class EmbeddingInputError(ValueError):
    """An embedding request the engine cannot take; ``index`` is the input at fault (None: the
    request as a whole)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class EmptyInput(EmbeddingInputError):
    pass


class InputTooLong(EmbeddingInputError):
    pass


class TokenOutOfVocabulary(EmbeddingInputError):
    pass


class DimensionsNotSupported(EmbeddingInputError):
    pass


class NotAnEmbeddingModel(ValueError):
    """Embedding asked of a generation engine, or generation of an embedding one."""
