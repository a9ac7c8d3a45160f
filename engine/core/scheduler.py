"""Scheduler: decides, each step, which requests compute how many tokens. Pure CPU bookkeeping."""

from __future__ import annotations

import time
from bisect import insort
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core.block_pool import KVBlock
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import PLACEHOLDER_TOKEN_ID, Request, RequestStatus
from engine.core.step_budget import Admit, StepBudget
from engine.core.window_kv import WindowBlocks
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput


@dataclass
class OverlappedOutput(SchedulerOutput):
    """An async-scheduled step (``Scheduler.schedule(overlap=True)``), with its requests in
    ``scheduled`` order, their computed tokens already advanced and a placeholder appended for
    each sampled token. A request may finish, and its id be reused, before this step's output
    comes back: the output goes to these objects."""

    requests: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int,
                 window: WindowBlocks | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching, config.watermark,
            window,
        )
        # Both lists are kept in Request.sort_key order: (priority, rank, arrival), lower first.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._num_arrived = 0
        self.num_preemptions = 0
        # Waiting requests passed over in a step because a running one was computing their prefix.
        self.num_prefix_holds = 0
        # ... or because their LoRA adapter would have been one more than max_loras.
        self.num_lora_holds = 0
        self.num_steps = 0
        self.batch_size_hist: Counter[int] = Counter()
        self.scheduled_tokens_hist: Counter[int] = Counter()

    # ---- queue management -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.arrival_seq = self._num_arrived
        self._num_arrived += 1
        insort(self.waiting, request, key=_sort_key)
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
            self._dequeue(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _dequeue(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        # A step still in flight may compute one more token for it: that token is dropped (and
        # the step's output for it ignored), its blocks freed now; a later step that reuses
        # them runs after that one, in device order.
        request.drop_placeholders()
        request.status = status
        request.metrics.finished_time = time.monotonic()
        request.metrics.num_generated_tokens = request.num_output_tokens
        self.kv.free(request)
        del self.requests[request.request_id]

    # ---- the step -----------------------------------------------------------------------------

    def schedule(self, overlap: bool = False) -> SchedulerOutput:
        """One token budget, spent on running requests first, then on waiting ones.

        Every request moves ``num_computed_tokens`` toward ``num_tokens``: a decode needs one
        token, a prompt (or a preempted request's prompt + output) needs the rest, cut to what is
        left of ``max_num_batched_tokens`` when chunked prefill is on, so long prompts share
        steps with decodes instead of stalling them. Both queues are ordered by (priority,
        rank, arrival), lower values first; rank only orders, priority also displaces. Running
        requests are served in that order; when one needs a block and none is free, the last
        running request (least urgent, newest) is preempted (its blocks freed, to be
        recomputed later, usually from its own cached prefix)
        until the allocation fits. Waiting requests are then admitted in order, after their cached
        prefix is looked up, while the budget, ``max_num_seqs`` and the free-block watermark
        allow. A waiting request whose next uncached prompt block is being computed by a running
        request (admitted earlier or in this step) is held and passed over, so a shared prefix is
        computed once and then hit; the requests behind it are still admitted. A waiting request
        more urgent than the last running one takes what it lacks from it: budget (that request
        skips this step), or a seat or blocks (it is preempted), repeated down the running list
        while less urgent requests remain. While a request more urgent than others is unfinished
        (running or waiting), the less urgent ones' tokens (decodes and prompt chunks of the
        running ones in queue order, then admissions) share at most ``urgent_bulk_tokens`` per
        step and the rest skip the step, keeping their blocks, so each step stays short on a
        device whose step time grows with its tokens; the urgent requests' own tokens are not
        capped. Otherwise no request is admitted in a step that had to preempt, and the first
        one that does not fit stops admission. The adapters of the running requests are counted
        as seats are: a waiting request whose LoRA adapter is not among them while there are
        ``max_loras`` already is passed over (it waits for one to finish) and the requests
        behind it are still admitted. Pooling (embedding) requests are prefill-only:
        each is scheduled whole in one step with no KV blocks (alone when longer than the
        budget), one that does not fit what is left waits while smaller ones behind it fill
        the step, and each finishes in the step that computes it.

        ``overlap`` (async scheduling): the previous step may still be running. The scheduled
        requests' ``num_computed_tokens`` are advanced now and each sampled token is a
        placeholder until ``update_from_output``; a request whose placeholder will reach its
        length limit is not scheduled again.
        """
        step = StepBudget(self.config.max_num_batched_tokens)
        step.urgent_priority, step.bulk_budget = self._bulk_cap()
        now = time.monotonic()

        i = self._schedule_decodes(step) if step.bulk_budget is None else 0
        while i < len(self.running) and step.budget > 0:
            request = self.running[i]
            if request.num_placeholders and self._reaches_length(request):
                i += 1  # its step in flight samples its last token
                continue
            num_new = step.cap(request, min(len(request.token_ids) - request.num_computed_tokens,
                                            step.budget))
            if num_new == 0:
                i += 1  # a less urgent request and the less urgent budget is spent: it skips
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim, step)
                if victim is request:
                    break
            else:
                step.add(self._scheduled(request, num_new), request)
                i += 1
                continue
            break  # the request itself was preempted: nothing behind it runs either

        self._admit_waiting(step, now)

        num_batched = step.initial_budget - step.budget
        scheduled = list(step.scheduled.values())
        if scheduled:
            self.num_steps += 1
            self.batch_size_hist[len(scheduled)] += 1
            self.scheduled_tokens_hist[num_batched] += 1
        if overlap:
            return OverlappedOutput(scheduled, max(num_batched, 0), step.num_preempted,
                                    self._advance(scheduled))
        return SchedulerOutput(scheduled, max(num_batched, 0), step.num_preempted)

    def _schedule_decodes(self, step: StepBudget) -> int:
        """Schedule the leading running requests that are in the steady decode state, and
        return how many: each computes one token, under no bulk cap, with budget left, into a
        block it holds or one that is free. The loop in ``schedule`` would give each the same
        share (its cap is a no-op, ``allocate_slots`` the same call, or none where the last
        block has room); here it costs no call and no check that cannot fire, about half of
        ``schedule``'s time at 1,024 decodes (issue 46). The first request that is anything else
        (a prompt chunk, a placeholder at its length limit, no free block: a preemption) and
        every one after it go through that loop."""
        kv = self.kv
        if kv.window is not None:
            return 0
        block_size = kv.block_size
        scheduled = step.scheduled
        budget = step.budget
        num_done = 0
        for request in self.running:
            num_computed = request.num_computed_tokens
            if (budget <= 0 or len(request.token_ids) - num_computed != 1
                    or (request.num_placeholders and self._reaches_length(request))
                    or (num_computed >= len(request.block_ids) * block_size
                        and not kv.allocate_slots(request, 1))):
                break
            request_id = request.request_id
            scheduled[request_id] = ScheduledRequest(request_id, num_computed, 1, True)
            budget -= 1
            num_done += 1
        step.budget = budget
        return num_done

    def _advance(self, scheduled: list[ScheduledRequest]) -> list[Request]:
        """Async scheduling: count the step's tokens as computed now and give each sampled
        token a placeholder, so the next step can be scheduled before this one's output."""
        requests = []
        for s in scheduled:
            request = self.requests[s.request_id]
            # Any placeholder now is the step in flight's token: this step's input (a decode).
            s.prev_token = request.num_placeholders > 0
            request.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
            if s.sample:
                request.token_ids.append(PLACEHOLDER_TOKEN_ID)
                request.num_placeholders += 1
            requests.append(request)
        return requests

    def _reaches_length(self, request: Request) -> bool:
        """Its tokens so far, placeholders included, reach max_tokens or the context."""
        return (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.max_model_len)

    def _bulk_cap(self) -> tuple[int | None, int | None]:
        """(most urgent priority, token budget of the less urgent) while priorities differ.

        (None, None) when ``urgent_bulk_tokens`` is off or every request has one priority.
        """
        cap = self.config.urgent_bulk_tokens
        queued = [q for q in (self.running, self.waiting) if q]
        if cap is None or not queued:
            return None, None
        most_urgent = min(q[0].priority for q in queued)
        least_urgent = max(q[-1].priority for q in queued)
        if most_urgent == least_urgent:
            return None, None
        return most_urgent, cap

    def _admit_waiting(self, step: StepBudget, now: float) -> None:
        """Waiting requests in queue order, each admitted, held (passed over) or stopping
        admission for this step (``schedule`` says when); at most ``max_num_seqs`` are held."""
        if not self.waiting:
            return  # (the adapters below are a pass over every running request)
        preempted_by_running = step.num_preempted > 0
        loras = {r.lora_name for r in self.running if r.lora_name is not None}
        num_held = 0
        i = 0
        while i < len(self.waiting):
            outcome = self._try_admit(self.waiting[i], step, preempted_by_running, loras, now)
            if outcome is Admit.ADMITTED:
                del self.waiting[i]
            elif outcome is Admit.HELD:
                num_held += 1
                if num_held >= self.config.max_num_seqs:
                    break  # bound the scan of a long queue of held requests
                i += 1
            elif outcome is Admit.STOP:
                break
            # RETRY: a running request made way for it; the same request is tried again.

    def _try_admit(self, request: Request, step: StepBudget, preempted_by_running: bool,
                   loras: set[str], now: float) -> Admit:
        """One waiting request through admission's checks, in order: preempted this step, or
        not outranking a running request after a preemption (stop); its LoRA adapter one too
        many (held); a pooling request whole or not at all; its next prefix block in flight
        (held); budget and a seat; its tokens; its KV blocks. Then it runs."""
        if request.request_id in step.preempted_ids:
            return Admit.STOP  # taken out this step: it and everything after it wait
        outranks = bool(self.running) and self.running[-1].priority > request.priority
        if preempted_by_running and not outranks:
            return Admit.STOP
        lora = request.lora_name
        if lora is not None and lora not in loras and len(loras) >= self.config.max_loras:
            self.num_lora_holds += 1  # its adapter would be one too many this step
            return Admit.HELD
        if request.is_pooling:
            return self._admit_pooling(request, step, now)
        prefix = self._cached_prefix(request)
        if prefix is None:
            return Admit.HELD
        computed_blocks, num_hit = prefix
        room = self._make_room(request, step, outranks)
        if room is not None:
            return room
        num_new = self._num_new_tokens(request, num_hit, step, outranks)
        if num_new is None:
            return Admit.STOP
        # The watermark guards running requests; an idle engine admits what fits.
        if not self.kv.allocate_slots(request, num_new, computed_blocks,
                                      admit=bool(self.running)):
            return self._preempt_for(outranks, step)
        self._start_running(request, num_new, len(computed_blocks), num_hit, step, now)
        if lora is not None:
            loras.add(lora)
        return Admit.ADMITTED

    def _admit_pooling(self, request: Request, step: StepBudget, now: float) -> Admit:
        fits = self._pooling_fits(request, step)
        if fits is None:
            return Admit.STOP
        if not fits:
            return Admit.HELD  # a smaller input behind it may still fill the budget
        self._start_pooling(request, step, now)
        return Admit.ADMITTED

    def _cached_prefix(self, request: Request) -> tuple[list[KVBlock], int] | None:
        """The blocks of the request's prompt found in the prefix cache and the tokens they
        cover (none for a request that has computed some already); None when the block after
        them is being computed by a running request: it is held, to hit it in a later step."""
        if request.num_computed_tokens != 0:
            return [], 0
        computed_blocks, num_hit = self.kv.get_computed_blocks(request)
        if self.kv.in_flight_owner(request, len(computed_blocks)) is not None:
            self.num_prefix_holds += 1
            return None
        return computed_blocks, num_hit

    def _make_room(self, request: Request, step: StepBudget, outranks: bool) -> Admit | None:
        """None when the step has budget and a seat for the request (one that outranks the
        last running request takes them from the less urgent ones); else what admission does."""
        if step.budget <= 0 and not (outranks and self._take_budget(request, 1, step)):
            return Admit.STOP
        if len(self.running) >= self.config.max_num_seqs:
            return self._preempt_for(outranks, step)
        return None

    def _num_new_tokens(self, request: Request, num_hit: int, step: StepBudget,
                        outranks: bool) -> int | None:
        """The prompt tokens the request computes this step, past its cached ones, within the
        budget (a chunk of them with chunked prefill); None stops admission."""
        config = self.config
        num_new = request.num_tokens - request.num_computed_tokens - num_hit
        capped = step.cap(request, num_new)
        if capped < num_new and not (capped and config.enable_chunked_prefill):
            return None  # the less urgent requests' budget is spent for this step
        num_new = capped
        if num_new > step.budget and outranks:
            self._take_budget(request, num_new, step)
        if num_new > step.budget:
            if config.enable_chunked_prefill:
                return step.budget
            if step.scheduled or step.budget < step.initial_budget:
                return None
            # Chunking off and the step is empty: a prompt over the budget runs alone.
        return num_new

    def _preempt_for(self, outranks: bool, step: StepBudget) -> Admit:
        """A request that outranks the last running one preempts it and is tried again; any
        other stops admission."""
        if not outranks:
            return Admit.STOP
        self._preempt(self.running.pop(), step)
        return Admit.RETRY

    def _start_running(self, request: Request, num_new: int, num_hit_blocks: int,
                       num_hit: int, step: StepBudget, now: float) -> None:
        """An admitted request: its prefix-cache hit counted and promised, its cached tokens
        computed, running, and its first ``num_new`` tokens in the step."""
        if self.kv.enable_caching and request.num_computed_tokens == 0:
            self.kv.record_lookup(request.num_tokens, num_hit)
            self.kv.promise_blocks(request, num_hit_blocks)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit
            request.metrics.num_cached_tokens = num_hit
        request.num_computed_tokens += num_hit
        request.status = RequestStatus.RUNNING
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
        insort(self.running, request, key=_sort_key)
        step.add(self._scheduled(request, num_new), request)

    def _pooling_fits(self, request: Request, step: StepBudget) -> bool | None:
        """Whether a pooling request runs this step: whole (it is never chunked, and keeps no
        KV blocks to resume from), within what is left of the budget, or alone in an empty
        step when it is longer than the whole budget. False: it waits, and smaller ones behind
        it may fill the step; None: no seat is left, admission stops."""
        if len(self.running) >= self.config.max_num_seqs:
            return None
        num_new = request.num_tokens
        if step.cap(request, num_new) < num_new:
            return False
        if num_new <= step.budget:
            return True
        return not step.scheduled and step.budget == step.initial_budget

    def _start_pooling(self, request: Request, step: StepBudget, now: float) -> None:
        request.status = RequestStatus.RUNNING
        request.num_cached_tokens = 0
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
        insort(self.running, request, key=_sort_key)
        step.add(ScheduledRequest(request.request_id, 0, request.num_tokens, sample=False),
                 request)

    def _take_budget(self, request: Request, num_tokens: int, step: StepBudget) -> bool:
        """Unschedule less urgent running requests (last first) until ``num_tokens`` are free.

        They keep their blocks and state and simply skip this step. True if any budget is free.
        """
        for other in reversed(self.running):
            if step.budget >= num_tokens or other.priority <= request.priority:
                break
            step.remove(other.request_id)
        return step.budget > 0

    @staticmethod
    def _scheduled(request: Request, num_new: int) -> ScheduledRequest:
        num_computed = request.num_computed_tokens
        return ScheduledRequest(request.request_id, num_computed, num_new,
                                num_computed + num_new == len(request.token_ids))

    def _preempt(self, request: Request, step: StepBudget) -> None:
        step.remove(request.request_id)
        step.num_preempted += 1
        step.preempted_ids.add(request.request_id)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        insort(self.waiting, request, key=_sort_key)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> tuple[list[Request], list[Request]]:
        """Advance computed tokens, append sampled tokens and apply token-level stops.

        An overlapped step (``schedule(overlap=True)``) advanced its tokens when it was
        scheduled: its sampled tokens replace their placeholders, by position, and its requests
        that finished (or were aborted) meanwhile are passed over; one preempted meanwhile still
        takes its token (it recomputes it later).

        Returns (requests that got a new token, requests that finished).
        """
        now = time.monotonic()
        updated: list[Request] = []
        finished: list[Request] = []
        overlapped = (scheduler_output.requests if isinstance(scheduler_output, OverlappedOutput)
                      else None)
        requests = (overlapped if overlapped is not None
                    else [self.requests[s.request_id] for s in scheduler_output.scheduled])
        sampled = runner_output.sampled_token_ids
        kv = self.kv
        # Whether a running request's blocks may need publishing at every step, or only when
        # one fills up (``cache_full_blocks``'s own early return, checked here without the
        # call: most decode steps fill none).
        publish_each_step = kv.window is not None
        publish_full = kv.enable_caching
        block_size = kv.block_size
        max_model_len = self.max_model_len
        for sched, request in zip(scheduler_output.scheduled, requests, strict=True):
            num_computed = sched.num_computed_tokens + sched.num_new_tokens
            running = request.status is RequestStatus.RUNNING
            if overlapped is None:
                request.num_computed_tokens = num_computed
            elif not running and request.is_finished:
                continue
            if request.pooling_params is not None:  # done in its one step: its vector is out
                request.embedding = runner_output.pooled[request.request_id]
                request.metrics.first_token_time = now
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                finished.append(request)
                continue
            if running and (
                    publish_each_step or (publish_full and num_computed // block_size
                                          > request.num_published_blocks)):
                kv.cache_full_blocks(request, num_computed)
            if not sched.sample:
                continue
            token_id = sampled[request.request_id]
            if overlapped is None:
                request.token_ids.append(token_id)
            else:
                request.token_ids[num_computed] = token_id
                request.num_placeholders -= 1
            if request.logprobs is not None:
                request.logprobs.append(runner_output.logprobs[request.request_id])
            num_out = num_computed + 1 - len(request.prompt_token_ids)
            # Every output token passes here, so only the first can find no first-token time;
            # the count is set when the request finishes (``_finish``): the metrics object is
            # not touched at the other tokens.
            if num_out == 1 and request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            updated.append(request)
            # Only a stop token or a length limit can end it here (num_prompt_tokens + num_out
            # is num_computed + 1): one set lookup and two comparisons for the rest.
            if (token_id not in request.stop_token_set and num_out < request.max_tokens
                    and num_computed + 1 < max_model_len):
                continue
            status = self._check_token_stop(request, token_id, num_out)
            if status is not None:
                self._dequeue(request)
                self._finish(request, status)
                finished.append(request)
        return updated, finished

    def _check_token_stop(self, request: Request, token_id: int,
                          num_out: int) -> RequestStatus | None:
        """Why ``request`` ends at ``token_id``, its ``num_out``-th output token (None: it goes
        on). Placeholders after it (steps in flight) do not count."""
        params = request.sampling_params
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if (num_out >= request.max_tokens
                or request.num_prompt_tokens + num_out >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_stopped(self, request: Request, stop_reason: str) -> None:
        """A stop string matched (checked by the engine, which owns the detokenizer)."""
        request.stop_reason = stop_reason
        self._dequeue(request)
        self._finish(request, RequestStatus.FINISHED_STOPPED)


def _sort_key(request: Request) -> tuple[int, int, int]:
    return request.sort_key
