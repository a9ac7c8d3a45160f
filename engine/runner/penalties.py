"""PenaltyCounts: the penalized requests' token counts, kept where the logits are across steps.

Repetition, presence and frequency penalties need, per request and token, whether the token is
in the prompt and how often it is in the output. Recounting both each step costs the host a pass
over every penalized request's whole context (a list of ids built and copied: ~25 ms a step for
1,024 requests of 560 tokens), and needs the output on the host, so a penalized request used to
make async scheduling's steps synchronous. Here each request holds a row of two tensors on the
logits' device instead: counted once when it first samples (its prompt; an output it has then:
none, in an engine), then advanced by the sampler itself with the token each step samples for it,
a scatter from the sampled-token tensor that never reads the host (``advance``).

That equals a recount because every token a step samples for an unfinished request becomes its
next output token (a preempted request keeps the token of a step in flight and recomputes it;
``Scheduler.update_from_output``), and a finished request's row is never read again. Rows are
keyed by the request object, not its id (an id is reused after a finish). The rows of finished
requests are taken back when a step's new requests find none free (never one of that step's),
and all of them, tensors included, at a step without penalized rows (``idle``). The rows grow by
half: never past 1.5x the penalized requests alive at once. A row costs 5 bytes a vocabulary
entry, ~250 KB for a 49,152-token vocabulary, 640 KB for 128,256.
"""

from __future__ import annotations

import itertools

import torch

from engine.core.request import PLACEHOLDER_TOKEN_ID, Request
from engine.runner.draw import on_device

INITIAL_ROWS = 8


class PenaltyCounts:
    def __init__(self) -> None:
        self._reset(0)

    def _reset(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.output_counts: torch.Tensor | None = None  # [rows, vocab] float32
        self.in_prompt: torch.Tensor | None = None  # [rows, vocab] bool
        # id(request) -> (its row, the request: held, so the id is never another's meanwhile)
        self._rows: dict[int, tuple[int, Request]] = {}
        self._free: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def gather(self, requests: list[Request], vocab_size: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the requests' rows: [len(requests)] int64 on ``device``, their output counts
        [len(requests), vocab_size] float32, and the same in bool: in the prompt or the
        output). A request seen for the first time gets a row, counted from its tokens."""
        if self.output_counts is None or (self.output_counts.device, self.vocab_size) != (
                device, vocab_size):
            self._reset(vocab_size)  # the first call, or logits of another width or device
        new = [r for r in requests if id(r) not in self._rows]
        if len(new) > len(self._free):
            self._release_finished(keep={id(r) for r in requests})
        if len(new) > len(self._free):
            self._grow(len(new) - len(self._free), device)
        for request in new:
            self._rows[id(request)] = (self._free.pop(), request)
        if new:
            self._count_fresh(new, device)
        assert self.output_counts is not None and self.in_prompt is not None
        index = on_device([self._rows[id(r)][0] for r in requests], torch.int64, device)
        counts = self.output_counts.index_select(0, index)
        return index, counts, self.in_prompt.index_select(0, index) | (counts > 0)

    def advance(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count each row's sampled token (``rows`` from ``gather``; both on the device)."""
        assert self.output_counts is not None
        real = token_ids < self.vocab_size  # padded vocabulary rows are never tokens
        self.output_counts.index_put_((rows, token_ids.clamp(max=self.vocab_size - 1)),
                                      real.to(self.output_counts.dtype), accumulate=True)

    @property
    def _capacity(self) -> int:
        return 0 if self.output_counts is None else self.output_counts.shape[0]

    def idle(self) -> None:
        """A step without penalized rows: the finished requests' rows are given back, and the
        tensors too once no row is left (a GPU's memory is the KV cache's)."""
        if self._rows:
            self._release_finished(keep=set())
        if not self._rows and self.output_counts is not None:
            self._reset(self.vocab_size)

    def _grow(self, needed: int, device: torch.device) -> None:
        """Room for ``needed`` more rows, and half as many again as there are (each growth
        copies the rows: a few as a batch ramps up)."""
        old = self._capacity
        new = max(INITIAL_ROWS, old + needed, old + old // 2)
        counts = torch.zeros(new, self.vocab_size, device=device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=device)
        if self.output_counts is not None and self.in_prompt is not None:
            counts[:old] = self.output_counts
            in_prompt[:old] = self.in_prompt
        self.output_counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))  # popped lowest first

    def _release_finished(self, keep: set[int]) -> None:
        for key, (row, request) in list(self._rows.items()):
            if request.is_finished and key not in keep:
                del self._rows[key]
                self._free.append(row)

    def _count_fresh(self, requests: list[Request], device: torch.device) -> None:
        """Rows counted from the requests' prompts and outputs (the placeholders of steps in
        flight left out: the sampler counts their tokens when it draws them)."""
        assert self.output_counts is not None and self.in_prompt is not None
        rows = [self._rows[id(r)][0] for r in requests]
        index = on_device(rows, torch.int64, device)
        self.output_counts.index_fill_(0, index, 0.0)
        self.in_prompt.index_fill_(0, index, False)
        for target, lists in ((self.output_counts, [r.output_token_ids for r in requests]),
                              (self.in_prompt, [r.prompt_token_ids for r in requests])):
            ids = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
            owners = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64),
                                             torch.tensor([len(t) for t in lists]))
            real = (ids < self.vocab_size) & (ids != PLACEHOLDER_TOKEN_ID)
            target.index_put_((owners[real].to(device, non_blocking=True),
                               ids[real].to(device, non_blocking=True)),
                              target.new_ones(()), accumulate=target.dtype != torch.bool)
