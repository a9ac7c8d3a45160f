"""Rerank and score lines between their engine fields and the engine: ``prepare_score`` turns a
line's ``ScoreArgs`` into a ``ScoreInput`` (or a ``PrepareError`` naming the field), and its
``ScoreReadBack`` turns the finished request's vectors into the /v1/rerank or /v1/score body.

Two kinds of model serve them. A cross-encoder (``EmbeddingSpec.cross_encoder``) takes each pair
as one input, ``[CLS] a [SEP] b [SEP]`` with its token types, and returns its score. An
embedding model embeds every text once (a rerank's query once, not once a document) and a
pair's score is the cosine of its two vectors, as sentence-transformers' ``util.cos_sim``
computes it. Either way the request is one engine request whose inputs the engine checks once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import EmbeddingInputError, InputTooLong
from engine.pooling.inputs import pair_token_ids
from engine.pooling_params import PoolingParams
from engine.protocol import Engine
from openai_format.engine_fields import ScoreArgs
from openai_format.parse import CONTEXT_LENGTH_EXCEEDED
from openai_format.scoring import ScoreKind, rerank_body, score_body
from openai_format.types import INVALID_VALUE
from pipeline.errors import PrepareError
from pipeline.pooled_input import PooledInput


@dataclass(frozen=True)
class ScoreReadBack:
    """How a rerank or score request's vectors become its response body."""

    kind: ScoreKind
    # An embedding model's: each pair's two vector indexes; None: a cross-encoder's, one
    # one-value vector a pair.
    pairs: tuple[tuple[int, int], ...] | None
    top_n: int | None
    documents: tuple[str, ...] | None  # a rerank's documents, when its results repeat them

    def scores(self, vectors: list[Any]) -> list[float]:
        if any(v is None for v in vectors):
            raise ValueError("a rerank or score request finished without all its vectors")
        if self.pairs is None:
            return [float(v[0]) for v in vectors]
        import torch  # only where responses are built (the worker's engine thread, boxcar run)
        import torch.nn.functional as F

        normalized = F.normalize(torch.stack([torch.as_tensor(v) for v in vectors]).float(),
                                 p=2, dim=1)  # [num_texts, hidden_size]
        return [float(normalized[a] @ normalized[b]) for a, b in self.pairs]

    def body(self, vectors: list[Any], *, model: str, prompt_tokens: int, hex_id: str,
             created: int) -> dict[str, Any]:
        scores = self.scores(vectors)
        if self.kind == "rerank":
            return rerank_body(scores, documents=None if self.documents is None
                               else list(self.documents), top_n=self.top_n, model=model,
                               prompt_tokens=prompt_tokens, rerank_id="rerank-" + hex_id)
        return score_body(scores, model=model, prompt_tokens=prompt_tokens,
                          score_id="score-" + hex_id, created=created)


@dataclass(frozen=True, kw_only=True)
class ScoreInput(PooledInput):
    """What the engine gets for one rerank or score line, and how its output is read back."""

    score: ScoreReadBack
    encoding_format: None = None


def _field(args: ScoreArgs, side: int, index: int) -> tuple[str, str]:
    """The body field of text ``index`` of ``text_1`` (side 1) or ``text_2`` (side 2), and its
    name as a param: ``body.documents[3]``, ``documents``."""
    if args["kind"] == "rerank":
        return ("body.query", "query") if side == 1 else (f"body.documents[{index}]",
                                                          "documents")
    name = f"text_{side}"
    many = len(args["text_1"] if side == 1 else args["text_2"]) > 1
    return (f"body.{name}[{index}]" if many else f"body.{name}"), name


def _error(exc: EmbeddingInputError, field: str, param: str, paired: str = "") -> PrepareError:
    code = CONTEXT_LENGTH_EXCEEDED if isinstance(exc, InputTooLong) else INVALID_VALUE
    return PrepareError(code, f"{field}{paired}: {exc}", param)


def prepare_score(engine: Engine, args: ScoreArgs) -> ScoreInput | PrepareError:
    """A rerank or score line's engine input, checked by the engine once: a cross-encoder's
    pairs, or an embedding model's texts."""
    texts_1, texts_2 = args["text_1"], args["text_2"]
    documents = (tuple(texts_2) if args["kind"] == "rerank" and args["return_documents"]
                 else None)
    spec = engine.embedding
    if spec is not None and spec.cross_encoder:
        encoded: dict[str, list[int]] = {}

        def ids(text: str) -> list[int]:
            if text not in encoded:
                encoded[text] = engine.encode(text)
            return encoded[text]

        pairs = [pair_token_ids(ids(texts_1[0] if len(texts_1) == 1 else texts_1[i]), ids(b))
                 for i, b in enumerate(texts_2)]
        params = PoolingParams(token_type_starts=tuple(start for _, start in pairs))
        try:
            checked = engine.check_embedding([p for p, _ in pairs], params)
        except EmbeddingInputError as exc:
            index = exc.index or 0
            field, param = _field(args, 2, index)
            first, _ = _field(args, 1, 0 if len(texts_1) == 1 else index)
            return _error(exc, field, param, f" (paired with {first})")
        return ScoreInput(inputs=checked,
                          score=ScoreReadBack(args["kind"], None, args["top_n"], documents))
    num_1 = len(texts_1)
    try:
        checked = engine.check_embedding([*texts_1, *texts_2], PoolingParams())
    except EmbeddingInputError as exc:
        index = exc.index or 0
        side, at = (1, index) if index < num_1 else (2, index - num_1)
        return _error(exc, *_field(args, side, at))
    vector_pairs = tuple((0 if num_1 == 1 else i, num_1 + i) for i in range(len(texts_2)))
    return ScoreInput(inputs=checked, score=ScoreReadBack(args["kind"], vector_pairs, args["top_n"],
                                             documents))
