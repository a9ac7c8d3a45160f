"""Sampler: logits -> next tokens, with per-request parameters applied as batched tensor ops.

Order: logit_bias, the structured-output grammar mask (one bitmask for the batch), penalties
(repetition, presence, frequency), min_tokens masking, then greedy argmax or temperature ->
top-k -> top-p -> min-p -> a draw. Logprobs are taken from the model's distribution after
logit_bias and the grammar mask, before penalties and temperature (for a request with neither,
the raw model distribution); tokens the mask or a -inf logit rule out are never listed among the
top alternatives.
Temperature, top-k, top-p, min-p and the draw: ``engine.runner.draw``.
"""

from __future__ import annotations

import itertools

import torch

from engine.core.request import Request
from engine.core.structured_output import apply_grammar_masks
from engine.outputs import TokenLogprob
from engine.runner.draw import draw_from_vocab, draw_truncated, take_rows


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows] int64: each row's argmax, the first of equal maxima (a NaN
    counting as the largest), as ``logits.argmax(-1)``. Host fp32 logits take numpy's, which
    is vectorized where torch's CPU reduction is not: ~10x faster at 1,024 rows of 1,024
    tokens, most of a greedy step's sampling (issue 46)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(-1)
    return torch.from_numpy(logits.detach().numpy().argmax(-1))


class Sampler:
    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def needs_full_logits(request: Request) -> bool:
        """False for a plain greedy request: its token is the argmax of the raw logits, which
        ``GreedyScreen`` finds without the full fp32 projection."""
        min_tokens = request.sampling_params.min_tokens
        return not request.argmax_only or (min_tokens > 0
                                           and request.num_output_tokens < min_tokens)

    def __call__(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        # logits: [num_requests, vocab_size]
        logits = logits.float()
        if logits.shape[-1] > self.vocab_size:  # padded embedding rows are never real tokens
            logits = logits[:, : self.vocab_size]
        if any(not r.sampling_params.plain_logits for r in requests):
            logits = logits.clone()
            self._apply_logit_bias(logits, requests)
            apply_grammar_masks(logits, requests)
        logprob_rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw_logprobs = torch.log_softmax(take_rows(logits, logprob_rows), dim=-1)
        logits = self._apply_penalties(logits, requests)
        logits = self._apply_min_tokens(logits, requests)

        token_ids = torch.empty(len(requests), dtype=torch.int64)
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if greedy_rows:
            token_ids[greedy_rows] = row_argmax(take_rows(logits, greedy_rows))
        if random_rows:
            chosen = [requests[i] for i in random_rows]
            token_ids[random_rows] = self._sample(take_rows(logits, random_rows), chosen)
        ids = token_ids.tolist()
        return ids, self._logprobs(raw_logprobs, logprob_rows, requests, ids)

    @staticmethod
    def _logprobs(
        raw_logprobs: torch.Tensor | None, rows: list[int], requests: list[Request],
        ids: list[int],
    ) -> list[TokenLogprob | None]:
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is None:
            return logprobs
        # raw_logprobs: [len(rows), vocab]
        chosen = raw_logprobs.gather(1, torch.tensor([[ids[i]] for i in rows])).squeeze(1)
        num_tops = [requests[i].sampling_params.logprobs or 0 for i in rows]
        top_values: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        max_top = min(max(num_tops), raw_logprobs.shape[-1])
        if max_top > 0:
            values, indices = raw_logprobs.topk(max_top, dim=-1)
            top_values, top_ids = values.tolist(), indices.tolist()
        for j, (i, logprob) in enumerate(zip(rows, chosen.tolist(), strict=True)):
            top = [(t, v) for t, v in zip(top_ids[j][: num_tops[j]], top_values[j][: num_tops[j]],
                                         strict=True) if v != float("-inf")]
            logprobs[i] = TokenLogprob(ids[i], logprob, top)
        return logprobs

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, request in enumerate(requests):
            bias = request.sampling_params.logit_bias
            if bias:
                rows.extend([i] * len(bias))
                cols.extend(bias)
                values.extend(bias.values())
        if rows:
            logits.index_put_(
                (torch.tensor(rows), torch.tensor(cols)),
                torch.tensor(values, dtype=logits.dtype),
                accumulate=True,
            )

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [
            i for i, r in enumerate(requests)
            if r.sampling_params.repetition_penalty != 1.0
            or r.sampling_params.presence_penalty != 0.0
            or r.sampling_params.frequency_penalty != 0.0
        ]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        sub = logits[rows]
        output_counts = _token_counts([requests[i].output_token_ids for i in rows], vocab)
        seen = _token_counts([requests[i].prompt_token_ids for i in rows], vocab) > 0
        seen |= output_counts > 0
        rep = torch.tensor([requests[i].sampling_params.repetition_penalty for i in rows])[:, None]
        pres = torch.tensor([requests[i].sampling_params.presence_penalty for i in rows])[:, None]
        freq = torch.tensor([requests[i].sampling_params.frequency_penalty for i in rows])[:, None]
        # Repetition (CTRL / Hugging Face): over prompt and output, divide positive logits and
        # multiply negative ones. Presence and frequency (OpenAI): over the output only.
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
        sub = sub - freq * output_counts - pres * (output_counts > 0).to(sub.dtype)
        logits[rows] = sub
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        for i, request in enumerate(requests):
            params = request.sampling_params
            if request.num_output_tokens >= params.min_tokens:
                continue
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned.extend(request.eos_token_ids)
            banned = [t for t in banned if t < logits.shape[-1]]
            rows.extend([i] * len(banned))
            cols.extend(banned)
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        # logits: [num_rows, vocab], every row sampled (temperature > 0)
        params = [r.sampling_params for r in requests]
        vocab = logits.shape[-1]
        temperatures = torch.tensor([p.temperature for p in params])[:, None]
        min_ps = torch.tensor([p.min_p for p in params])
        uniforms = self._uniforms(requests)
        top_ks = [p.top_k if p.top_k is not None and p.top_k < vocab else None for p in params]
        truncated = [i for i, p in enumerate(params) if top_ks[i] is not None or p.top_p < 1.0]
        whole = [i for i, p in enumerate(params) if top_ks[i] is None and p.top_p == 1.0]
        token_ids = torch.empty(len(requests), dtype=torch.int64)
        if whole:
            token_ids[whole] = draw_from_vocab(
                take_rows(logits, whole), temperatures[whole], min_ps[whole], uniforms[whole]
            )
        if truncated:
            token_ids[truncated] = draw_truncated(
                take_rows(logits, truncated), [top_ks[i] for i in truncated],
                torch.tensor([params[i].top_p for i in truncated]), temperatures[truncated],
                min_ps[truncated], uniforms[truncated],
            )
        return token_ids

    def _uniforms(self, requests: list[Request]) -> torch.Tensor:
        """One U[0, 1) per row, in float64 (a float32 one could never land on a token of
        probability under 2**-24). A seeded request takes exactly one from its own generator."""
        uniforms = torch.empty(len(requests), dtype=torch.float64)
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if unseeded:
            uniforms[unseeded] = torch.rand(
                len(unseeded), dtype=torch.float64, generator=self.generator
            )
        for i, request in enumerate(requests):
            if request.generator is not None:
                uniforms[i] = float(torch.rand((), dtype=torch.float64,
                                               generator=request.generator))
        return uniforms


def _token_counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """How often each id occurs in each list (ids past the vocabulary are never real tokens)."""
    counts = torch.zeros(len(token_lists), vocab)  # [num_lists, vocab]
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.tensor([len(t) for t in token_lists]))
    real = ids < vocab
    counts.index_put_((rows[real], ids[real]), torch.ones(()), accumulate=True)
    return counts
