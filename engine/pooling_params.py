"""PoolingParams: what an embedding request asks of the engine beside its inputs;
EmbeddingInputs, its inputs once an engine has checked them; EmbeddingSpec, what an embedding
engine admits and returns."""

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


@dataclass(frozen=True)
class EmbeddingSpec:
    """What an embedding engine admits and returns, fixed when its runner is built."""

    model_name: str
    max_len: int  # the longest input, in tokens
    vocab_size: int
    hidden_size: int  # the vector's size
    matryoshka_dimensions: tuple[int, ...] | None  # the sizes it may be cut to, if any
    normalize: bool  # vectors are L2-normalized (again after a cut)
    truncate: bool  # an input past max_len is cut (``EngineConfig.truncate_embedding_inputs``)
    # A cross-encoder: each input is a pair of texts (``PoolingParams.token_type_starts``) and
    # its vector is one relevance score; it serves /v1/score and /v1/rerank, not embeddings.
    cross_encoder: bool = False
