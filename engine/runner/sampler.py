"""Sampler: logits -> next tokens, with per-request parameters applied as batched tensor ops.

Order: logit_bias, the structured-output grammar mask (one bitmask for the batch), penalties
(repetition, presence, frequency), min_tokens masking, then greedy argmax or temperature ->
top-k -> top-p -> min-p -> a draw. Logprobs are taken from the model's distribution after
logit_bias and the grammar mask, before penalties and temperature (for a request with neither,
the raw model distribution); tokens the mask or a -inf logit rule out are never listed among the
top alternatives.
Temperature, top-k, top-p, min-p and the draw: ``engine.runner.draw``.

It runs where the logits are (``sample``): the per-request parameters, indices and masks are
built on the host and copied to the logits' device without blocking, the seeded requests'
uniforms included (drawn on the host: ``seeded_uniforms``), and the structured-output bitmask is
filled on the host and copied the same way. The result stays there: greedy rows, the
whole-vocabulary draw, penalties, logit_bias and min_tokens never wait for the device; a
top-k / top-p row does once (``draw.draw_truncated``). The caller brings the ids to the host in
one crossing (``to_host``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.core.request import Request
from engine.core.structured_output import apply_grammar_masks
from engine.outputs import TokenLogprob
from engine.runner.draw import draw_from_vocab, draw_truncated, on_device, take_rows
from engine.runner.penalties import PenaltyCounts
from engine.runner.sampling_columns import (
    FREQUENCY,
    LOGPROBS,
    MIN_P,
    MIN_TOKENS,
    PRESENCE,
    REPETITION,
    SEEDED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    SamplingColumns,
)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows] int64: each row's argmax, the first of equal maxima (a NaN
    counting as the largest), as ``logits.argmax(-1)``. Host fp32 logits take numpy's, which
    is vectorized where torch's CPU reduction is not: ~10x faster at 1,024 rows of 1,024
    tokens, most of a greedy step's sampling (issue 46)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(-1)
    return torch.from_numpy(logits.detach().numpy().argmax(-1))


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the host, in one crossing: on a GPU each is copied without blocking into
    pinned memory, then the host waits once, for an event recorded after those copies; tensors
    on the CPU are returned as they are."""
    if all(t.device.type == "cpu" for t in tensors):
        return tensors
    if any(t.device.type != "cuda" for t in tensors):
        return [t.cpu() for t in tensors]
    copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
              for t in tensors]
    copied = torch.cuda.Event()
    copied.record()
    copied.synchronize()
    return copies


@dataclass
class SampledTokens:
    """A sampler call's result, where the logits were: nothing in it has crossed to the host."""

    token_ids: torch.Tensor  # [num_rows] int64
    logprob_rows: list[int]  # the rows that asked for logprobs, increasing
    num_tops: list[int]  # each such row's number of top alternatives
    # [len(logprob_rows), 1 + 2 * max_top] float64: the chosen token's log-probability, the top
    # values, their token ids (exact in float64), so they cross in one copy; None without rows
    logprobs: torch.Tensor | None

    def cross(self, tokens: torch.Tensor | None = None, rows: list[int] | None = None
              ) -> tuple[list[int], list[TokenLogprob | None]]:
        """The ids and the logprobs on the host, in one crossing: ``token_ids``, or ``tokens``, a
        batch's ids holding these at ``rows``; every id of what crossed, then the logprobs of
        these rows (None where a row asked for none)."""
        tokens = self.token_ids if tokens is None else tokens
        host = to_host([tokens] if self.logprobs is None else [tokens, self.logprobs])
        token_ids = host[0].tolist()
        mine = token_ids if rows is None else [token_ids[i] for i in rows]
        logprobs: list[TokenLogprob | None] = [None] * len(mine)
        if len(host) == 1:
            return token_ids, logprobs
        max_top = (host[1].shape[-1] - 1) // 2
        for i, num_top, packed in zip(self.logprob_rows, self.num_tops, host[1].tolist(),
                                      strict=True):
            num_top = min(num_top, max_top)
            values = packed[1: 1 + num_top]
            ids = packed[1 + max_top: 1 + max_top + num_top]
            top = [(int(t), v) for t, v in zip(ids, values, strict=True) if v != float("-inf")]
            logprobs[i] = TokenLogprob(mine[i], packed[0], top)
        return token_ids, logprobs


class Sampler:
    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        # On the host whatever the device, as the seeded requests' are: an engine seed draws
        # the same tokens on a CPU and a GPU.
        self.generator = torch.Generator().manual_seed(seed)
        self.penalty_counts = PenaltyCounts()

    @staticmethod
    def needs_full_logits(request: Request) -> bool:
        """False for a plain greedy request: its token is the argmax of the raw logits, which
        ``GreedyScreen`` finds without the full fp32 projection."""
        min_tokens = request.sampling_params.min_tokens
        return not request.argmax_only or (min_tokens > 0 and request.num_drawn < min_tokens)

    def __call__(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """``sample``, its result brought to the host in one crossing."""
        return self.sample(logits, requests).cross()

    def sample(self, logits: torch.Tensor, requests: list[Request],
               columns: SamplingColumns | None = None) -> SampledTokens:
        """The rows' tokens (and logprobs) on the logits' device. ``columns``: the requests'
        sampling columns where the caller has them (the persistent batch keeps them)."""
        # logits: [num_requests, vocab_size]
        if columns is None:
            columns = SamplingColumns.of(requests)
        logits = logits.float()
        if logits.shape[-1] > self.vocab_size:  # padded embedding rows are never real tokens
            logits = logits[:, : self.vocab_size]
        if not columns.plain.all():
            logits = logits.clone()
            self._apply_logit_bias(logits, requests, np.flatnonzero(~columns.plain).tolist())
            apply_grammar_masks(logits, requests)
        asked = columns.values[:, LOGPROBS]
        logprob_rows = np.flatnonzero(asked >= 0).tolist()
        raw_logprobs = None
        if logprob_rows:
            raw_logprobs = torch.log_softmax(take_rows(logits, logprob_rows), dim=-1)
        logits, penalized = self._apply_penalties(logits, requests, columns)
        logits = self._apply_min_tokens(logits, requests, columns)

        greedy = columns.greedy
        if greedy.all():
            token_ids = row_argmax(logits)
        elif not greedy.any():
            token_ids = self._sample(logits, requests, columns)
        else:
            greedy_rows = np.flatnonzero(greedy)
            random_rows = np.flatnonzero(~greedy)
            token_ids = torch.empty(len(requests), dtype=torch.int64, device=logits.device)
            index = on_device(greedy_rows, torch.int64, logits.device)
            token_ids.index_copy_(0, index, row_argmax(logits.index_select(0, index)))
            chosen = [requests[i] for i in random_rows.tolist()]
            index = on_device(random_rows, torch.int64, logits.device)
            token_ids.index_copy_(0, index, self._sample(logits.index_select(0, index), chosen,
                                                         columns.take(random_rows)))
        if penalized is not None:  # their rows count the tokens drawn (on the device)
            positions, rows = penalized
            self.penalty_counts.advance(rows, take_rows(token_ids, positions))
        else:
            self.penalty_counts.idle()
        # Seeded and min_tokens rows count their draws (``Request.num_drawn``): a seeded row is
        # sampled, so it always comes here; a min_tokens row does until it has drawn its
        # min_tokens, the plain greedy path's after that.
        counted = (columns.values[:, SEEDED] != 0.0) | (columns.values[:, MIN_TOKENS] > 0)
        for i in np.flatnonzero(counted).tolist():
            requests[i].num_drawn += 1
        num_tops = [int(n) for n in asked[logprob_rows]]
        return SampledTokens(token_ids, logprob_rows, num_tops,
                             _logprobs(raw_logprobs, token_ids, logprob_rows, num_tops))

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, requests: list[Request],
                          candidates: list[int]) -> None:
        """``candidates``: the rows that may have a bias (the others have none)."""
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i in candidates:
            bias = requests[i].sampling_params.logit_bias
            if bias:
                rows.extend([i] * len(bias))
                cols.extend(bias)
                values.extend(bias.values())
        if rows:
            device = logits.device
            logits.index_put_(
                (on_device(rows, torch.int64, device), on_device(cols, torch.int64, device)),
                on_device(values, logits.dtype, device),
                accumulate=True,
            )

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request],
                         columns: SamplingColumns
                         ) -> tuple[torch.Tensor, tuple[list[int], torch.Tensor] | None]:
        """The penalized logits, and (the penalized rows, their ``penalty_counts`` rows) for
        the tokens drawn to be counted; None where no row is penalized."""
        rows = np.flatnonzero(columns.penalized).tolist()
        if not rows:
            return logits, None
        logits = logits.clone()
        device = logits.device
        index = on_device(rows, torch.int64, device)
        sub = logits.index_select(0, index)
        count_rows, output_counts, seen = self.penalty_counts.gather(
            [requests[i] for i in rows], logits.shape[-1], device)

        chosen = columns.take(rows)
        rep, pres, freq = (chosen.tensor(field, device)[:, None]  # [len(rows), 1] each
                           for field in (REPETITION, PRESENCE, FREQUENCY))
        # Repetition (CTRL / Hugging Face): over prompt and output, divide positive logits and
        # multiply negative ones. Presence and frequency (OpenAI): over the output only.
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
        sub = sub - freq * output_counts - pres * (output_counts > 0).to(sub.dtype)
        logits.index_copy_(0, index, sub)
        return logits, (rows, count_rows)

    def _apply_min_tokens(self, logits: torch.Tensor, requests: list[Request],
                          columns: SamplingColumns) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        for i in np.flatnonzero(columns.values[:, MIN_TOKENS] > 0).tolist():
            request = requests[i]
            params = request.sampling_params
            if request.num_drawn >= params.min_tokens:
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
        device = logits.device
        logits.index_put_(
            (on_device(rows, torch.int64, device), on_device(cols, torch.int64, device)),
            logits.new_full((), float("-inf")),
        )
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request],
                columns: SamplingColumns) -> torch.Tensor:
        # logits: [num_rows, vocab], every row sampled (temperature > 0)
        vocab = logits.shape[-1]
        device = logits.device
        # [num_rows] float64, drawn on the host, copied over
        uniforms = self._uniforms(requests, columns).to(device, non_blocking=True)
        top_ks = columns.values[:, TOP_K].astype(np.int64)
        top_ks[top_ks >= vocab] = 0  # a top-k of the whole vocabulary keeps every token
        cut = (top_ks > 0) | (columns.values[:, TOP_P] < 1.0)
        truncated, whole = np.flatnonzero(cut), np.flatnonzero(~cut)

        drawn: list[tuple[np.ndarray, torch.Tensor]] = []
        if len(whole):
            chosen = columns.take(whole)
            drawn.append((whole, draw_from_vocab(
                take_rows(logits, whole.tolist()),
                chosen.tensor(TEMPERATURE, device)[:, None], chosen.column(MIN_P),
                take_rows(uniforms, whole.tolist()),
            )))
        if len(truncated):
            chosen = columns.take(truncated)
            drawn.append((truncated, draw_truncated(
                take_rows(logits, truncated.tolist()), top_ks[truncated],
                chosen.tensor(TOP_P, device), chosen.tensor(TEMPERATURE, device)[:, None],
                chosen.tensor(MIN_P, device), take_rows(uniforms, truncated.tolist()),
            )))
        if len(drawn) == 1:
            return drawn[0][1]
        token_ids = torch.empty(len(requests), dtype=torch.int64, device=device)
        for rows, ids in drawn:
            token_ids.index_copy_(0, on_device(rows, torch.int64, device), ids)
        return token_ids

    def _uniforms(self, requests: list[Request], columns: SamplingColumns) -> torch.Tensor:
        """One U[0, 1) per row, in float64 (a float32 one could never land on a token of
        probability under 2**-24). A seeded request takes the next of its own stream
        (``seeded_uniforms``), the others the engine's generator."""
        seeded_mask = columns.values[:, SEEDED] != 0.0
        seeded = np.flatnonzero(seeded_mask)
        uniforms = torch.empty(len(requests), dtype=torch.float64)
        if len(seeded) < len(requests):
            unseeded = np.flatnonzero(~seeded_mask)
            uniforms[torch.from_numpy(unseeded)] = torch.rand(
                len(unseeded), dtype=torch.float64, generator=self.generator
            )
        if len(seeded):
            chosen = [requests[i] for i in seeded.tolist()]
            draws = seeded_uniforms(
                np.fromiter((r.seed & _MASK64 for r in chosen), np.uint64, len(chosen)),  # type: ignore[operator]
                np.fromiter((r.num_drawn for r in chosen), np.uint64, len(chosen)))
            if len(seeded) == len(requests):
                return torch.from_numpy(draws)
            uniforms[torch.from_numpy(seeded)] = torch.from_numpy(draws)
        return uniforms


# SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014):
# the golden-ratio increment of its state and the two multipliers of its output function.
_MASK64 = (1 << 64) - 1  # a seed is any int: its low 64 bits key the stream
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 (arithmetic modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def seeded_uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """U[0, 1) in float64, the ``counters[i]``-th draw of the stream of ``seeds[i]`` (uint64
    each): SplitMix64's output number ``counter`` from the state ``mix(seed)``. A counter-based
    stream costs a few vector operations a batch, against a generator call a row (~5 us), and
    is the same on any device and in any batch."""
    with np.errstate(over="ignore"):
        state = _mix64(seeds + _GOLDEN)
        z = _mix64(state + (counters + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _logprobs(raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor, rows: list[int],
              num_tops: list[int]) -> torch.Tensor | None:
    """``SampledTokens.logprobs`` from the rows' log-probabilities ([len(rows), vocab])."""
    if raw_logprobs is None:
        return None
    chosen = raw_logprobs.gather(1, take_rows(token_ids, rows)[:, None])  # [len(rows), 1]
    max_top = min(max(num_tops), raw_logprobs.shape[-1])
    values, ids = raw_logprobs.topk(max_top, dim=-1)  # [len(rows), max_top] each
    return torch.cat([chosen.double(), values.double(), ids.double()], dim=1)

