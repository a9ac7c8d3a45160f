"""SamplingColumns: the sampled rows' parameters as numpy columns, one row a request.

The sampler decides per row: which rows are greedy, which are penalized, biased or constrained,
which ask for logprobs, each row's temperature, top-k, top-p and min-p. Read from each request's
``SamplingParams`` every step, that is a dozen Python passes over the batch (~3 us a row at
1,024 rows). The persistent batch keeps each running request's row of these columns in its slot,
written once when the request takes the slot, and a step gathers the rows it samples with one
numpy index (``PersistentBatch.prepare``); ``of`` builds them from the requests for the other
callers. The sampler then selects rows and builds its per-row tensors with numpy.

Every field is a float64 (ints up to 2**53 exactly); a request's values never change while it
runs, so its row is written once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.core.request import Request
from engine.runner.draw import on_device

# The columns, in order.
TEMPERATURE, TOP_K, TOP_P, MIN_P, LOGPROBS, MIN_TOKENS = range(6)
REPETITION, PRESENCE, FREQUENCY, SEEDED, PLAIN = range(6, 11)
NUM_FIELDS = 11


def row_of(request: Request) -> tuple[float, ...]:
    """The request's row: top_k 0 for none, logprobs -1 for none, SEEDED and PLAIN (no
    logit_bias, no grammar) 1 or 0."""
    p = request.sampling_params
    return (p.temperature, p.top_k or 0, p.top_p, p.min_p,
            -1 if p.logprobs is None else p.logprobs, p.min_tokens,
            p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            request.seed is not None, p.plain_logits)


@dataclass
class SamplingColumns:
    values: np.ndarray  # [rows, NUM_FIELDS] float64

    @classmethod
    def of(cls, requests: list[Request]) -> SamplingColumns:
        values = np.array([row_of(r) for r in requests], dtype=np.float64)
        return cls(values.reshape(len(requests), NUM_FIELDS))

    def __len__(self) -> int:
        return self.values.shape[0]

    def take(self, rows: list[int] | np.ndarray) -> SamplingColumns:
        """These rows' columns (a copy)."""
        return SamplingColumns(self.values[rows])

    def column(self, field: int) -> np.ndarray:
        """One field over the rows, contiguous."""
        return np.ascontiguousarray(self.values[:, field])

    def tensor(self, field: int, device: torch.device) -> torch.Tensor:
        """One field over the rows as float32 on ``device`` (what a float32 tensor of the
        Python values gives), copied without blocking."""
        return on_device(self.column(field), torch.float32, device)

    @property
    def greedy(self) -> np.ndarray:
        return self.values[:, TEMPERATURE] == 0.0

    @property
    def penalized(self) -> np.ndarray:
        v = self.values
        return (v[:, REPETITION] != 1.0) | (v[:, PRESENCE] != 0.0) | (v[:, FREQUENCY] != 0.0)

    @property
    def plain(self) -> np.ndarray:
        return self.values[:, PLAIN] != 0.0

    @property
    def argmax_only(self) -> np.ndarray:
        """``SamplingParams.argmax_only`` a row: greedy, no logprobs, plain, not penalized."""
        return self.greedy & (self.values[:, LOGPROBS] < 0) & self.plain & ~self.penalized
