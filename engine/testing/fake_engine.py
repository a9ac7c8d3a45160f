"""``FakeEngine``: an ``engine.protocol.Engine`` with no model and no torch, for the worker's and
the CLI's tests and for the scale benchmark (``bench/scale.py`` runs real ``boxcar worker``
processes on it, so it lives in the installed package, beside the contract mypy checks it
against, and imports nothing but the engine's light contracts).

Token ids are characters (``ord``), so any text encodes and decodes back. Each step admits
waiting requests, in (priority, arrival) order, up to ``max_num_seqs`` running, and gives every
running one a token: the prompt's lowercase letters in turn (or ``answer``'s characters). A
request finishes ``"length"`` at its ``max_tokens`` (16 when unset; never past the context) or,
with ``steps_per_request``, ``"stop"`` after that many steps. Asked for logprobs, each token gets
-0.5 and its top alternatives the next characters, -1.5, -2.5, ... Prompts sharing a prefix
report cached tokens in blocks of ``BLOCK``, as a prefix cache would. A prompt containing
``TOO_LONG`` encodes to 5000 tokens, longer than the context.

``is_embedding`` (False by default; settable, or ``is_embedding=True``) makes it an embedding
engine: it takes ``PoolingParams`` requests (one input or a list), checks each input as the
real engine does, and finishes each in its first step with one ``EMBEDDING_SIZE`` vector per
input (the input's length and token-id moments, L2-normalized; torch is imported for these
only), cut to ``dimensions`` when asked; it refuses generation requests, and a generation fake
refuses embedding ones (``NotAnEmbeddingModel``). ``cross_encoder=True`` makes it a
cross-encoder (an embedding engine whose ``embedding.cross_encoder`` is set): each input, a pair
of texts, gets a one-value vector, its score (from the input's token ids and its
``PoolingParams.token_type_starts`` entry).

A step takes ``step_time`` seconds of its clock: steps keep to the clock rather than sleeping a
fixed time, so the host's work between steps overlaps the "device" time as it does on a GPU (a
caller that starves its engine falls below the pace, one that keeps it full holds it exactly).
``FakeEngine.paced(lines_per_s)`` picks ``step_time`` so a full batch finishes that many
requests a second; ``clock`` and ``sleep`` may be injected. ``before_step`` runs at the start of
every step: a ``StepGate``'s ``wait`` lets a test decide when each step happens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.errors import (
    DimensionsNotSupported,
    EmptyInput,
    InputTooLong,
    LoRAError,
    NotAnEmbeddingModel,
    TokenOutOfVocabulary,
)
from engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    RequestProgress,
    TokenLogprob,
)
from engine.pooling.inputs import EmbeddingSpec, split_inputs
from engine.pooling_params import EmbeddingInputs, PoolingParams
from engine.protocol import ChatTemplate, Prompt
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.protocol import Engine

BLOCK = 4  # the fake prefix cache's block, in tokens
DEFAULT_MAX_TOKENS = 16
VOCAB_SIZE = 0x110000  # every Unicode code point
EMBEDDING_SIZE = 8  # an embedding fake's vectors
_NO_SAMPLING = SamplingParams(max_tokens=1)  # what an embedding request carries as params


@dataclass
class _Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    steps_left: int | None  # None: until max_tokens
    generated: list[int] = field(default_factory=list)
    # An embedding request: its params and each input's token ids (None: it generates).
    pooling: PoolingParams | None = None
    inputs: list[list[int]] = field(default_factory=list)


class FakeEngine:
    def __init__(self, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                 max_model_len: int = 4096, steps_per_request: int | None = None,
                 step_time: float = 0.0, chat_template: ChatTemplate | None = None,
                 answer: str | None = None, model_name: str = "fake-model",
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 before_step: Callable[[], None] | None = None,
                 is_embedding: bool = False, cross_encoder: bool = False) -> None:
        if steps_per_request is not None and steps_per_request < 1:
            raise ValueError(f"steps_per_request must be >= 1, got {steps_per_request}")
        if step_time < 0:
            raise ValueError(f"step_time must be >= 0 seconds, got {step_time}")
        self.config = EngineConfig(model=model_name, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = VOCAB_SIZE
        self.chat_template = chat_template
        self.startup_seconds: dict[str, float] = {}
        self.is_embedding = is_embedding or cross_encoder
        self.cross_encoder = cross_encoder
        self.steps_per_request = steps_per_request
        self.answer = answer
        self.step_time = step_time
        self.lines_per_s: float | None = None  # set by ``paced``
        self._clock = clock
        self._sleep = sleep
        self._before_step = before_step
        self._next_step_at: float | None = None
        self._requests: dict[str, _Request] = {}
        self._waiting: list[str] = []
        self._running: list[str] = []
        self._seen_blocks: set[tuple[int, ...]] = set()
        # What a test may look at.
        self.added: list[str] = []  # request ids in the order they were added
        self.order_run: list[str] = []  # request ids in the order they started running
        self.aborted: list[str] = []
        self.priorities: dict[str, int] = {}  # request id -> the priority it was added with
        self.ranks: dict[str, int] = {}  # request id -> the rank it was added with
        self.lora_names: list[str] = []  # adapters a request may name (add_lora registers one)
        self.loras: dict[str, str | None] = {}  # request id -> the adapter it was added with
        self.num_steps = 0
        self.max_batch = 0
        self.thread_ids: set[int] = set()  # threads that added requests or stepped
        # EngineStats counters.
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_cache_queries = 0
        self._num_cache_hits = 0
        self._batch_size_hist: dict[int, int] = {}
        self._scheduled_tokens_hist: dict[int, int] = {}

    @classmethod
    def paced(cls, lines_per_s: float | None, *, max_num_seqs: int = 64,
              steps_per_request: int = 8, **kwargs: Any) -> FakeEngine:
        """The scale benchmark's engine. ``lines_per_s=None`` is *instant*: a request finishes
        in its first step, without sleeping, so a worker runs as fast as the control plane
        feeds it. Otherwise *paced like a GPU*: a request takes ``steps_per_request`` steps and
        a step the same time whatever its batch (decode is memory bound), so that a full batch
        finishes ``lines_per_s`` requests a second."""
        if lines_per_s is not None and lines_per_s <= 0:
            raise ValueError(f"lines_per_s must be > 0 (or None: instant), got {lines_per_s}")
        if max_num_seqs < 1 or steps_per_request < 1:
            raise ValueError("max_num_seqs and steps_per_request must be >= 1, got "
                             f"{max_num_seqs} and {steps_per_request}")
        if lines_per_s is None:
            steps_per_request, step_time = 1, 0.0
        else:
            step_time = max_num_seqs / steps_per_request / lines_per_s
        engine = cls(max_num_seqs=max_num_seqs, max_num_batched_tokens=8 * max_num_seqs,
                     steps_per_request=steps_per_request, step_time=step_time,
                     model_name=kwargs.pop("model_name", "bench-fake"), **kwargs)
        engine.lines_per_s = lines_per_s
        return engine

    # -- tokens -------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        if "TOO_LONG" in prompt:  # an over-long prompt, as the engine sees one
            return [ord("x")] * 5000
        return [ord(c) for c in prompt]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(t) for t in token_ids)

    def special_token_id(self, token: str) -> int | None:
        return None  # no special tokens: never a harmony model

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not messages:
            raise ValueError("no messages")
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)
        return self.encode(text + "<assistant>")

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt,
                    params: SamplingParams | PoolingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    rank: int = 0, lora_name: str | None = None) -> None:
        self.thread_ids.add(threading.get_ident())
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already in the engine")
        if isinstance(params, PoolingParams) != self.is_embedding:
            raise NotAnEmbeddingModel(
                f"model {self.model_name} "
                + ("is an embedding model; it does not generate text" if self.is_embedding
                   else "generates text; it does not embed"))
        if lora_name is not None and lora_name not in self.lora_names:
            raise LoRAError(lora_name, "not registered")
        arrival = self._clock() if arrival_time is None else arrival_time
        if isinstance(params, PoolingParams):
            if not isinstance(prompt, EmbeddingInputs):
                prompt = self.check_embedding(prompt, params)
            inputs = prompt.token_ids
            request = _Request([t for ids in inputs for t in ids], _NO_SAMPLING,
                               RequestMetrics(arrival, num_prompt_tokens=sum(map(len, inputs))),
                               None, pooling=params, inputs=inputs)
        else:
            if isinstance(prompt, EmbeddingInputs) or (
                    not isinstance(prompt, str) and prompt and not isinstance(prompt[0], int)):
                raise ValueError("a generation prompt is one text or one list of token ids")
            token_ids = (self.encode(prompt) if isinstance(prompt, str)
                         else [t for t in prompt if isinstance(t, int)])
            # Refused as the real engine refuses it: empty, or no room left to generate.
            if not token_ids:
                raise ValueError("the prompt is empty")
            if len(token_ids) >= self.max_model_len:
                raise ValueError(f"prompt has {len(token_ids)} tokens >= max_model_len "
                                 f"{self.max_model_len}")
            request = _Request(token_ids, params,
                               RequestMetrics(arrival, num_prompt_tokens=len(token_ids)),
                               self.steps_per_request)
        self.loras[request_id] = lora_name
        self._requests[request_id] = request
        self.priorities[request_id] = priority
        self.ranks[request_id] = rank
        self._waiting.append(request_id)
        # Waiting in the engine's order: (priority, rank, arrival), lower first (a stable sort).
        self._waiting.sort(key=lambda rid: (self.priorities[rid], self.ranks[rid]))
        self.added.append(request_id)

    @property
    def embedding(self) -> EmbeddingSpec | None:
        if not self.is_embedding:
            return None
        return EmbeddingSpec(self.model_name, self.max_model_len, VOCAB_SIZE,
                             1 if self.cross_encoder else EMBEDDING_SIZE, None, True, False,
                             self.cross_encoder)

    def check_embedding(self, inputs: Any, params: PoolingParams) -> EmbeddingInputs:
        if not self.is_embedding:
            raise NotAnEmbeddingModel(f"model {self.model_name} generates text; it does not "
                                      "embed")
        dimensions = params.dimensions
        # Any size up to ``EMBEDDING_SIZE`` (as a model declaring every Matryoshka size).
        if dimensions is not None and dimensions > EMBEDDING_SIZE:
            raise DimensionsNotSupported(f"dimensions must be at most {EMBEDDING_SIZE} for "
                                         f"model {self.model_name}, got {dimensions}")
        inputs = split_inputs(inputs)
        if not inputs:
            raise EmptyInput("input is empty")
        token_ids = []
        for index, item in enumerate(inputs):
            ids = self.encode(item) if isinstance(item, str) else list(item)
            if not ids:
                raise EmptyInput("input has no tokens", index)
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise TokenOutOfVocabulary(f"token ids must be in [0, {self.vocab_size})", index)
            if len(ids) > self.max_model_len:
                raise InputTooLong(f"input is {len(ids)} tokens; this model's maximum input "
                                   f"length is {self.max_model_len} tokens", index)
            token_ids.append(ids)
        return EmbeddingInputs(token_ids, params)

    def add_lora(self, name: str, path: str) -> None:
        if name not in self.lora_names:
            self.lora_names.append(name)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            if rid in self._requests:
                self.aborted.append(rid)
                outputs.append(self._finish(rid, "abort"))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if self._before_step is not None:
            self._before_step()
        self._keep_pace()
        now = self._clock()
        self.num_steps += 1
        num_prompt = 0
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            rid = self._waiting.pop(0)
            self._running.append(rid)
            self.order_run.append(rid)
            request = self._requests[rid]
            cached = self._cached_tokens(request.prompt_token_ids)
            request.metrics.num_cached_tokens = cached
            request.metrics.first_scheduled_time = now
            # Every prompt token but the last (which samples the first token) is prompt work.
            num_prompt += len(request.prompt_token_ids) - 1 - cached
        num_running = len(self._running)
        self.max_batch = max(self.max_batch, num_running)
        finished = []
        for rid in list(self._running):
            request = self._requests[rid]
            if request.pooling is not None:  # embedded whole in its first step
                request.metrics.first_token_time = now
                finished.append(self._finish(rid, "stop"))
                continue
            request.generated.append(self._next_token(request))
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if request.steps_left is not None:
                request.steps_left -= 1
                if request.steps_left <= 0:
                    finished.append(self._finish(rid, "stop"))
            elif len(request.generated) >= self._max_tokens(request):
                finished.append(self._finish(rid, "length"))
        self._num_prompt_tokens += num_prompt
        self._num_generated_tokens += num_running
        if num_running:
            self._batch_size_hist[num_running] = self._batch_size_hist.get(num_running, 0) + 1
            tokens = num_prompt + num_running
            self._scheduled_tokens_hist[tokens] = self._scheduled_tokens_hist.get(tokens, 0) + 1
        return finished

    def _next_token(self, request: _Request) -> int:
        if self.answer:
            choices = [ord(c) for c in self.answer]
        else:
            choices = [t for t in request.prompt_token_ids if 97 <= t <= 122] or [120]
        return choices[len(request.generated) % len(choices)]

    def _max_tokens(self, request: _Request) -> int:
        room = self.max_model_len - len(request.prompt_token_ids)
        return min(request.params.max_tokens or DEFAULT_MAX_TOKENS, room)

    def _keep_pace(self) -> None:
        """Sleep until this step's slot on the clock; a clock more than a step behind (the engine
        sat idle, or the host was slower than the pace) starts over from now."""
        if not self.step_time:
            return
        now = self._clock()
        if self._next_step_at is None or now - self._next_step_at > self.step_time:
            self._next_step_at = now
        if self._next_step_at > now:
            self._sleep(self._next_step_at - now)
        self._next_step_at += self.step_time

    def _cached_tokens(self, prompt: list[int]) -> int:
        self._num_cache_queries += len(prompt) - 1
        cached = 0
        for end in range(BLOCK, len(prompt), BLOCK):
            if tuple(prompt[:end]) not in self._seen_blocks:
                break
            cached = end
        for end in range(BLOCK, len(prompt) + 1, BLOCK):
            self._seen_blocks.add(tuple(prompt[:end]))
        self._num_cache_hits += cached
        return cached

    def _finish(self, rid: str, reason: str) -> RequestOutput:
        request = self._requests.pop(rid)
        for queue in (self._waiting, self._running):
            if rid in queue:
                queue.remove(rid)
        request.metrics.finished_time = self._clock()
        if request.pooling is not None:
            vectors = (_scores(request.inputs, request.pooling) if self.cross_encoder
                       else _vectors(request.inputs, request.pooling.dimensions))
            return RequestOutput(rid, None, [], [], True, request.metrics, embeddings=vectors)
        request.metrics.num_generated_tokens = len(request.generated) * request.params.n
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = [TokenLogprob(t, -0.5, [(t + k, -0.5 - k)
                                               for k in range(request.params.logprobs)])
                        for t in request.generated]
        completions = [CompletionOutput(index=i, text=self.decode(request.generated),
                                        token_ids=list(request.generated), finish_reason=reason,
                                        logprobs=logprobs)
                       for i in range(request.params.n)]
        return RequestOutput(rid, None, request.prompt_token_ids, completions, True,
                             request.metrics)

    # -- stats --------------------------------------------------------------------------------

    def progress(self) -> list[RequestProgress]:
        """Running then waiting, as LLMEngine.progress (a running request's prompt is done)."""
        result = []
        for running, queue in ((True, self._running), (False, self._waiting)):
            for rid in queue:
                request = self._requests[rid]
                num_tokens = len(request.prompt_token_ids) + len(request.generated)
                result.append(RequestProgress(
                    rid, running, num_tokens, num_tokens - 1 if running else 0,
                    len(request.generated), self._max_tokens(request),
                    request.params.ignore_eos))
        return result

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running), num_waiting=len(self._waiting),
            num_kv_blocks=0, num_free_kv_blocks=0, kv_usage=0.0, num_preemptions=0,
            prefix_cache_queries=self._num_cache_queries,
            prefix_cache_hits=self._num_cache_hits, num_steps=self.num_steps,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self._num_generated_tokens,
            batch_size_hist=dict(self._batch_size_hist),
            scheduled_tokens_hist=dict(self._scheduled_tokens_hist))


def _vectors(inputs: list[list[int]], dimensions: int | None) -> list[Any]:
    """An embedding fake's vectors: per input, its length and token-id moments, normalized
    (cut to ``dimensions`` first)."""
    import torch

    vectors = []
    for ids in inputs:
        t = torch.tensor(ids, dtype=torch.float64)
        features = [float(len(ids)), *(float((t / 128).pow(k).mean())
                                       for k in range(1, EMBEDDING_SIZE))]
        vector = torch.tensor(features[:dimensions or EMBEDDING_SIZE], dtype=torch.float32)
        vectors.append(torch.nn.functional.normalize(vector, dim=0))
    return vectors


def _scores(inputs: list[list[int]], params: PoolingParams) -> list[Any]:
    """A cross-encoder fake's scores: per pair, the share of its second text's token ids that
    its first text holds too (1.0: every one), as a one-value vector."""
    import torch

    starts = params.token_type_starts or ()
    scores = []
    for index, ids in enumerate(inputs):
        start = starts[index] if index < len(starts) else len(ids)
        first, second = set(ids[:start]), ids[start:]
        score = sum(t in first for t in second) / len(second) if second else 0.0
        scores.append(torch.tensor([score], dtype=torch.float32))
    return scores


class StepGate:
    """Steps on demand: pass ``wait`` as a ``FakeEngine``'s ``before_step``; each step then
    waits until ``allow`` lets one more through (or ``open`` lets all through)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._allowed = 0
        self._open = False
        self._blocked = False
        self.num_passed = 0

    def wait(self) -> None:
        with self._cond:
            self._blocked = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._open or self._allowed > 0)
            self._blocked = False
            if not self._open:
                self._allowed -= 1
            self.num_passed += 1

    def allow(self, num_steps: int = 1) -> None:
        with self._cond:
            self._allowed += num_steps
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    @property
    def num_allowed(self) -> int:
        """Steps allowed that have not started yet."""
        with self._cond:
            return self._allowed

    def wait_blocked(self, timeout: float, *,
                     or_when: Callable[[], bool] = lambda: False) -> bool:
        """Wait until a step waits at the gate with none allowed (the steps allowed so far have
        run), or until ``or_when()`` (checked every few ms: e.g. the engine has no work left);
        False if neither came within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self._blocked and not self._allowed):
                if or_when():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.005))
            return True

if TYPE_CHECKING:
    def _is_an_engine(engine: FakeEngine) -> Engine:
        return engine  # mypy: FakeEngine satisfies the Protocol
