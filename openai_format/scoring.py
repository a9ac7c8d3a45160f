"""Rerank and score lines: the request bodies (``RerankRequest``: Cohere's and Jina's
/v1/rerank; ``ScoreRequest``: vLLM's /v1/score) and their response objects (``rerank_body``,
``score_body``).

/v1/rerank scores one ``query`` against each of its ``documents`` (strings, or ``{"text"}``
objects as Cohere and Jina also take) and answers the documents by relevance, highest first,
cut to ``top_n``, each with its ``index`` in the request and, unless ``return_documents`` is
false, its ``document``. /v1/score pairs ``text_1`` with ``text_2`` as vLLM does: one text and
one text, one text and a list (1-to-N), or two lists of equal length (N-to-N); it answers one
score per pair, in pair order. Both are served by a cross-encoder (one score per pair) or an
embedding model (the cosine of the two texts' embeddings); which model kind serves what is the
pipeline's and the service's to check.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import model_validator

from openai_format.embeddings import MAX_EMBEDDING_INPUTS
from openai_format.types import PositiveInt, _Body, _invalid, _one_of_shapes, _Strict

# Cohere's limit on a rerank request's documents.
MAX_RERANK_DOCUMENTS = 1000
# The most pairs one /v1/score line holds (the embeddings' input limit).
MAX_SCORE_PAIRS = MAX_EMBEDDING_INPUTS

ScoreKind = Literal["rerank", "score"]


class RerankDocument(_Strict):
    text: str


Document = Annotated[str | RerankDocument, _one_of_shapes("a string or an object with text")]
ScoreText = Annotated[str | list[str], _one_of_shapes("a string or a list of strings")]


class RerankRequest(_Body):
    model: str | None = None  # the batch's model; the worker serves the one it has loaded
    query: str
    documents: list[Document]
    top_n: PositiveInt | None = None
    return_documents: bool | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> RerankRequest:
        if not self.query:
            raise _invalid("body.query must not be an empty string")
        if not self.documents:
            raise _invalid("body.documents must not be empty")
        if len(self.documents) > MAX_RERANK_DOCUMENTS:
            raise _invalid(f"body.documents must hold at most {MAX_RERANK_DOCUMENTS} documents, "
                           f"got {len(self.documents)}")
        for index, text in enumerate(self.texts()):
            if not text:
                raise _invalid(f"body.documents[{index}] must not be an empty string")
        return self

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    @property
    def num_pairs(self) -> int:
        return len(self.documents)


class ScoreRequest(_Body):
    model: str | None = None
    text_1: ScoreText
    text_2: ScoreText
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ScoreRequest:
        for name, texts in (("text_1", self.texts_1()), ("text_2", self.texts_2())):
            if not texts:
                raise _invalid(f"body.{name} must not be empty")
            for index, text in enumerate(texts):
                if not text:
                    where = f"body.{name}[{index}]" if isinstance(getattr(self, name), list) \
                        else f"body.{name}"
                    raise _invalid(f"{where} must not be an empty string")
        num_1, num_2 = len(self.texts_1()), len(self.texts_2())
        if num_1 != 1 and num_1 != num_2:
            raise _invalid(f"body.text_1 holds {num_1} texts and body.text_2 {num_2}: give one "
                           "text_1 to score against every text_2, or as many as text_2 to "
                           "score pair by pair")
        if num_2 > MAX_SCORE_PAIRS:
            raise _invalid(f"body.text_2 must hold at most {MAX_SCORE_PAIRS} texts, got {num_2}")
        return self

    def texts_1(self) -> list[str]:
        return [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)

    def texts_2(self) -> list[str]:
        return [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)

    @property
    def num_pairs(self) -> int:
        return len(self.texts_2())


def _usage(prompt_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


def score_body(scores: list[float], *, model: str, prompt_tokens: int, score_id: str,
               created: int) -> dict[str, Any]:
    """vLLM's /v1/score response: one score per pair, in pair order."""
    return {
        "id": score_id, "object": "list", "created": created, "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": _usage(prompt_tokens),
    }


def rerank_body(scores: list[float], *, documents: list[str] | None, top_n: int | None,
                model: str, prompt_tokens: int, rerank_id: str) -> dict[str, Any]:
    """Cohere's and Jina's /v1/rerank response: the documents by relevance, highest first (ties
    in request order), cut to ``top_n``; each with its ``document`` unless ``documents`` is
    None."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if documents is not None:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": rerank_id, "model": model, "results": results, "usage": _usage(prompt_tokens)}
