"""LLMEngine: add_request / abort_request / step, the loop the worker drives.

It satisfies ``engine.protocol.Engine``, the contract every caller sees. Its parts, one job a
file: ``engine.startup`` builds it (and times the start-up), ``engine.core.parallel_sampling``
fans a request out to its n sequences and assembles their output, ``engine.core.stop_strings``
finds stop strings; the scheduler, the model runner and the sampler do a step. With async
scheduling (``EngineConfig.async_scheduling``) the runner's device half runs on
``engine.runner.step_pipeline`` while the next step is scheduled and the previous one finished.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from engine.checkpoint.tokenizer import special_token_id, tokenize
from engine.config import EngineConfig
from engine.core.parallel_sampling import ParentRequest
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.stop_strings import match_stop_string
from engine.core.structured_output import StructuredOutputManager
from engine.core.window_kv import WindowBlocks
from engine.errors import LoRAError, NotAnEmbeddingModel
from engine.outputs import (
    EngineStats,
    ModelRunnerOutput,
    RequestOutput,
    RequestProgress,
    SchedulerOutput,
)
from engine.pooling.embedding import finish_pooling_request, pooling_request
from engine.pooling.inputs import EmbeddingSpec, check_dimensions, encode_inputs, split_inputs
from engine.pooling_params import EmbeddingInputs, PoolingParams
from engine.protocol import ChatTemplate, Prompt
from engine.runner.allocator import keep_step_buffers_on_heap
from engine.runner.model_runner import ModelRunner
from engine.runner.step_pipeline import InFlightStep, StepPipeline
from engine.sampling_params import SamplingParams
from engine.startup import start

if TYPE_CHECKING:
    from engine.protocol import Engine
    from engine.runner.quality import EmbeddingAgreement


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        started = start(config)
        self.model_name = started.model_name
        self.tokenizer = started.tokenizer
        self.model_runner = started.model_runner
        # where start-up time went (bench/startup.py prints it; a worker logs it)
        self.startup_seconds = started.startup_seconds
        num_blocks = self.model_runner.num_kv_blocks
        # An embedding model's limits, None for a generation model.
        self.embedding: EmbeddingSpec | None = started.embedding
        # A request must always fit in the cache on its own, or it could never run (an
        # embedding engine keeps no cache: its inputs are bounded by the model alone).
        self.max_model_len = (started.model_len if self.is_embedding
                              else min(started.model_len, num_blocks * config.block_size))
        # The bf16 embedding quality gate (``engine.pooling.dtype_gate``): its report, when it
        # ran at start-up.
        self.dtype_gate: EmbeddingAgreement | None = started.dtype_gate
        window = None
        if self.model_runner.kv_window is not None:
            size, num_window_blocks = self.model_runner.kv_window
            window = WindowBlocks(num_window_blocks, config.block_size, size,
                                  config.enable_prefix_caching)
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len, window)
        self.eos_token_ids = started.eos_token_ids
        # Built on the first structured request (reading the vocabulary takes a moment).
        self._structured_output: StructuredOutputManager | None = None
        self._parents: dict[str, ParentRequest] = {}
        self._child_to_parent: dict[str, str] = {}
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.prefill_time = 0.0
        self.decode_time = 0.0
        # Async scheduling (EngineConfig.async_scheduling): the device side, and the step it
        # runs while the host prepares the next one.
        self._pipeline: StepPipeline | None = None
        self._in_flight: tuple[SchedulerOutput, InFlightStep] | None = None
        runner = self.model_runner
        if (config.overlaps_steps(runner.device.type) and not self.is_embedding
                and isinstance(runner, ModelRunner)):
            self._pipeline = StepPipeline(runner)
        if self.model_runner.device.type == "cpu":
            # after the build: loading and packing the weights keeps glibc's defaults (their
            # large, once-only buffers go back to the kernel when freed)
            keep_step_buffers_on_heap()

    @property
    def is_embedding(self) -> bool:
        """The engine embeds (``PoolingParams`` requests) instead of generating text."""
        return self.embedding is not None

    @property
    def vocab_size(self) -> int:
        return self.model_runner.vocab_size

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self.tokenizer.chat_template or None

    # ---- tokenization -------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return tokenize(self.tokenizer, prompt)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text if isinstance(text, str) else "".join(text)

    def special_token_id(self, token: str) -> int | None:
        return special_token_id(self.tokenizer, token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt's token ids: ``messages`` (and ``tools``, OpenAI's function shape, for
        templates that describe them) rendered by the model's chat template."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model_name} has no chat template")
        # transformers types ``tools`` as a list of dicts or callables; a list of dicts is one.
        tool_list: list = list(tools) if tools else []
        text = self.tokenizer.apply_chat_template(
            messages, tools=tool_list or None, add_generation_prompt=True, tokenize=False
        )
        if not isinstance(text, str):
            raise ValueError("the chat template did not render to text")
        # The template already holds any BOS it wants: add no special tokens on top.
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | PoolingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        rank: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """Queue one request (``params.n`` sequences) for the next steps.

        ``lora_name``: a registered LoRA adapter (``EngineConfig.lora_modules``) to run it
        under; None runs the base model. An unknown or unreadable adapter raises ``LoRAError``
        (a ValueError naming it).

        ``priority``: lower values are more urgent (vLLM's convention), 0 by default. The
        waiting queue is ordered by (priority, rank, arrival); a request more urgent than a
        running one may take that one's place at the next step (the displaced one is preempted
        by recompute). ``rank`` orders requests of one priority (lower first, 0 by default) and
        nothing more: a lower rank is admitted before higher ranks that are waiting, but never
        preempts a running request nor caps its tokens (a caller's deadlines, say).
        Siblings of an n > 1 request share their prompt's full blocks through the prefix cache.

        ``PoolingParams`` (an embedding engine): ``prompt`` is one input (a text or token ids)
        or a list of them; the request finishes with one vector per input
        (``RequestOutput.embeddings``, ``engine/pooling/embedding.py``).
        """
        for name, value in (("priority", priority), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if isinstance(params, PoolingParams) or self.is_embedding:
            if lora_name is not None:
                raise ValueError("lora_name: an embedding request runs no LoRA adapter")
            if not isinstance(params, PoolingParams):
                raise NotAnEmbeddingModel(f"model {self.model_name} is an embedding model; it "
                                          "does not generate text")
            if not isinstance(prompt, EmbeddingInputs):
                prompt = self.check_embedding(prompt, params)
            elif prompt.params != params:
                raise ValueError("params differ from those the inputs were checked with")
            self._admit(pooling_request(request_id, prompt.token_ids, params,
                                        arrival_time=arrival, priority=priority, rank=rank))
            return
        if lora_name is not None:
            self._check_lora(lora_name)
        if isinstance(prompt, EmbeddingInputs) or (
                not isinstance(prompt, str) and prompt and not isinstance(prompt[0], int)):
            raise ValueError("a generation prompt is one text or one list of token ids")
        prompt = cast(str | list[int], prompt)
        text = prompt if isinstance(prompt, str) else None
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(prompt_ids)
        self._validate_logit_bias(params)
        matchers = None
        if params.structured_output is not None:
            # Compiles (or finds in the cache) now, so a bad format fails this call.
            matchers = self.structured_output.matchers(params.structured_output, params.n)
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self._admit(ParentRequest.fan_out(
            request_id, text, prompt_ids, params, max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids, arrival_time=arrival,
            priority=priority, rank=rank, lora_name=lora_name, grammars=matchers))

    def _admit(self, parent: ParentRequest) -> None:
        """The one way in: register a checked request and queue its sequences."""
        self._parents[parent.request_id] = parent
        for child in parent.children:
            self._child_to_parent[child.request_id] = parent.request_id
            self.scheduler.add_request(child)

    def _embedding_spec(self) -> EmbeddingSpec:
        if self.embedding is None:
            raise NotAnEmbeddingModel(f"model {self.model_name} generates text; it does not "
                                      "embed")
        return self.embedding

    def _tokenize(self, text: str, max_length: int | None) -> list[int]:
        return tokenize(self.tokenizer, text, max_length)

    def check_embedding(self, inputs: Any, params: PoolingParams) -> EmbeddingInputs:
        """The inputs' checked token ids with ``params`` (``engine.pooling.inputs``)."""
        spec = self._embedding_spec()
        check_dimensions(spec, params.dimensions)
        return EmbeddingInputs(encode_inputs(split_inputs(inputs), self._tokenize, spec), params)

    @property
    def lora_names(self) -> list[str]:
        """The registered LoRA adapters, in registration order (empty: LoRA is off)."""
        lora = self.model_runner.lora
        return [] if lora is None else lora.names

    def add_lora(self, name: str, path: str) -> None:
        """Register (or replace) an adapter while the engine runs; its folder is read now."""
        lora = self.model_runner.lora
        if lora is None:
            raise LoRAError(name, "LoRA is off in this engine (start it with lora_modules)")
        self._wait_for_device()
        lora.add_adapter(name, path)

    def _check_lora(self, name: str) -> None:
        lora = self.model_runner.lora
        if lora is None:
            raise LoRAError(name, "LoRA is off in this engine (no lora_modules registered)")
        lora.check(name)
        self._wait_for_device()
        lora.get(name)  # read it now if the LRU dropped it: a bad file fails this request

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but the context is {self.max_model_len} "
                "tokens, which leaves no room to generate"
            )
        vocab = self.model_runner.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def _validate_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.model_runner.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got "
                             f"{max(params.logit_bias)}")

    @property
    def structured_output(self) -> StructuredOutputManager:
        """The grammar compiler and its cache (one per engine, so one per worker)."""
        if self._structured_output is None:
            self._structured_output = StructuredOutputManager(
                self.tokenizer, self.model_runner.vocab_size, self.eos_token_ids
            )
        return self._structured_output

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            parent = self._parents.get(request_id)
            if parent is None:
                continue
            child_ids = [c.request_id for c in parent.children if not c.is_finished]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._finish(parent))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- the loop -----------------------------------------------------------------------------

    @property
    def async_scheduling(self) -> bool:
        """Steps overlap: the host schedules step N+1 while step N runs."""
        return self._pipeline is not None

    def step(self) -> list[RequestOutput]:
        """One step's outputs: the requests that finished in it.

        With async scheduling, the step scheduled now is launched and the one launched by the
        previous call is finished: its outputs are the ones returned. Every kind of request
        overlaps: what its sampling keeps across tokens (a seeded stream's position, penalty
        counts, the min_tokens floor, a grammar's matcher) advances where its tokens are drawn,
        never waiting for the host's copy of them.
        """
        if self._pipeline is None:
            return self._step_now()
        scheduler_output = self.scheduler.schedule(overlap=True)
        launched = None
        if not scheduler_output.is_empty:
            launched = scheduler_output, self._pipeline.launch(scheduler_output,
                                                               self.scheduler.requests)
        outputs = self._finish_in_flight()
        self._in_flight = launched
        if launched is not None and not self._parents:
            # Every request finished in the step before: this one's rows are all dropped, and
            # nothing is left to overlap it with. Done now, the engine is idle when it says so.
            outputs += self._finish_in_flight()
        return outputs

    def _wait_for_device(self) -> None:
        """Let the step in flight finish on the device (its output is still to be finished):
        the LoRA manager's adapters and slots are the device's while a step runs."""
        if self._in_flight is not None:
            self._in_flight[1].result()

    def _step_now(self) -> list[RequestOutput]:
        """A synchronous step: scheduled, run and finished in this call."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        start = time.perf_counter()
        runner_output = self.model_runner.execute(scheduler_output, self.scheduler.requests)
        return self._finish_step(scheduler_output, runner_output, time.perf_counter() - start)

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Wait for the step in flight, if any, and finish it."""
        if self._in_flight is None:
            return []
        scheduler_output, launched = self._in_flight
        self._in_flight = None
        result = launched.result()
        return self._finish_step(scheduler_output, result.output, result.seconds)

    def _finish_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                     elapsed: float) -> list[RequestOutput]:
        """A step's tokens into its requests: stops, grammars, the finished requests' outputs."""
        num_decode = sum(1 for s in scheduler_output.scheduled if s.num_new_tokens == 1)
        num_tokens = max(scheduler_output.num_batched_tokens, 1)
        self.decode_time += elapsed * num_decode / num_tokens
        self.prefill_time += elapsed * (num_tokens - num_decode) / num_tokens
        # Every computed token but the last of each sampling request is prompt (or recompute).
        num_sampled = sum(1 for s in scheduler_output.scheduled if s.sample)
        self.num_prompt_tokens += scheduler_output.num_batched_tokens - num_sampled
        updated, finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_generated_tokens += len(updated)
        # (A grammar advanced where its token was drawn. Its stop tokens are the EOS ids, and
        # structured requests neither ignore EOS nor ban it (min_tokens): a completed grammar
        # has finished its request through the scheduler's EOS check.)
        for request in updated:
            if request.sampling_params.stop and not request.is_finished:
                stop = match_stop_string(request, self.decode)
                if stop is not None:
                    self.scheduler.finish_stopped(request, stop)
                    finished.append(request)
        outputs = []
        for request in finished:
            parent = self._parents.get(self._child_to_parent[request.request_id])
            if parent is not None and parent.child_finished():
                outputs.append(self._finish(parent))
        return outputs

    def _finish(self, parent: ParentRequest) -> RequestOutput:
        del self._parents[parent.request_id]
        for child in parent.children:
            del self._child_to_parent[child.request_id]
        if self.embedding is not None:
            return finish_pooling_request(parent, normalize=self.embedding.normalize)
        return parent.output(self.decode)

    # ---- stats --------------------------------------------------------------------------------

    def progress(self) -> list[RequestProgress]:
        """Every unfinished sequence in the order the scheduler serves them: running, then
        waiting. O(sequences); call it from the thread that steps the engine."""
        sched = self.scheduler
        return [
            RequestProgress(
                request_id=request.parent_id or request.request_id,
                running=running,
                num_tokens=request.num_sampled_tokens,
                # async scheduling: the tokens of steps in flight are counted when back, as
                # the synchronous engine counts them (its last token is computed next)
                num_computed_tokens=(min(request.num_computed_tokens,
                                         request.num_sampled_tokens - 1)
                                     if request.num_placeholders else request.num_computed_tokens),
                num_output_tokens=request.num_sampled_tokens - request.num_prompt_tokens,
                max_tokens=request.max_tokens,
                ignore_eos=request.sampling_params.ignore_eos,
            )
            for running, queue in ((True, sched.running), (False, sched.waiting))
            for request in queue
        ]

    def get_stats(self) -> EngineStats:
        sched = self.scheduler
        kv = sched.kv
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_kv_blocks=kv.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            kv_usage=kv.usage,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=kv.num_queries,
            prefix_cache_hits=kv.num_hits,
            num_steps=sched.num_steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            batch_size_hist=dict(sched.batch_size_hist),
            scheduled_tokens_hist=dict(sched.scheduled_tokens_hist),
            prefill_time=self.prefill_time,
            decode_time=self.decode_time,
        )



if TYPE_CHECKING:
    def _is_an_engine(engine: LLMEngine) -> Engine:
        return engine  # mypy: LLMEngine satisfies the Protocol
