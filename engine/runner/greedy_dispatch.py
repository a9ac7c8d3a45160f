"""Which sampled rows take the greedy screen and which the full fp32 logits, and their tokens.

Plain greedy rows need only an argmax: the screen (``layers/greedy_screen.py``) gives it without
the full output projection; without a screen it is taken on the device. Rows that need the
distribution (sampling, penalties, logprobs, masked tokens: ``Sampler.needs_full_logits``) get
the full logits and the sampler.
"""

from __future__ import annotations

import torch

from engine.core.request import Request
from engine.models.causal_lm import CausalLM
from engine.outputs import TokenLogprob
from engine.runner.greedy_screen import Screen
from engine.runner.sampler import Sampler, row_argmax


def sample_tokens(
    model: CausalLM, screen: Screen | None, sampler: Sampler,
    hidden: torch.Tensor,  # [len(requests), hidden_size]: each request's last row
    requests: list[Request],
) -> tuple[list[int], dict[str, TokenLogprob]]:
    logprobs: dict[str, TokenLogprob] = {}
    # A plain greedy row without min_tokens (most rows) is told apart without the call.
    full = [i for i, r in enumerate(requests) if not r.argmax_only or (
        r.sampling_params.min_tokens and Sampler.needs_full_logits(r))]
    if not full:  # every row plain greedy (most steps): the ids are the tokens, in order
        return _argmax(model, screen, sampler, hidden).tolist(), logprobs
    tokens: list[int] = [0] * len(requests)
    full_set = set(full)
    plain = [i for i in range(len(requests)) if i not in full_set]
    if screen is None:
        # One output-layer product for every row (split across ranks: one gather, the one each
        # helper rank joins), the plain rows' argmax taken where the logits are.
        logits = model.compute_logits(hidden)
        plain_ids = row_argmax(logits[:, : sampler.vocab_size])[plain]
        if plain:
            logits = logits[full]
    else:
        plain_ids = screen.argmax(hidden[plain])
        logits = model.compute_logits(hidden[full] if plain else hidden)
    for i, token in zip(plain, plain_ids.tolist(), strict=True):
        tokens[i] = token
    full_requests = [requests[i] for i in full]
    token_ids, row_logprobs = sampler(logits.float().cpu(), full_requests)
    for i, request, token, lp in zip(full, full_requests, token_ids, row_logprobs,
                                     strict=True):
        tokens[i] = token
        if lp is not None:
            logprobs[request.request_id] = lp
    return tokens, logprobs


def _argmax(model: CausalLM, screen: Screen | None, sampler: Sampler,
            rows: torch.Tensor) -> torch.Tensor:
    """Plain greedy rows' tokens: the screen's exact argmax on a CPU, else the argmax where the
    logits are (a GPU: only the ids cross to the host, not [rows, vocab] fp32 for the sampler);
    padded vocabulary rows are never tokens."""
    if screen is not None:
        return screen.argmax(rows)
    return row_argmax(model.compute_logits(rows)[:, : sampler.vocab_size])
