"""The bf16 quality gates: how often a lower-precision runner picks a reference runner's tokens,
and how close its embeddings are to the reference's.

Teacher forcing: the reference (fp32) runner's greedy outputs are fed, token by token, through
both runners (``ModelRunner.score_tokens``, one prefill pass per sequence); at each output
position the candidate's top-1 token is compared with the token the reference chose, and the
two runners' log-probabilities of that token are compared. Free-running generation would
diverge after the first differing token and count every later position against the candidate;
teacher forcing counts each position once, on the same context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AgreementReport:
    num_positions: int
    num_agreeing: int
    # mean over positions of |log p_candidate(token) - log p_reference(token)|
    mean_abs_delta_logprob: float
    max_abs_delta_logprob: float

    @property
    def agreement(self) -> float:
        return self.num_agreeing / self.num_positions if self.num_positions else 1.0


class _Scorer(Protocol):
    def score_tokens(self, token_ids: list[int]) -> torch.Tensor: ...


def teacher_forced_agreement(
    reference: _Scorer,
    candidate: _Scorer,
    sequences: Sequence[tuple[list[int], list[int]]],
) -> AgreementReport:
    """``sequences``: (prompt token ids, the reference's greedy output token ids) pairs."""
    positions = agreeing = 0
    total_delta = max_delta = 0.0
    for prompt_ids, output_ids in sequences:
        if not prompt_ids or not output_ids:
            raise ValueError("each sequence needs a prompt and at least one output token")
        token_ids = [*prompt_ids, *output_ids]
        # row i predicts token i + 1: the outputs are predicted by rows len(prompt) - 1 onwards
        first = len(prompt_ids) - 1
        ref = reference.score_tokens(token_ids)[first:]
        cand = candidate.score_tokens(token_ids)[first:]
        if ref.shape != cand.shape:
            raise ValueError("the runners' vocabularies differ: "
                             f"{ref.shape[-1]} against {cand.shape[-1]}")
        rows = torch.arange(len(output_ids))
        chosen = torch.tensor(output_ids, dtype=torch.int64)
        delta = (cand[rows, chosen] - ref[rows, chosen]).abs()
        agreeing += int((cand.argmax(dim=-1) == chosen).sum())
        positions += len(output_ids)
        total_delta += float(delta.sum())
        max_delta = max(max_delta, float(delta.max()))
    return AgreementReport(positions, agreeing, total_delta / max(positions, 1), max_delta)


class _Embedder(Protocol):
    def embed(self, token_ids: list[list[int]]) -> torch.Tensor: ...


@dataclass(frozen=True)
class EmbeddingAgreement:
    """Cosine similarity of a candidate's embeddings to a reference's, over a probe corpus."""

    num_inputs: int
    min_cosine: float
    mean_cosine: float
    threshold: float

    @property
    def passed(self) -> bool:
        return self.min_cosine >= self.threshold


def embedding_agreement(reference: _Embedder, candidate: _Embedder,
                        token_ids: list[list[int]], *, min_cosine: float) -> EmbeddingAgreement:
    """Every input embedded by both (one packed pass each); the gate passes when the worst
    input's cosine is at least ``min_cosine``."""
    if not token_ids:
        raise ValueError("the probe corpus is empty")
    ref = reference.embed(token_ids).double()
    cand = candidate.embed(token_ids).double()
    cosine = torch.nn.functional.cosine_similarity(ref, cand, dim=-1)
    return EmbeddingAgreement(len(token_ids), float(cosine.min()), float(cosine.mean()),
                              min_cosine)
