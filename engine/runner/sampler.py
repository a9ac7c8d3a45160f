"""Sampler: logits -> next tokens, with per-request parameters applied as batched tensor ops.

Order: logit_bias, the structured-output grammar mask (one bitmask for the batch), penalties
(repetition, presence, frequency), min_tokens masking, then greedy argmax or temperature ->
top-k -> top-p -> min-p -> a draw. A request with a seed draws from its own generator, one draw
per token, so its output never depends on what else is in the batch. Logprobs are taken from
the model's distribution after logit_bias and the grammar mask, before penalties and
temperature (for a request with neither, the raw model distribution); tokens the mask or a
-inf logit rule out are never listed among the top alternatives.
"""

from __future__ import annotations

import torch

from engine.core.request import Request
from engine.core.structured_output import apply_grammar_masks
from engine.outputs import TokenLogprob


class Sampler:
    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def needs_full_logits(request: Request) -> bool:
        """False for a plain greedy request: its token is the argmax of the raw logits, which
        ``GreedyScreen`` finds without the full fp32 projection."""
        params = request.sampling_params
        return (
            not params.greedy
            or params.logprobs is not None
            or not params.plain_logits
            or params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or request.num_output_tokens < params.min_tokens
        )

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
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, requests)
        logits = self._apply_min_tokens(logits, requests)

        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if random_rows:
            chosen = [requests[i] for i in random_rows]
            token_ids[random_rows] = self._sample(logits[random_rows], chosen)
        ids = token_ids.tolist()

        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for i, request in enumerate(requests):
                num_top = request.sampling_params.logprobs
                if num_top is None:
                    continue
                row = raw_logprobs[i]
                top: list[tuple[int, float]] = []
                if num_top > 0:
                    values, indices = row.topk(num_top)
                    top = [(t, v) for t, v in zip(indices.tolist(), values.tolist(), strict=True)
                           if v != float("-inf")]
                logprobs[i] = TokenLogprob(ids[i], float(row[ids[i]]), top)
        return ids, logprobs

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
        output_counts = torch.zeros_like(sub)
        seen = torch.zeros_like(sub, dtype=torch.bool)
        for j, i in enumerate(rows):
            request = requests[i]
            out = torch.tensor(request.output_token_ids, dtype=torch.int64)
            out = out[out < vocab]
            output_counts[j].index_add_(0, out, torch.ones_like(out, dtype=sub.dtype))
            prompt = torch.tensor(request.prompt_token_ids, dtype=torch.int64)
            seen[j, prompt[prompt < vocab]] = True
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
        masked = False
        for i, request in enumerate(requests):
            params = request.sampling_params
            if request.num_output_tokens >= params.min_tokens:
                continue
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned.extend(request.eos_token_ids)
            banned = [t for t in banned if t < logits.shape[-1]]
            if banned:
                if not masked:
                    logits = logits.clone()
                    masked = True
                logits[i, banned] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        temps = torch.tensor([r.sampling_params.temperature for r in requests])[:, None]
        logits = logits / temps
        top_ks = [r.sampling_params.top_k for r in requests]
        if any(k is not None for k in top_ks):
            vocab = logits.shape[-1]
            k = torch.tensor([min(k or vocab, vocab) for k in top_ks])
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_ps = torch.tensor([r.sampling_params.top_p for r in requests])
        if (top_ps < 1.0).any():
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always the first token).
            cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_sorted = cum_before >= top_ps[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(dim=-1)
        min_ps = torch.tensor([r.sampling_params.min_p for r in requests])
        if (min_ps > 0).any():
            threshold = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        # Gumbel-style draw: argmax(p / E) with E ~ Exp(1) samples from p; one noise row per
        # request from its own generator when it has a seed.
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                len(unseeded), probs.shape[-1]
            ).exponential_(generator=self.generator)
        for i, request in enumerate(requests):
            if request.generator is not None:
                noise[i].exponential_(generator=request.generator)
        return (probs / noise).argmax(dim=-1)
