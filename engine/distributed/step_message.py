"""What the driver sends the helpers each step: the scheduler output as deltas of what they hold.

vLLM's design: a helper keeps each request's tokens and block tables from the messages before
and gets only what changed (the tokens it has not seen, the block-table tail or, after a
preemption, the new table, the requests that are gone), never a tensor it can build itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request
from engine.outputs import ScheduledRequest
from engine.runner.input_batch import StepRow


@dataclass
class RowDelta:
    """One scheduled request as a helper needs it: what changed since the driver last sent it."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    sample: bool
    new_token_ids: list[int]  # appended to the helper's copy of the request's tokens
    num_blocks_kept: int  # the helper's block table keeps this many, then new_block_ids
    new_block_ids: list[int]
    num_window_blocks_kept: int
    new_window_block_ids: list[int]
    lora_name: str | None  # the adapter it runs under (None: the base model)


@dataclass
class StepMessage:
    rows: list[RowDelta]
    dropped_ids: list[str]  # requests that are gone: the helpers forget them


@dataclass
class ScoreMessage:
    token_ids: list[int]


@dataclass
class _Sent:
    """What the helpers hold of one request."""

    num_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    window_block_ids: list[int] = field(default_factory=list)


def _delta(sent: list[int], now: list[int]) -> tuple[int, list[int]]:
    """(how many of ``sent`` to keep, what follows them) to turn ``sent`` into ``now``."""
    keep = len(sent) if len(sent) <= len(now) and now[: len(sent)] == sent else 0
    return keep, now[keep:]


class StepMessages:
    """The driver's side: what the helpers hold of each request, and the next step's message."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def step(self, scheduled: list[ScheduledRequest],
             requests: dict[str, Request]) -> StepMessage:
        """``scheduled`` in the order the driver lays the step out (by adapter with LoRA on),
        so a helper lays it out the same."""
        dropped = [rid for rid in self._sent if rid not in requests]
        for rid in dropped:
            del self._sent[rid]
        rows = []
        for s in scheduled:
            request = requests[s.request_id]
            sent = self._sent.setdefault(s.request_id, _Sent())
            end = s.num_computed_tokens + s.num_new_tokens
            new_tokens = request.token_ids[sent.num_tokens:end]
            sent.num_tokens = max(sent.num_tokens, end)
            keep, tail = _delta(sent.block_ids, request.block_ids)
            window_keep, window_tail = _delta(sent.window_block_ids, request.window_block_ids)
            sent.block_ids = list(request.block_ids)
            sent.window_block_ids = list(request.window_block_ids)
            rows.append(RowDelta(s.request_id, s.num_computed_tokens, s.num_new_tokens,
                                 s.sample, new_tokens, keep, tail, window_keep, window_tail,
                                 request.lora_name))
        return StepMessage(rows, dropped)


class HeldRequests:
    """A helper's side: each request's tokens and block tables, as the messages built them."""

    def __init__(self) -> None:
        self.token_ids: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.window_block_ids: dict[str, list[int]] = {}

    def apply(self, message: StepMessage) -> list[StepRow]:
        """Take in the message; the step's rows, as the driver's requests would give them."""
        for rid in message.dropped_ids:
            self.token_ids.pop(rid, None)
            self.block_ids.pop(rid, None)
            self.window_block_ids.pop(rid, None)
        rows = []
        for d in message.rows:
            tokens = self.token_ids.setdefault(d.request_id, [])
            tokens.extend(d.new_token_ids)
            blocks = self.block_ids.get(d.request_id, [])[: d.num_blocks_kept] + d.new_block_ids
            window = (self.window_block_ids.get(d.request_id, [])[: d.num_window_blocks_kept]
                      + d.new_window_block_ids)
            self.block_ids[d.request_id] = blocks
            self.window_block_ids[d.request_id] = window
            rows.append(StepRow(tokens, blocks, window, d.num_computed_tokens,
                                d.num_new_tokens, d.sample))
        return rows
