"""n > 1: one caller's request fanned out to n sequences, and their outputs assembled back into
one ``RequestOutput`` (vLLM's ``ParentRequest``).

Child ``i`` of request ``r`` is ``r#i`` (just ``r`` when n is 1), seeded ``seed + i``; children
share the prompt, so their full prompt blocks are computed once through the prefix cache. The
caller's request finishes when its last child does; its metrics are the children's together.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.core.request import Request
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams


@dataclass
class ParentRequest:
    """A request as the caller sees it: its n sequences and what they produced."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    children: list[Request] = field(default_factory=list)
    num_finished: int = 0

    @classmethod
    def fan_out(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                params: SamplingParams, *, max_tokens: int, eos_token_ids: tuple[int, ...],
                arrival_time: float, priority: int, rank: int,
                lora_name: str | None = None,
                grammars: list[Any] | None = None) -> ParentRequest:
        """The parent and its ``params.n`` children (``grammars``: one matcher per child)."""
        num_prompt = len(prompt_token_ids)
        parent = cls(request_id, prompt, prompt_token_ids,
                     RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=num_prompt))
        for index in range(params.n):
            parent.children.append(Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids=prompt_token_ids,
                sampling_params=params,
                max_tokens=max_tokens,
                eos_token_ids=eos_token_ids,
                metrics=RequestMetrics(arrival_time, num_prompt_tokens=num_prompt),
                parent_id=request_id,
                index=index,
                priority=priority,
                rank=rank,
                lora_name=lora_name,
                seed=None if params.seed is None else params.seed + index,
                grammar=None if grammars is None else grammars[index],
            ))
        return parent

    def child_finished(self) -> bool:
        """Count one more finished child; True when it was the last."""
        self.num_finished += 1
        return self.num_finished == len(self.children)

    def output(self, decode: Callable[[list[int], bool], str]) -> RequestOutput:
        """The finished request: one completion per child, in index order, and the children's
        metrics together. ``decode(token_ids, skip_special_tokens)`` makes each text (a child
        cut by a stop string keeps the text the match left)."""
        completions = []
        for child in self.children:
            if isinstance(child.stop_reason, str):
                text = child.text
            else:
                text = decode(child.output_token_ids, child.sampling_params.skip_special_tokens)
            completions.append(CompletionOutput(
                index=child.index,
                text=text,
                token_ids=child.output_token_ids,
                finish_reason=child.status.finish_reason,
                stop_reason=child.stop_reason,
                logprobs=child.logprobs,
                metrics=child.metrics,
            ))
        metrics = self.metrics
        child_metrics = [c.metrics for c in self.children]
        scheduled = [m.first_scheduled_time for m in child_metrics if m.first_scheduled_time]
        first_tokens = [m.first_token_time for m in child_metrics if m.first_token_time]
        metrics.first_scheduled_time = min(scheduled) if scheduled else None
        metrics.first_token_time = min(first_tokens) if first_tokens else None
        metrics.finished_time = max(m.finished_time or time.monotonic() for m in child_metrics)
        metrics.num_cached_tokens = self.children[0].metrics.num_cached_tokens
        metrics.num_generated_tokens = sum(m.num_generated_tokens for m in child_metrics)
        metrics.num_preemptions = sum(m.num_preemptions for m in child_metrics)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=True,
            metrics=metrics,
        )
