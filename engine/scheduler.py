"""Scheduler: decides, each step, which requests compute how many tokens. Pure CPU bookkeeping."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching, config.watermark
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self.batch_size_hist: Counter[int] = Counter()
        self.scheduled_tokens_hist: Counter[int] = Counter()

    # ---- queue management -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests wherever they are (waiting or running) and free their blocks."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.metrics.finished_time = time.monotonic()
        self.kv.free(request)
        del self.requests[request.request_id]

    # ---- the step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """One token budget, spent on running requests first, then on waiting ones.

        Every request moves ``num_computed_tokens`` toward ``num_tokens``: a decode needs one
        token, a prompt (or a preempted request's prompt + output) needs the rest, cut to what is
        left of ``max_num_batched_tokens`` when chunked prefill is on, so long prompts share
        steps with decodes instead of stalling them. Running requests are served in admission
        order; when one needs a block and none is free, the newest running request is preempted
        (its blocks freed, to be recomputed later, usually from its own cached prefix) until the
        allocation fits. Waiting requests are admitted in FIFO order, after their cached prefix is
        looked up, while the budget, ``max_num_seqs`` and the free-block watermark allow; no new
        request is admitted in a step that had to preempt.
        """
        config = self.config
        budget = config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preempted = 0
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing behind it runs either

        if num_preempted == 0:
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < config.max_num_seqs:
                request = self.waiting[0]
                if request.waits_for is not None and not self._sibling_ready(request):
                    skipped.append(self.waiting.popleft())
                    continue
                computed_blocks: list = []
                num_hit = 0
                if request.num_computed_tokens == 0:
                    computed_blocks, num_hit = self.kv.get_computed_blocks(request)
                num_new = request.num_tokens - request.num_computed_tokens - num_hit
                if num_new > budget:
                    if config.enable_chunked_prefill:
                        num_new = budget
                    elif scheduled or budget < config.max_num_batched_tokens:
                        break
                    # Chunking off and the step is empty: a prompt over the budget runs alone.
                # The watermark guards running requests; an idle engine admits what fits.
                admit = bool(self.running)
                if not self.kv.allocate_slots(request, num_new, computed_blocks, admit=admit):
                    break
                self.waiting.popleft()
                if self.kv.enable_caching and request.num_computed_tokens == 0:
                    self.kv.record_lookup(request.num_tokens, num_hit)
                if request.num_cached_tokens is None:
                    request.num_cached_tokens = num_hit
                    request.metrics.num_cached_tokens = num_hit
                request.num_computed_tokens += num_hit
                request.status = RequestStatus.RUNNING
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = now
                self.running.append(request)
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
            self.waiting.extendleft(reversed(skipped))

        num_batched = config.max_num_batched_tokens - budget
        if scheduled:
            self.num_steps += 1
            self.batch_size_hist[len(scheduled)] += 1
            self.scheduled_tokens_hist[num_batched] += 1
        return SchedulerOutput(scheduled, max(num_batched, 0), num_preempted)

    def _sibling_ready(self, request: Request) -> bool:
        first = request.waits_for
        assert first is not None
        if first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens:
            request.waits_for = None
            return True
        return False

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        sample = request.num_computed_tokens + num_new == request.num_tokens
        return ScheduledRequest(request.request_id, request.num_computed_tokens, num_new, sample)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> tuple[list[Request], list[Request]]:
        """Advance computed tokens, append sampled tokens and apply token-level stops.

        Returns (requests that got a new token, requests that finished).
        """
        now = time.monotonic()
        updated: list[Request] = []
        finished: list[Request] = []
        for sched in scheduler_output.scheduled:
            request = self.requests[sched.request_id]
            request.num_computed_tokens += sched.num_new_tokens
            self.kv.cache_full_blocks(request)
            if not sched.sample:
                continue
            token_id = runner_output.sampled_token_ids[request.request_id]
            request.append_token(token_id)
            if request.logprobs is not None:
                request.logprobs.append(runner_output.logprobs[request.request_id])
            metrics = request.metrics
            metrics.num_generated_tokens = request.num_output_tokens
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            updated.append(request)
            status = self._check_token_stop(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                finished.append(request)
        return updated, finished

    def _check_token_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_out = request.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if num_out >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_stopped(self, request: Request, stop_reason: str) -> None:
        """A stop string matched (checked by the engine, which owns the detokenizer)."""
        request.stop_reason = stop_reason
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_STOPPED)
