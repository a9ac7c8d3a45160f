"""Which sampled rows take the greedy screen and which the full fp32 logits, and their tokens.

Plain greedy rows need only an argmax: the screen (``layers/greedy_screen.py``) gives it without
the full output projection; without a screen it is taken on the device. Rows that need the
distribution (sampling, penalties, logprobs, masked tokens: ``Sampler.needs_full_logits``) get
the full logits and the sampler, which runs where they are. Every row's token lands in one
tensor on the device, in request order (the next step's input ids are gathered from it), and
crosses to the host once, with the logprobs where rows asked for them
(``SampledTokens.cross``); the constrained rows' grammars take their tokens right after.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.core.request import Request
from engine.core.structured_output import accept_tokens
from engine.models.causal_lm import CausalLM
from engine.outputs import TokenLogprob
from engine.runner.draw import on_device
from engine.runner.greedy_screen import Screen
from engine.runner.sampler import Sampler, row_argmax, to_host
from engine.runner.sampling_columns import MIN_TOKENS, SamplingColumns


def sample_tokens(
    model: CausalLM, screen: Screen | None, sampler: Sampler,
    hidden: torch.Tensor,  # [len(requests), hidden_size]: each request's last row
    requests: list[Request], columns: SamplingColumns | None = None,
) -> tuple[torch.Tensor, list[int], dict[str, TokenLogprob]]:
    """(the tokens where they were sampled: [len(requests)] int64; their host copy; the
    logprobs of the requests that asked for them, by request id). ``columns``: the requests'
    sampling columns, where the caller has them (the persistent batch's)."""
    logprobs: dict[str, TokenLogprob] = {}
    if columns is None:
        columns = SamplingColumns.of(requests)
    # Rows that need the full logits: not plain greedy, or still short of their min_tokens.
    needs_full = ~columns.argmax_only
    for i in np.flatnonzero(~needs_full & (columns.values[:, MIN_TOKENS] > 0)).tolist():
        needs_full[i] = Sampler.needs_full_logits(requests[i])
    if not needs_full.any():  # every row plain greedy (most steps): the ids are the tokens
        sampler.penalty_counts.idle()
        tokens = _argmax(model, screen, sampler, hidden)
        return tokens, to_host([tokens])[0].tolist(), logprobs
    full = np.flatnonzero(needs_full).tolist()
    plain = np.flatnonzero(~needs_full).tolist()
    device = hidden.device
    full_index = on_device(full, torch.int64, device)
    plain_index = on_device(plain, torch.int64, device)
    if screen is None:
        # One output-layer product for every row (split across ranks: one gather, the one each
        # helper rank joins), the plain rows' argmax taken where the logits are.
        logits = model.compute_logits(hidden)
        plain_ids = row_argmax(logits[:, : sampler.vocab_size].index_select(0, plain_index))
        if plain:
            logits = logits.index_select(0, full_index)
    else:
        plain_ids = screen.argmax(hidden.index_select(0, plain_index))
        logits = model.compute_logits(hidden.index_select(0, full_index) if plain else hidden)
    full_requests = [requests[i] for i in full]
    sampled = sampler.sample(logits, full_requests, columns if not plain else columns.take(full))
    if plain:
        tokens = torch.empty(len(requests), dtype=torch.int64, device=device)
        tokens.index_copy_(0, plain_index, plain_ids)
        tokens.index_copy_(0, full_index, sampled.token_ids)
    else:
        tokens = sampled.token_ids
    token_ids, row_logprobs = sampled.cross(tokens, full)
    # The grammars advance here, where their tokens are drawn (constrained rows are not plain,
    # so never plain greedy): no step waits for the host's copy (async scheduling).
    constrained = np.flatnonzero(~columns.plain).tolist()
    if constrained:
        accept_tokens([requests[i] for i in constrained], [token_ids[i] for i in constrained])
    for request, lp in zip(full_requests, row_logprobs, strict=True):
        if lp is not None:
            logprobs[request.request_id] = lp
    return tokens, token_ids, logprobs


def _argmax(model: CausalLM, screen: Screen | None, sampler: Sampler,
            rows: torch.Tensor) -> torch.Tensor:
    """Plain greedy rows' tokens: the screen's exact argmax on a CPU, else the argmax where the
    logits are (a GPU: only the ids cross to the host, not [rows, vocab] fp32 for the sampler);
    padded vocabulary rows are never tokens."""
    if screen is not None:
        return screen.argmax(rows)
    return row_argmax(model.compute_logits(rows)[:, : sampler.vocab_size])
