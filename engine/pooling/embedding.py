"""Embedding requests in the engine: their one step each, their vectors.

An embedding request is one ``add_request`` call with ``PoolingParams`` and one or more inputs
(texts or token-id lists, checked by ``engine.pooling.inputs``). Each input becomes one pooling
``Request`` (the request's children, as the n sequences of a generation request are), which the
scheduler schedules whole within the token budget, with no KV blocks, beside other requests'
inputs in one packed step; the request finishes when its last input has its vector.
"""

from __future__ import annotations

import time

import torch

from engine.core.parallel_sampling import ParentRequest
from engine.core.request import Request
from engine.layers.pooling import finish_embedding
from engine.outputs import RequestMetrics, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

# A pooling request samples nothing; its Request still carries (unused) sampling params.
_NO_SAMPLING = SamplingParams(max_tokens=1)


def pooling_request(request_id: str, token_ids: list[list[int]], params: PoolingParams, *,
                    arrival_time: float, priority: int, rank: int) -> ParentRequest:
    """One embedding request's parent, with a child ``Request`` per checked input."""
    metrics = RequestMetrics(arrival_time,
                             num_prompt_tokens=sum(len(ids) for ids in token_ids))
    parent = ParentRequest(request_id, None, [], metrics)
    for index, ids in enumerate(token_ids):
        child_id = request_id if len(token_ids) == 1 else f"{request_id}#{index}"
        parent.children.append(Request(
            request_id=child_id, prompt_token_ids=ids, sampling_params=_NO_SAMPLING,
            max_tokens=0, eos_token_ids=(),
            metrics=RequestMetrics(arrival_time, num_prompt_tokens=len(ids)),
            parent_id=request_id, index=index, priority=priority, rank=rank,
            pooling_params=params))
    return parent


def finish_pooling_request(parent: ParentRequest, *, normalize: bool) -> RequestOutput:
    """The finished embedding request: one vector per input, in input order (None for an input
    aborted before its step)."""
    embeddings: list[torch.Tensor | None] = []
    for child in parent.children:
        params = child.pooling_params
        dims = params.dimensions if params is not None else None
        vector = child.embedding
        embeddings.append(None if vector is None else
                          finish_embedding(vector, normalize=normalize, dimensions=dims))
    metrics = parent.metrics
    child_metrics = [c.metrics for c in parent.children]
    scheduled = [m.first_scheduled_time for m in child_metrics if m.first_scheduled_time]
    done = [m.first_token_time for m in child_metrics if m.first_token_time]
    metrics.first_scheduled_time = min(scheduled) if scheduled else None
    metrics.first_token_time = max(done) if len(done) == len(child_metrics) else None
    metrics.finished_time = max(m.finished_time or time.monotonic() for m in child_metrics)
    return RequestOutput(request_id=parent.request_id, prompt=None, prompt_token_ids=[],
                         outputs=[], finished=True, metrics=metrics, embeddings=embeddings)
