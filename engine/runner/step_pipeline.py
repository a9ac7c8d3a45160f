"""StepPipeline: async scheduling's device side, one step in flight while the host prepares the
next (vLLM v1's async scheduling, SGLang's overlap scheduler).

A one-thread executor stands in for the device stream: steps run on it one after another, in
launch order, so a step that reuses KV blocks the host freed while an earlier step still read
them writes them only after that step is done (as kernels queued on one CUDA stream do). The
forward pass and the sampler run there while the main thread schedules the next step and
finishes the previous one's outputs (torch releases the GIL inside its ops). A decode whose
input is the token its request samples in the step before (``ScheduledRequest.prev_token``)
reads it there, from that step's sampled-token tensor (an index gather), never from the host:
the tensor the sampler wrote its tokens to, which crossed to the host only for the outputs.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.core.request import Request
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.runner.input_batch import PreparedStep
from engine.runner.model_runner import ModelRunner


@dataclass
class StepResult:
    output: ModelRunnerOutput
    tokens: torch.Tensor  # [num sampled rows] int64, on the device: the next step gathers from it
    seconds: float  # the step's time on the device (its wait for the step before excluded)


@dataclass
class InFlightStep:
    """A launched step: its result when done, and where each request's token lands in it."""

    future: Future[StepResult]
    sample_index: dict[str, int]  # request id -> its row in ``StepResult.tokens``

    def result(self) -> StepResult:
        return self.future.result()


class StepPipeline:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="boxcar-step")
        self._last: InFlightStep | None = None

    def launch(self, scheduler_output: SchedulerOutput,
               requests: dict[str, Request]) -> InFlightStep:
        """Lay the step out now (it reads the requests) and queue it behind the step before."""
        # Everything here stays on the host: a copy to the device from this thread would wait
        # for the step in flight (one stream).
        step = self.runner.prepare_step(scheduler_output, requests, on_host=True)
        gather = self._gather(step)
        previous = self._last
        future = self._executor.submit(self._run, step, gather, previous)
        launched = InFlightStep(future, {r.request_id: i
                                         for i, r in enumerate(step.sample_requests)})
        self._last = launched
        return launched

    def _gather(self, step: PreparedStep) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step's input ids, rows of the previous step's tokens) for the decodes
        whose input that step samples; None when there are none."""
        dst: list[int] = []
        src: list[int] = []
        decode_row = 0  # the flat batch holds the one-token rows first, in ``scheduled`` order
        for s in step.scheduled:
            if s.num_new_tokens != 1:
                continue
            if s.prev_token:
                if self._last is None or s.request_id not in self._last.sample_index:
                    raise RuntimeError(f"request {s.request_id}'s input token is sampled by "
                                       "no step in flight")
                dst.append(decode_row)
                src.append(self._last.sample_index[s.request_id])
            decode_row += 1
        if not dst:
            return None
        return torch.tensor(dst, dtype=torch.int64), torch.tensor(src, dtype=torch.int64)

    def _run(self, step: PreparedStep, gather: tuple[torch.Tensor, torch.Tensor] | None,
             previous: InFlightStep | None) -> StepResult:
        start = time.perf_counter()
        device = self.runner.device
        step.batch = step.batch.to(device)
        if gather is not None:
            assert previous is not None
            # done: it ran before this one, on this thread
            tokens = previous.result().tokens
            dst, src = (t.to(device, non_blocking=True) for t in gather)
            step.batch.input_ids[dst] = tokens[src]
        output = self.runner.run_step(step)
        sampled = output.device_token_ids  # rows in ``step.sample_requests`` order
        if sampled is None:  # a step that samples nothing
            sampled = torch.empty(0, dtype=torch.int64, device=device)
        return StepResult(output, sampled, time.perf_counter() - start)
