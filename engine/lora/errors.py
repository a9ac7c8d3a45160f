"""LoRAError: an adapter that cannot be served (no torch here: the service catches it)."""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names it and says why."""

    def __init__(self, name: str, reason: str) -> None:
        self.adapter = name
        super().__init__(f"LoRA adapter {name!r}: {reason}")
