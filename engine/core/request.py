"""Request: one sequence's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.outputs import RequestMetrics, TokenLogprob
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr

# Async scheduling: the token a step will sample, appended when the step is scheduled and
# replaced when its output comes back. Never a real id, so a leak fails loudly (an embedding
# lookup, a decode) instead of passing for a token.
PLACEHOLDER_TOKEN_ID = -1


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


_FINISHED = frozenset((RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED))


@dataclass(eq=False, slots=True)
class Request:
    """A single sequence. A user request with ``n > 1`` becomes n of these (``index`` 0..n-1).

    ``token_ids`` is prompt + output; the scheduler moves ``num_computed_tokens`` toward
    ``num_tokens``. A preempted request drops its blocks and recomputes from zero (or from its
    cached prefix).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    # Any of these ends the sequence (Llama 3 has several), unless ignore_eos.
    eos_token_ids: tuple[int, ...]
    metrics: RequestMetrics
    parent_id: str | None = None
    index: int = 0
    # Lower is more urgent (vLLM's convention); the scheduler orders by (priority, rank,
    # arrival). Only priority preempts and caps: rank orders requests of one priority.
    priority: int = 0
    rank: int = 0
    # A seeded request's own stream of uniforms (the sampler's ``seeded_uniforms``), so its
    # tokens never depend on the rest of the batch.
    seed: int | None = None
    # A seeded or min_tokens request's tokens drawn so far, counted by the sampler as it draws
    # them: its stream's position, and its output tokens (steps in flight included) without
    # the host's list (async scheduling).
    num_drawn: int = field(default=0, init=False)
    # The structured-output matcher: advanced once per sampled token, never on recompute.
    grammar: xgr.GrammarMatcher | None = None
    # The LoRA adapter it runs under (None: the base model); keys its prefix-cache blocks.
    lora_name: str | None = None
    # A pooling (embedding) request: prefill-only, scheduled whole, no KV blocks, one vector out.
    pooling_params: PoolingParams | None = None

    token_ids: list[int] = field(init=False)
    # Arrival order in the scheduler (set by Scheduler.add_request): breaks priority ties.
    arrival_seq: int = field(default=0, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    block_ids: list[int] = field(default_factory=list, init=False)
    # The sliding-window layers' block table, where they have their own (engine/core/window_kv.py).
    window_block_ids: list[int] = field(default_factory=list, init=False)
    # Chained hashes of this request's full blocks, computed as blocks fill.
    block_hashes: list[bytes] = field(default_factory=list, init=False)
    # How many of block_ids have been offered to the prefix cache.
    num_published_blocks: int = field(default=0, init=False)
    num_cached_tokens: int | None = field(default=None, init=False)
    logprobs: list[TokenLogprob] | None = field(default=None, init=False)
    stop_reason: str | int | None = field(default=None, init=False)
    # Text decoded so far (kept only for stop-string matching) and the final text.
    text: str = field(default="", init=False)
    # A pooling request's vector, once computed.
    embedding: torch.Tensor | None = field(default=None, init=False)
    # ``sampling_params.argmax_only``, read once: the sampler asks every step.
    argmax_only: bool = field(default=False, init=False)
    # Async scheduling: trailing entries of ``token_ids`` that are PLACEHOLDER_TOKEN_ID, tokens
    # of steps scheduled (and counted in ``num_computed_tokens``) whose output is not back yet.
    num_placeholders: int = field(default=0, init=False)
    # The token ids that end it once ``min_tokens`` are out: its EOS ids (unless ignore_eos)
    # and ``stop_token_ids``, read once so a token that ends nothing costs one set lookup.
    stop_token_set: frozenset[int] = field(default=frozenset(), init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        params = self.sampling_params
        self.argmax_only = params.argmax_only
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.eos_token_ids)
        self.stop_token_set = frozenset(stops)
        if params.logprobs is not None:
            self.logprobs = []

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Queue order in both the waiting and the running list: most urgent, lowest rank,
        then oldest."""
        return (self.priority, self.rank, self.arrival_seq)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_sampled_tokens(self) -> int:
        """Prompt and output tokens known on the host (``token_ids`` less its placeholders)."""
        return len(self.token_ids) - self.num_placeholders

    def drop_placeholders(self) -> None:
        """Forget the tokens of steps still in flight (the request finished before them)."""
        if self.num_placeholders:
            del self.token_ids[-self.num_placeholders:]
            self.num_placeholders = 0

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished
