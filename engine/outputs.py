"""The contracts between the engine's parts and its users.

SchedulerOutput (scheduler -> model runner), ModelRunnerOutput (model runner -> scheduler),
RequestOutput (engine -> caller), EngineStats and RequestProgress (engine -> metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``num_new_tokens`` tokens from ``num_computed``."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    # The request samples a token this step: its prompt (and any recomputed output) is done.
    sample: bool
    # Async scheduling: the input token (a decode's one) is the one this request samples in
    # the step still in flight; the runner reads it from that step's sampled tokens.
    prev_token: bool = False


@dataclass
class SchedulerOutput:
    """What one step computes. Decodes (one new token each) come before prefill chunks."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class ModelRunnerOutput:
    """Sampled token per sampling request, in the order of ``SchedulerOutput.scheduled``."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # The same tokens where they were sampled ([len(sampled_token_ids)] int64, in its order, on
    # the runner's device): async scheduling's next step gathers its input ids from them. None
    # from a runner that samples nothing on a device (pooling, a test's fake).
    device_token_ids: torch.Tensor | None = None
    # Pooling requests: the fp32 vector of each one computed this step ([hidden_size], CPU).
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and token counts of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if (
            self.first_token_time is None
            or self.finished_time is None
            or self.num_generated_tokens < 2
        ):
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "queue_time": self.queue_time,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e_latency": self.e2e_latency,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_preemptions": self.num_preemptions,
        }


@dataclass
class CompletionOutput:
    """One generated sequence (``index`` < n)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None


@dataclass
class RequestOutput:
    """The result of one ``add_request`` call; ``outputs`` holds its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # An embedding request's vectors, one per input in input order (fp32, CPU; ``outputs`` is
    # empty); None for generation. An aborted request's unfinished inputs are None.
    embeddings: list[torch.Tensor | None] | None = None

    # Convenience for n == 1, the common case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None


@dataclass
class EngineStats:
    """A snapshot of the engine's state and cumulative counters."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
    num_prompt_tokens: int
    num_generated_tokens: int
    # value -> number of steps that had it
    batch_size_hist: dict[int, int]
    scheduled_tokens_hist: dict[int, int]
    prefill_time: float = 0.0
    decode_time: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


@dataclass(frozen=True)
class RequestProgress:
    """How far one unfinished sequence has got: what a caller needs to forecast the time left.

    ``num_computed_tokens`` falls back to the cached prefix when the sequence is preempted
    (recompute), so ``num_tokens - num_computed_tokens`` is the work before its next token."""

    request_id: str  # the caller's id (a sequence of an n > 1 request carries its parent's)
    running: bool
    num_tokens: int  # prompt + output so far
    num_computed_tokens: int
    num_output_tokens: int
    max_tokens: int
    ignore_eos: bool
