"""A stand-in for ``LLMEngine`` for the scale benchmark (``bench/scale.py``): no model, no torch,
the same methods the worker's drain loop and request pipeline call.

``FakeEngine(lines_per_s=None)`` is *instant*: each step admits up to ``max_num_seqs`` requests
and finishes them all, without sleeping, so a worker runs as fast as the control plane feeds it.
``FakeEngine(lines_per_s=100)`` is *paced like a GPU*: a request needs ``steps_per_request``
steps and a step takes the same time whatever the batch size (decode is memory bound), chosen so
that a full batch finishes ``lines_per_s`` requests a second. Steps keep to a clock rather than
sleeping a fixed time, so the host's own work between steps overlaps the "device" time as it
does with a real GPU; a worker that starves its engine falls below the pace, one that keeps it
full holds it exactly.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

ANSWER = "ok"  # each request's text; token ids are its characters


def prompt_token_ids(engine, prompt: str | list[int]) -> list[int]:
    """A fake engine's prompt as token ids, refused as the real engine refuses it (empty, or no
    room left in ``engine.max_model_len``)."""
    token_ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not token_ids:
        raise ValueError("the prompt is empty")
    if len(token_ids) >= engine.max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens >= max_model_len "
                         f"{engine.max_model_len}")
    return token_ids


@dataclass(frozen=True)
class FakeConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


class FakeTokenizer:
    eos_token_id = 0
    chat_template = None  # no tool calling: the pipeline refuses tools as for a plain model

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)


@dataclass
class _Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    steps_left: int
    generated: list[int] = field(default_factory=list)


class FakeEngine:
    def __init__(self, *, lines_per_s: float | None, max_num_seqs: int = 64,
                 steps_per_request: int = 8, max_model_len: int = 4096) -> None:
        if lines_per_s is not None and lines_per_s <= 0:
            raise ValueError(f"lines_per_s must be > 0 (or None: instant), got {lines_per_s}")
        if max_num_seqs < 1 or steps_per_request < 1:
            raise ValueError("max_num_seqs and steps_per_request must be >= 1, got "
                             f"{max_num_seqs} and {steps_per_request}")
        self.config = FakeConfig(max_num_seqs, max_num_batched_tokens=8 * max_num_seqs)
        self.tokenizer = FakeTokenizer()
        self.model_name = "bench-fake"
        self.lora_names: list[str] = []
        self.max_model_len = max_model_len
        self.lines_per_s = lines_per_s
        # Instant: one step per request. Paced: a full batch finishes lines_per_s a second.
        self.steps_per_request = 1 if lines_per_s is None else steps_per_request
        self.step_time = (0.0 if lines_per_s is None
                          else max_num_seqs / steps_per_request / lines_per_s)
        self._requests: dict[str, _Request] = {}
        self._waiting: list[str] = []
        self._running: list[str] = []
        self._next_step_at: float | None = None

    # -- the pipeline's tokenizer side -----------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return [ord(c) for c in prompt]

    def apply_chat_template(self, messages: list[dict], tools: list | None = None) -> list[int]:
        if not messages:
            raise ValueError("no messages")
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)
        return self.encode(text + "<assistant>")

    # -- the engine loop -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already in the engine")
        token_ids = prompt_token_ids(self, prompt)
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic(),
                                 num_prompt_tokens=len(token_ids))
        self._requests[request_id] = _Request(token_ids, params, metrics, self.steps_per_request)
        self._waiting.append(request_id)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return [self._finish(rid, "abort") for rid in ids if rid in self._requests]

    def step(self) -> list[RequestOutput]:
        self._keep_pace()
        now = time.monotonic()
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            rid = self._waiting.pop(0)
            self._running.append(rid)
            self._requests[rid].metrics.first_scheduled_time = now
        finished = []
        for rid in list(self._running):
            request = self._requests[rid]
            request.generated.append(ord(ANSWER[len(request.generated) % len(ANSWER)]))
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.steps_left -= 1
            if request.steps_left <= 0:
                finished.append(self._finish(rid, "stop"))
        return finished

    def _keep_pace(self) -> None:
        """Sleep until this step's slot on the clock; a clock more than a step behind (the engine
        sat idle, or the host was slower than the pace) starts over from now."""
        if not self.step_time:
            return
        now = time.monotonic()
        if self._next_step_at is None or now - self._next_step_at > self.step_time:
            self._next_step_at = now
        if self._next_step_at > now:
            time.sleep(self._next_step_at - now)
        self._next_step_at += self.step_time

    def _finish(self, rid: str, reason: str) -> RequestOutput:
        request = self._requests.pop(rid)
        for queue in (self._waiting, self._running):
            if rid in queue:
                queue.remove(rid)
        request.metrics.finished_time = time.monotonic()
        request.metrics.num_generated_tokens = len(request.generated)
        completion = CompletionOutput(index=0, text=self.tokenizer.decode(request.generated),
                                      token_ids=list(request.generated), finish_reason=reason)
        return RequestOutput(rid, None, request.prompt_token_ids, [completion], True,
                             request.metrics)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)
