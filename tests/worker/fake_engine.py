"""A small stand-in for engine.LLMEngine with the same methods, for the worker's tests.

Each step gives every running request one token (a letter of the prompt, cycling); a request
finishes at ``max_tokens``. Prompts sharing a prefix report cached tokens in blocks of 4, like
a prefix cache would. A prompt containing ``TOO_LONG`` encodes to 5000 tokens, longer than the
context.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from bench.fake_engine import prompt_token_ids
from engine.lora.errors import LoRAError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestProgress
from engine.sampling_params import SamplingParams

BLOCK = 4


@dataclass(frozen=True)
class FakeConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64


class FakeTokenizer:
    eos_token_id = 0
    chat_template = "fake"

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)


class FakeEngine:
    def __init__(self, *, max_num_seqs: int = 8, step_time: float = 0.0,
                 max_model_len: int = 4096) -> None:
        self.config = FakeConfig(max_num_seqs=max_num_seqs)
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.lora_names: list[str] = []
        self.loras: dict[str, str | None] = {}  # request id -> the adapter it was added with
        self.max_model_len = max_model_len
        self.step_time = step_time
        self._waiting: list[str] = []
        self._running: list[str] = []
        self._requests: dict[str, tuple[list[int], SamplingParams, list[int], RequestMetrics]] = {}
        self._seen_blocks: set[tuple[int, ...]] = set()
        self.added: list[str] = []  # request ids in the order they were added
        self.order_run: list[str] = []  # request ids in the order they started running
        self.aborted: list[str] = []
        self.priorities: dict[str, int] = {}  # request id -> the priority it was added with
        self.num_steps = 0
        self.max_batch = 0
        self.thread_ids: set[int] = set()

    def encode(self, prompt: str) -> list[int]:
        if "TOO_LONG" in prompt:  # an over-long prompt, as the engine sees one
            return [ord("x")] * 5000
        return [ord(c) for c in prompt]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not messages:
            raise ValueError("no messages")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.encode(text)

    def add_request(self, request_id: str, prompt, params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_name: str | None = None) -> None:
        self.thread_ids.add(threading.get_ident())
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already in the engine")
        if lora_name is not None and lora_name not in self.lora_names:
            raise LoRAError(lora_name, "not registered")
        self.loras[request_id] = lora_name
        token_ids = prompt_token_ids(self, prompt)
        metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(token_ids))
        self._requests[request_id] = (token_ids, params, [], metrics)
        self.priorities[request_id] = priority
        self._waiting.append(request_id)
        # Waiting in the engine's order: (priority, arrival), lower first (sort is stable).
        self._waiting.sort(key=lambda rid: self.priorities[rid])
        self.added.append(request_id)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            if rid not in self._requests:
                continue
            self.aborted.append(rid)
            outputs.append(self._output(rid, "abort"))
            self._forget(rid)
        return outputs

    def _forget(self, rid: str) -> None:
        self._requests.pop(rid, None)
        for queue in (self._waiting, self._running):
            if rid in queue:
                queue.remove(rid)

    def _output(self, rid: str, reason: str) -> RequestOutput:
        prompt, params, generated, metrics = self._requests[rid]
        metrics.finished_time = time.monotonic()
        metrics.num_generated_tokens = len(generated)
        completions = [
            CompletionOutput(index=i, text="".join(chr(t) for t in generated),
                             token_ids=list(generated), finish_reason=reason)
            for i in range(params.n)
        ]
        return RequestOutput(rid, None, prompt, completions, True, metrics)

    def _cached_tokens(self, prompt: list[int]) -> int:
        cached = 0
        for end in range(BLOCK, len(prompt), BLOCK):
            if tuple(prompt[:end]) not in self._seen_blocks:
                break
            cached = end
        for end in range(BLOCK, len(prompt) + 1, BLOCK):
            self._seen_blocks.add(tuple(prompt[:end]))
        return cached

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if self.step_time:
            time.sleep(self.step_time)
        self.num_steps += 1
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            rid = self._waiting.pop(0)
            self._running.append(rid)
            self.order_run.append(rid)
            prompt, _, _, metrics = self._requests[rid]
            metrics.num_cached_tokens = self._cached_tokens(prompt)
            metrics.first_scheduled_time = time.monotonic()
        self.max_batch = max(self.max_batch, len(self._running))
        finished = []
        for rid in list(self._running):
            prompt, params, generated, _ = self._requests[rid]
            letters = [t for t in prompt if 97 <= t <= 122] or [120]
            generated.append(letters[len(generated) % len(letters)])
            if len(generated) >= (params.max_tokens or 16):
                finished.append(self._output(rid, "length"))
                self._forget(rid)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def progress(self) -> list[RequestProgress]:
        """Running then waiting, as LLMEngine.progress (a running request's prompt is done)."""
        result = []
        for running, queue in ((True, self._running), (False, self._waiting)):
            for rid in queue:
                prompt, params, generated, _ = self._requests[rid]
                num_tokens = len(prompt) + len(generated)
                result.append(RequestProgress(
                    rid, running, num_tokens, num_tokens - 1 if running else 0, len(generated),
                    params.max_tokens or 16, params.ignore_eos))
        return result

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)
