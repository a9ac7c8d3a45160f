"""PenaltyCounts: the penalized requests' token counts, kept where the logits are across steps.

Repetition, presence and frequency penalties need, per request and token, whether the token is
in the prompt and how often it is in the output. Recounting both each step costs the host a pass
over every penalized request's whole context (a list of ids built and copied: ~25 ms a step for
1,024 requests of 560 tokens). Here each request holds a row of two tensors instead, counted in
full once, when it first samples, then advanced by the tokens it sampled since: one scatter a step
for the batch.

A penalized request runs its steps synchronously (``Request.needs_host_each_token``), so its
output on the host is complete when it samples. The rows of finished requests are taken back
when a new request finds none free, and the rows grow by doubling: never past twice the
penalized requests alive at once (a row costs 5 bytes a vocabulary entry, ~250 KB for a
49,152-token vocabulary).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.core.request import Request
from engine.runner.draw import on_device

INITIAL_ROWS = 8


@dataclass
class _Row:
    index: int
    # Held (until the row is released), so the id keying the row is never another request's.
    request: Request
    num_counted: int  # output tokens counted in the row


class PenaltyCounts:
    def __init__(self) -> None:
        self._reset(0)

    def _reset(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.output_counts: torch.Tensor | None = None  # [rows, vocab] float32
        self.in_prompt: torch.Tensor | None = None  # [rows, vocab] bool
        self._rows: dict[int, _Row] = {}  # id(request) -> its row
        self._free: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def gather(self, requests: list[Request], vocab_size: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """([len(requests), vocab_size] float32 output counts, the same in bool: in the prompt
        or the output), each request's row first brought up to its output so far."""
        if self.output_counts is None or (self.output_counts.device, self.vocab_size) != (
                device, vocab_size):
            self._reset(vocab_size)  # the first call, or logits of another width or device
        rows: list[int] = []
        fresh: list[tuple[int, Request]] = []
        add_rows: list[int] = []
        add_ids: list[int] = []
        for request in requests:
            entry = self._rows.get(id(request))
            num_output = request.num_output_tokens
            if entry is None:
                entry = self._allocate(request, device)
                fresh.append((entry.index, request))
            elif entry.num_counted < num_output:  # the tokens sampled since (one, mostly)
                new = request.token_ids[request.num_prompt_tokens + entry.num_counted:]
                add_rows.extend([entry.index] * len(new))
                add_ids.extend(new)
            elif entry.num_counted > num_output:  # never, as outputs only grow: recount
                fresh.append((entry.index, request))
            entry.num_counted = num_output
            rows.append(entry.index)
        assert self.output_counts is not None and self.in_prompt is not None
        if fresh:
            self._count_fresh(fresh, device)
        if add_rows:
            self._scatter(self.output_counts, add_rows, add_ids, device)
        index = on_device(rows, torch.int64, device)
        counts = self.output_counts.index_select(0, index)
        return counts, self.in_prompt.index_select(0, index) | (counts > 0)

    @property
    def _capacity(self) -> int:
        return 0 if self.output_counts is None else self.output_counts.shape[0]

    def _allocate(self, request: Request, device: torch.device) -> _Row:
        if not self._free:
            self._release_finished()
        if not self._free:
            self._grow(device)
        entry = _Row(self._free.pop(), request, 0)
        self._rows[id(request)] = entry
        return entry

    def _grow(self, device: torch.device) -> None:
        old = self._capacity
        new = max(INITIAL_ROWS, 2 * old)
        counts = torch.zeros(new, self.vocab_size, device=device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=device)
        if self.output_counts is not None and self.in_prompt is not None:
            counts[:old] = self.output_counts
            in_prompt[:old] = self.in_prompt
        self.output_counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))  # popped lowest first

    def _release_finished(self) -> None:
        for key, entry in list(self._rows.items()):
            if entry.request.is_finished:
                del self._rows[key]
                self._free.append(entry.index)

    def _count_fresh(self, fresh: list[tuple[int, Request]], device: torch.device) -> None:
        assert self.output_counts is not None and self.in_prompt is not None
        index = on_device([i for i, _ in fresh], torch.int64, device)
        self.output_counts.index_fill_(0, index, 0.0)
        self.in_prompt.index_fill_(0, index, False)
        outputs = [r.output_token_ids for _, r in fresh]
        self._scatter(self.output_counts,
                      list(itertools.chain.from_iterable([i] * len(o) for (i, _), o
                                                         in zip(fresh, outputs, strict=True))),
                      list(itertools.chain.from_iterable(outputs)), device)
        prompts = [r.prompt_token_ids for _, r in fresh]
        self._scatter(self.in_prompt,
                      list(itertools.chain.from_iterable([i] * len(p) for (i, _), p
                                                         in zip(fresh, prompts, strict=True))),
                      list(itertools.chain.from_iterable(prompts)), device)

    def _scatter(self, target: torch.Tensor, rows: list[int], ids: list[int],
                 device: torch.device) -> None:
        """``target[row, id] += 1`` (a bool target: set) for each pair; ids past the vocabulary
        are never real tokens."""
        row_t = torch.tensor(rows, dtype=torch.int64)
        id_t = torch.tensor(ids, dtype=torch.int64)
        real = id_t < self.vocab_size
        if not bool(real.all()):
            row_t, id_t = row_t[real], id_t[real]
        target.index_put_((row_t.to(device, non_blocking=True),
                           id_t.to(device, non_blocking=True)),
                          target.new_ones(()), accumulate=target.dtype != torch.bool)
