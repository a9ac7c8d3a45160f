"""PoolingParams: what an embedding request asks of the engine beside its inputs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """``dimensions``: keep the first ``dimensions`` values (then normalize again where the model
    normalizes); only for a model that declares Matryoshka dimensions
    (``LLMEngine.matryoshka_dimensions``), checked when the request is added."""

    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
                isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
