"""LLMEngine: add_request / abort_request / step, the loop the worker drives."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar, cast

import torch

from engine.allocator import keep_step_buffers_on_heap
from engine.config import EngineConfig
from engine.kernels import cpu_decode_attention
from engine.model_runner import ModelRunner
from engine.models.loader import load_checkpoint
from engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    RequestProgress,
)
from engine.pooling_params import PoolingParams
from engine.pooling_runner import PoolingModelRunner
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.structured_output import StructuredOutputManager, accept_token

T = TypeVar("T")


@dataclass
class _UserRequest:
    """A request as the caller sees it: its n sequences and what they produced."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    metrics: RequestMetrics
    num_finished: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        start = time.perf_counter()
        # a GGUF model is converted once to a cached folder; later starts read that instead
        checkpoint = load_checkpoint(config.model, config.tokenizer, convert_gguf=True)
        self.model_name = _model_name(config.model, checkpoint)
        loaded = time.perf_counter()
        # The tokenizer (with the transformers import it needs) loads on a thread while this one
        # builds the model: reading and packing the weights is C code that releases the GIL, so
        # on two or more cores the two overlap (the start-up pays the longer, not the sum).
        with ThreadPoolExecutor(1, thread_name_prefix="boxcar-tokenizer") as pool:
            tokenizer_future = pool.submit(_timed, checkpoint.load_tokenizer)
            try:
                model_len, kernel_seconds, runner_seconds = self._build_runner(config, checkpoint)
            except BaseException:
                tokenizer_future.cancel()
                raise
            self.tokenizer, tokenizer_seconds = tokenizer_future.result()
        kv_seconds = self.model_runner.kv_cache_seconds
        # where start-up time went (bench/startup.py prints it; a service can log it). The
        # tokenizer ran beside the model, so the parts add up to more than the total.
        self.startup_seconds = {
            "checkpoint": loaded - start,
            "tokenizer": tokenizer_seconds,
            "model": runner_seconds - kv_seconds - kernel_seconds,  # build, weights, packing
            "kv_cache": kv_seconds,
            "kernel": kernel_seconds,
            "total": time.perf_counter() - start,
        }
        num_blocks = self.model_runner.num_kv_blocks
        # A request must always fit in the cache on its own, or it could never run (an
        # embedding engine keeps no cache: its inputs are bounded by the model alone).
        self.max_model_len = (model_len if self.is_embedding
                              else min(model_len, num_blocks * config.block_size))
        # The bf16 embedding quality gate (``engine.embedding``): its report, when it ran.
        self.dtype_gate = None
        if self.is_embedding:
            from engine.embedding import gate_embedding_dtype

            self.dtype_gate = gate_embedding_dtype(self, checkpoint, model_len)
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len)
        self.eos_token_ids = _eos_token_ids(checkpoint.config, self.tokenizer)
        # Built on the first structured request (reading the vocabulary takes a moment).
        self._structured_output: StructuredOutputManager | None = None
        self._user_requests: dict[str, _UserRequest] = {}
        self._child_to_user: dict[str, str] = {}
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.prefill_time = 0.0
        self.decode_time = 0.0
        if self.model_runner.device.type == "cpu":
            # after the build: loading and packing the weights keeps glibc's defaults (their
            # large, once-only buffers go back to the kernel when freed)
            keep_step_buffers_on_heap()

    def _build_runner(self, config: EngineConfig, checkpoint) -> tuple[int, float, float]:
        """Build the ModelRunner (weights, KV cache, kernel); returns the model's context
        length, the seconds spent loading the kernel and the seconds of the whole build."""
        start = time.perf_counter()
        hf_config = checkpoint.config
        model_len = int(getattr(hf_config, "max_position_embeddings", 2048))
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True):
            # Attention here is full attention: stay inside the window where the two agree.
            model_len = min(model_len, int(window))
        if config.max_model_len is not None:
            if config.max_model_len > model_len:
                raise ValueError(
                    f"max_model_len={config.max_model_len} exceeds the model's {model_len}"
                )
            model_len = config.max_model_len
        kernel_seconds = cpu_decode_attention.load_seconds
        self.is_embedding = _is_embedding(config, checkpoint)
        self.model_runner: ModelRunner | PoolingModelRunner
        if self.is_embedding:
            self.model_runner = PoolingModelRunner(config, checkpoint, model_len)
            model_len = self.model_runner.max_len
        else:
            self.model_runner = ModelRunner(config, checkpoint, max_position=model_len)
        kernel_seconds = cpu_decode_attention.load_seconds - kernel_seconds
        return model_len, kernel_seconds, time.perf_counter() - start

    # ---- tokenization -------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def apply_chat_template(
        self, messages: list[dict], *, tools: list[dict] | None = None
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
        prompt: str | list[int] | list[str | list[int]],
        params: SamplingParams | PoolingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue one request (``params.n`` sequences) for the next steps.

        ``priority``: lower values are more urgent (vLLM's convention), 0 by default. The
        waiting queue is ordered by (priority, arrival); a request more urgent than a running one
        may take that one's place at the next step (the displaced one is preempted by recompute).
        Siblings of an n > 1 request share their prompt's full blocks through the prefix cache.

        ``PoolingParams`` (an embedding engine): ``prompt`` is one input (a text or token ids)
        or a list of them; the request finishes with one vector per input
        (``RequestOutput.embeddings``, ``engine/embedding.py``).
        """
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if request_id in self._user_requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if isinstance(params, PoolingParams) or self.is_embedding:
            from engine.embedding import add_pooling_request

            add_pooling_request(self, request_id, prompt, params, arrival_time=arrival_time,
                                priority=priority)
            return
        if not isinstance(prompt, str) and prompt and not isinstance(prompt[0], int):
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
        metrics = RequestMetrics(
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            num_prompt_tokens=len(prompt_ids),
        )
        user = _UserRequest(request_id, text, prompt_ids, [], metrics)
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed(params.seed + index)
            child = Request(
                request_id=child_id,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                metrics=RequestMetrics(metrics.arrival_time, num_prompt_tokens=len(prompt_ids)),
                parent_id=request_id,
                index=index,
                priority=priority,
                generator=generator,
                grammar=None if matchers is None else matchers[index],
            )
            user.children.append(child)
            self._child_to_user[child_id] = request_id
        self._user_requests[request_id] = user
        for child in user.children:
            self.scheduler.add_request(child)

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
            user = self._user_requests.get(request_id)
            if user is None:
                continue
            child_ids = [c.request_id for c in user.children if not c.is_finished]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._finish_user_request(user))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._user_requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._user_requests)

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        start = time.perf_counter()
        runner_output = self.model_runner.execute(scheduler_output, self.scheduler.requests)
        elapsed = time.perf_counter() - start
        num_decode = sum(1 for s in scheduler_output.scheduled if s.num_new_tokens == 1)
        num_tokens = max(scheduler_output.num_batched_tokens, 1)
        self.decode_time += elapsed * num_decode / num_tokens
        self.prefill_time += elapsed * (num_tokens - num_decode) / num_tokens
        # Every computed token but the last of each sampling request is prompt (or recompute).
        num_sampled = sum(1 for s in scheduler_output.scheduled if s.sample)
        self.num_prompt_tokens += scheduler_output.num_batched_tokens - num_sampled
        updated, finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_generated_tokens += len(updated)
        for request in updated:
            if request.grammar is not None:
                # The grammar's stop tokens are the EOS ids, and structured requests neither
                # ignore EOS nor ban it (min_tokens): a completed grammar has already finished
                # the request through the scheduler's EOS check.
                accept_token(request, request.token_ids[-1])
            if not request.is_finished and request.sampling_params.stop:
                stop = self._match_stop_string(request)
                if stop is not None:
                    self.scheduler.finish_stopped(request, stop)
                    finished.append(request)
        outputs = []
        for request in finished:
            user = self._user_requests.get(self._child_to_user[request.request_id])
            if user is None:
                continue
            user.num_finished += 1
            if user.num_finished == len(user.children):
                outputs.append(self._finish_user_request(user))
        return outputs

    def _match_stop_string(self, request: Request) -> str | None:
        params = request.sampling_params
        text = self._decode(request.output_token_ids, params.skip_special_tokens)
        # Only the tail can hold a new match: the text before it was checked last step.
        longest = max(len(s) for s in params.stop)
        search_from = max(0, len(request.text) - longest)
        request.text = text
        best: tuple[int, str] | None = None
        for stop in params.stop:
            at = text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        request.text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
        return stop

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text if isinstance(text, str) else "".join(text)

    def _finish_user_request(self, user: _UserRequest) -> RequestOutput:
        if user.children and user.children[0].is_pooling:
            from engine.embedding import finish_pooling_request

            return finish_pooling_request(self, user)
        del self._user_requests[user.request_id]
        completions = []
        for child in user.children:
            del self._child_to_user[child.request_id]
            params = child.sampling_params
            if child.stop_reason is not None and isinstance(child.stop_reason, str):
                text = child.text
            else:
                text = self._decode(child.output_token_ids, params.skip_special_tokens)
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=text,
                    token_ids=child.output_token_ids,
                    finish_reason=child.status.finish_reason,
                    stop_reason=child.stop_reason,
                    logprobs=child.logprobs,
                    metrics=child.metrics,
                )
            )
        metrics = user.metrics
        child_metrics = [c.metrics for c in user.children]
        scheduled = [m.first_scheduled_time for m in child_metrics if m.first_scheduled_time]
        first_tokens = [m.first_token_time for m in child_metrics if m.first_token_time]
        metrics.first_scheduled_time = min(scheduled) if scheduled else None
        metrics.first_token_time = min(first_tokens) if first_tokens else None
        metrics.finished_time = max(m.finished_time or time.monotonic() for m in child_metrics)
        metrics.num_cached_tokens = user.children[0].metrics.num_cached_tokens
        metrics.num_generated_tokens = sum(m.num_generated_tokens for m in child_metrics)
        metrics.num_preemptions = sum(m.num_preemptions for m in child_metrics)
        return RequestOutput(
            request_id=user.request_id,
            prompt=user.prompt,
            prompt_token_ids=user.prompt_token_ids,
            outputs=completions,
            finished=True,
            metrics=metrics,
        )

    # ---- stats --------------------------------------------------------------------------------

    def progress(self) -> list[RequestProgress]:
        """Every unfinished sequence in the order the scheduler serves them: running, then
        waiting. O(sequences); call it from the thread that steps the engine."""
        sched = self.scheduler
        return [
            RequestProgress(
                request_id=request.parent_id or request.request_id,
                running=running,
                num_tokens=request.num_tokens,
                num_computed_tokens=request.num_computed_tokens,
                num_output_tokens=request.num_output_tokens,
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


def _timed(function: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    return function(), time.perf_counter() - start


def _eos_token_ids(hf_config, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.append(source)
        elif isinstance(source, list | tuple):
            ids.extend(int(x) for x in source)
    return tuple(dict.fromkeys(ids))


def _is_embedding(config: EngineConfig, checkpoint) -> bool:
    """Whether the engine pools (``EngineConfig.task``; "auto": an embedding architecture, or a
    sentence-transformers folder with a Pooling module)."""
    if config.task != "auto":
        return config.task == "embed"
    from engine.models.pooling_registry import is_embedding_architecture

    architectures = list(getattr(checkpoint.config, "architectures", None) or [])
    if architectures and is_embedding_architecture(architectures[0]):
        return True
    modules = checkpoint.path / "modules.json" if checkpoint.path.is_dir() else None
    return modules is not None and modules.is_file() and ".Pooling" in modules.read_text()


def _model_name(model: str, checkpoint) -> str:
    path = checkpoint.source or checkpoint.path
    return path.stem if path.suffix == ".gguf" else path.name or model
