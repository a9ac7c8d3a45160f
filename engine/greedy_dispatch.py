"""Which sampled rows take the greedy screen and which the full fp32 logits, and their tokens.

Plain greedy rows need only an argmax: the screen (``layers/greedy_screen.py``) gives it without
the full output projection. Rows that need the distribution (sampling, penalties, logprobs,
masked tokens: ``Sampler.needs_full_logits``) get the full logits and the sampler.
"""

from __future__ import annotations

import torch

from engine.layers.greedy_screen import GreedyScreen
from engine.models.causal_lm import CausalLM
from engine.outputs import TokenLogprob
from engine.request import Request
from engine.sampler import Sampler


def sample_tokens(
    model: CausalLM, screen: GreedyScreen | None, sampler: Sampler,
    hidden: torch.Tensor,  # [len(requests), hidden_size]: each request's last row
    requests: list[Request],
) -> tuple[list[int], dict[str, TokenLogprob]]:
    tokens: list[int] = [0] * len(requests)
    logprobs: dict[str, TokenLogprob] = {}
    needs_full = [screen is None or Sampler.needs_full_logits(r) for r in requests]
    full = [i for i, f in enumerate(needs_full) if f]
    screened = [i for i, f in enumerate(needs_full) if not f]
    if screen is not None and screened:
        rows = hidden if not full else hidden[screened]
        for i, token in zip(screened, screen.argmax(rows).tolist(), strict=True):
            tokens[i] = token
    if full:
        full_requests = [requests[i] for i in full]
        rows = hidden if len(full) == len(requests) else hidden[full]
        logits = model.compute_logits(rows)
        token_ids, row_logprobs = sampler(logits.float().cpu(), full_requests)
        for i, request, token, lp in zip(full, full_requests, token_ids, row_logprobs,
                                         strict=True):
            tokens[i] = token
            if lp is not None:
                logprobs[request.request_id] = lp
    return tokens, logprobs
