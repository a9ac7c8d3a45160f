"""The drain loop: one thread owns the engine, keeps it full, and hands finished lines on.

Each turn: apply drops (a cancelled or expired batch, a shard whose lease was lost: queued lines
leave, running ones are aborted in the engine); top the engine up from the LineQueue until its
waiting requests hold about two steps' worth of prompt tokens beyond ``max_num_seqs`` running
ones (the token budget, not a message count, is the unit); run one ``step()``; turn each finished
RequestOutput into a result for the writer. An idle engine that receives single jobs waits
``job_collect_window`` first, so jobs that arrive together run in one batch. When fewer than
``low_water`` lines are left queued it calls ``on_hungry`` (the lease keeper claims more).

Two kinds of failure, two answers (STYLE rule 15). Preparing one line (its chat template, its
tokens, its limits) may raise anything: that line fails with the message and the loop goes on.
``step()`` raising (a CUDA error, out of memory, a bug in the engine) means the engine can no
longer be trusted: ``run`` raises ``EngineFailed`` without failing the lines in the engine, and
the worker hands their shards back and exits (``WorkerService``), so another worker runs them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.outputs import RequestOutput
from engine.protocol import Engine
from metrics.counters import ENGINE_STEPS, LINES_FINISHED
from metrics.forecast import OutputLengths
from openai_format.engine_fields import ignores_eos
from openai_format.ids import new_id
from openai_format.parse import SERVER_ERROR
from openai_format.tools import ToolCallMode
from pipeline.engine_adapter import (
    PrepareError,
    add_to_engine,
    prepare,
    prepare_fields,
    response_body,
)
from pipeline.scoring import ScoreReadBack
from service.models import LINE_COMPLETED, LINE_FAILED
from worker.items import LineResult, LineWork
from worker.line_queue import LineQueue

log = logging.getLogger(__name__)


class EngineFailed(RuntimeError):
    """``step()`` raised: the engine's state is unknown and it must not be stepped again."""


class Drainer:
    def __init__(
        self,
        engine: Engine,
        *,
        submit: Callable[[LineResult], None],
        model_name: str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        job_collect_window: float = 0.005,
        low_water: int | None = None,
        on_hungry: Callable[[], None] = lambda: None,
        on_step: Callable[[], None] = lambda: None,
        on_admit: Callable[[], None] = lambda: None,
        at_risk: Callable[[str], bool] = lambda batch_id: False,
    ) -> None:
        self.engine = engine
        self._submit = submit
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.job_collect_window = job_collect_window
        # Below this many queued lines the drainer asks for more work (``on_hungry``).
        self.low_water = low_water if low_water is not None else 2 * max_num_seqs
        self._on_hungry = on_hungry
        # After each step and each idle turn, on this thread (the forecast's gather).
        self.on_step = on_step
        # After a top-up brought lines into an idle engine, before the step that starts them
        # (the forecast's gather, at once): that step prefills them all and may take seconds,
        # and a forecast that still saw the engine empty would leave their batch's estimate to
        # the API's guess for lines no worker holds.
        self.on_admit = on_admit
        # Whether a batch's deadline is at risk (the forecast's word): its lines then enter
        # the engine more urgent than other bulk lines (``service.queue_order``).
        self.at_risk = at_risk
        self.queue = LineQueue()
        self._in_engine: dict[str, LineWork] = {}
        # How a line's output is read back, for lines with tool calls, a Response object or
        # an embedding encoding: (tool mode, response echo, encoding format).
        self._read_back: dict[str, tuple[ToolCallMode | None, dict[str, Any] | None,
                                         str | None, ScoreReadBack | None]] = {}
        self._drops: list[Callable[[LineWork], bool]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._avg_prompt_tokens = 256.0
        self.num_steps = 0
        self.num_finished = 0
        # Lengths of finished lines that could stop early: the forecast's output estimate.
        self.output_lengths = OutputLengths()

    # -- called from other threads ------------------------------------------------------------

    def add(self, lines: list[LineWork], *, is_job: bool) -> None:
        # Prompts are rendered and tokenized on the engine thread, not here: a fast tokenizer
        # used from two threads at once can fail ("Already borrowed").
        self.queue.push(lines, is_job=is_job)
        self._wake.set()

    def drop(self, predicate: Callable[[LineWork], bool]) -> None:
        """Remove matching lines at the next turn, without a result (someone else settles them)."""
        with self._lock:
            self._drops.append(predicate)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    @property
    def num_backlog(self) -> int:
        """Lines held and not finished: queued plus inside the engine."""
        return len(self.queue) + len(self._in_engine)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    @property
    def in_engine(self) -> dict[str, LineWork]:
        """Lines in the engine by engine request id; read it on the engine thread only."""
        return self._in_engine

    @property
    def avg_prompt_tokens(self) -> float:
        return self._avg_prompt_tokens

    # -- the engine thread --------------------------------------------------------------------

    def run(self) -> None:
        """Turn until ``stop()``; raises ``EngineFailed`` (or whatever broke the loop) with the
        lines in the engine left unsettled: their shards go back to the queue, not to errors."""
        try:
            while not self._stop.is_set():
                if not self.turn():
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException:
            self._in_engine.clear()  # not aborted: the engine is not to be touched again
            raise
        self._abort_all()

    def turn(self) -> bool:
        """One drop / top-up / step; False when there was nothing to do."""
        self._apply_drops()
        if not self.engine.has_unfinished_requests() and self.queue.num_jobs:
            time.sleep(self.job_collect_window)
        was_idle = not self.engine.has_unfinished_requests()
        self._top_up()
        if not self.engine.has_unfinished_requests():
            self.on_step()  # the forecast sees the engine empty, not its last busy state
            return False
        if was_idle:
            self.on_admit()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            raise EngineFailed(f"engine step failed with {len(self._in_engine)} requests in "
                               f"it: {type(exc).__name__}: {exc}") from exc
        self.num_steps += 1
        ENGINE_STEPS.inc()
        for output in outputs:
            self._finish(output)
        self.on_step()
        return True

    def _target_unfinished(self) -> int:
        waiting = math.ceil(2 * self.max_num_batched_tokens / max(self._avg_prompt_tokens, 1.0))
        return self.max_num_seqs + max(1, min(waiting, self.max_num_seqs))

    def _top_up(self) -> None:
        target = self._target_unfinished()
        added = False
        while self.engine.num_unfinished_requests < target:
            work = self.queue.pop()
            if work is None:
                break
            self._add_to_engine(work)
            added = True
        if added and len(self.queue) < self.low_water:
            self._on_hungry()  # claim more before the engine runs dry, not at the next poll

    def _add_to_engine(self, work: LineWork) -> None:
        # The same pipeline as ``boxcar run``: a line's error is the same on both paths. A line
        # stored with its engine fields is not parsed again (older rows are).
        fields = work.engine_fields
        if fields is not None:
            engine_input = prepare_fields(self.engine, fields)
        else:
            engine_input = prepare(self.engine, work.endpoint, work.body)
        if not isinstance(engine_input, PrepareError):
            order = work.engine_order(
                at_risk=work.batch_id is not None and self.at_risk(work.batch_id))
            engine_input = add_to_engine(self.engine, work.engine_request_id, engine_input,
                                         priority=order.priority, rank=order.rank) or (
                engine_input)
        if isinstance(engine_input, PrepareError):
            self._fail(work, engine_input.code, engine_input.message, param=engine_input.param)
            return
        self._in_engine[work.engine_request_id] = work
        if (engine_input.tool_mode is not None or engine_input.response_echo is not None
                or engine_input.encoding_format is not None or engine_input.score is not None):
            self._read_back[work.engine_request_id] = (engine_input.tool_mode,
                                                       engine_input.response_echo,
                                                       engine_input.encoding_format,
                                                       engine_input.score)
        num_tokens = engine_input.num_tokens
        self._avg_prompt_tokens = 0.9 * self._avg_prompt_tokens + 0.1 * num_tokens

    def _finish(self, output: RequestOutput) -> None:
        work = self._in_engine.pop(output.request_id, None)
        tool_mode, response_echo, encoding_format, score = self._read_back.pop(
            output.request_id, (None, None, None, None))
        if work is None:
            return
        if output.finish_reason == "abort":
            return  # aborted on purpose: whoever dropped it settles the line
        hex_id = new_id()
        fields = work.engine_fields
        lora = None if fields is None else fields.get("lora_name")
        try:
            body, usage = response_body(
                output, endpoint=work.endpoint, model=lora or self.model_name,
                engine=self.engine, hex_id=hex_id,
                tool_mode=tool_mode, response_echo=response_echo,
                encoding_format=encoding_format, score=score,
            )
        except Exception as exc:
            log.exception("could not build the response of %s", work.engine_request_id)
            self._fail(work, SERVER_ERROR, f"could not build the response: {exc}")
            return
        self.num_finished += 1
        # A line that ignores EOS says nothing of where lines stop (a row from before the
        # engine fields, read without them, counts).
        if (fields is None or not ignores_eos(fields)) and len(output.outputs) == 1:
            self.output_lengths.observe(usage.completion_tokens)
        LINES_FINISHED.labels(LINE_COMPLETED).inc()
        self._submit(LineResult(
            work, LINE_COMPLETED, response=body, request_id=f"req_{hex_id}",
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
        ))

    def _fail(self, work: LineWork, code: str, message: str, *, param: str | None = None) -> None:
        self.num_finished += 1
        LINES_FINISHED.labels(LINE_FAILED).inc()
        error = {"code": code, "message": message}
        if param is not None:
            error["param"] = param
        self._submit(LineResult(work, LINE_FAILED, error=error, request_id=new_id("req_")))

    def _apply_drops(self) -> None:
        with self._lock:
            drops, self._drops = self._drops, []
        if not drops:
            return

        def dropped(work: LineWork) -> bool:
            return any(predicate(work) for predicate in drops)

        self.queue.remove(dropped)
        ids = [rid for rid, work in self._in_engine.items() if dropped(work)]
        if ids:
            self.engine.abort_request(ids)
            for rid in ids:
                self._in_engine.pop(rid, None)
                self._read_back.pop(rid, None)

    def _abort_all(self) -> None:
        ids = list(self._in_engine)
        if ids:
            try:
                self.engine.abort_request(ids)
            except Exception:
                log.exception("aborting %d requests failed", len(ids))
        self._in_engine.clear()
        self._read_back.clear()
