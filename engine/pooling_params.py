"""PoolingParams: what an embedding request asks of the engine beside its inputs; and
EmbeddingInputs, its inputs once an engine has checked them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """``dimensions``: keep the first ``dimensions`` values (then normalize again where the model
    normalizes); only for a model that declares Matryoshka dimensions
    (``LLMEngine.matryoshka_dimensions``), checked when the request is added.
    ``token_type_starts``: for a cross-encoder (``EmbeddingSpec.cross_encoder``), each pair's
    segment boundary; None: every token is type 0."""

    dimensions: int | None = None
    # A cross-encoder's inputs are pairs of texts: where each input's second text begins (its
    # tokens from there on are token type 1, BERT's segment B), one entry per input.
    token_type_starts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
                isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")


@dataclass(frozen=True)
class EmbeddingInputs:
    """An embedding request's inputs as token ids, checked against the model together with its
    params: what ``Engine.check_embedding`` returns and ``Engine.add_request`` takes as it is,
    so a caller that checks a line before adding it (the request pipeline) checks it once."""

    token_ids: list[list[int]]
    params: PoolingParams

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)
