"""Embedding requests in the engine: their inputs, their one step each, their vectors.

An embedding request is one ``add_request`` call with ``PoolingParams`` and one or more inputs
(texts or token-id lists). Each input becomes one pooling ``Request`` (the request's children,
as the n sequences of a generation request are), which the scheduler schedules whole within the
token budget, with no KV blocks, beside other requests' inputs in one packed step; the request
finishes when its last input has its vector. Inputs are checked here once, with typed errors
(``EmbeddingInputError``) a caller can map to its own codes; an input longer than the model's
limit fails unless ``EngineConfig.truncate_embedding_inputs`` cuts it.

The bf16 quality gate: an engine whose ``dtype`` is "auto" and came out bf16 embeds a fixed
probe corpus in bf16 and in fp32 at start-up; if any probe's cosine to fp32 is below
``MIN_BF16_COSINE`` the engine runs in fp32 instead (``LLMEngine.dtype_gate`` says which).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from engine.core.parallel_sampling import ParentRequest
from engine.core.request import Request
from engine.errors import NotAnEmbeddingModel
from engine.layers.pooling import finish_embedding
from engine.outputs import RequestMetrics, RequestOutput
from engine.pooling.inputs import check_dimensions, encode_inputs, pooling_runner, split_inputs
from engine.pooling.runner import PoolingModelRunner
from engine.pooling_params import PoolingParams
from engine.runner.quality import EmbeddingAgreement, embedding_agreement
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

MIN_BF16_COSINE = 0.999
# A pooling request samples nothing; its Request still carries (unused) sampling params.
_NO_SAMPLING = SamplingParams(max_tokens=1)


def add_pooling_request(engine: LLMEngine, request_id: str, prompt: Any, params: Any, *,
                        arrival_time: float | None, priority: int, rank: int = 0) -> None:
    """``LLMEngine.add_request`` for ``PoolingParams`` (module docstring)."""
    if not engine.is_embedding:
        raise NotAnEmbeddingModel(f"model {engine.model_name} generates text; it does not "
                                  "embed")
    if not isinstance(params, PoolingParams):
        raise NotAnEmbeddingModel(f"model {engine.model_name} is an embedding model; it does "
                                  "not generate text")
    check_dimensions(engine, params.dimensions)
    token_ids = encode_inputs(engine, split_inputs(prompt))
    arrival = time.monotonic() if arrival_time is None else arrival_time
    metrics = RequestMetrics(arrival, num_prompt_tokens=sum(len(ids) for ids in token_ids))
    parent = ParentRequest(request_id, None, [], metrics)
    for index, ids in enumerate(token_ids):
        child_id = request_id if len(token_ids) == 1 else f"{request_id}#{index}"
        parent.children.append(Request(
            request_id=child_id, prompt_token_ids=ids, sampling_params=_NO_SAMPLING,
            max_tokens=0, eos_token_ids=(), metrics=RequestMetrics(arrival,
                                                                   num_prompt_tokens=len(ids)),
            parent_id=request_id, index=index, priority=priority, rank=rank,
            pooling_params=params))
        engine._child_to_parent[child_id] = request_id
    engine._parents[request_id] = parent
    for child in parent.children:
        engine.scheduler.add_request(child)


def finish_pooling_request(engine: LLMEngine, parent: ParentRequest) -> RequestOutput:
    """The finished embedding request (``LLMEngine._finish`` has already forgotten it): one
    vector per input, in input order (None for an input aborted before its step)."""
    normalize = pooling_runner(engine).pooler.normalize
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


# The probes of the bf16 gate: short and long, several scripts, digits and code, repetition.
PROBE_TEXTS = (
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital and most populous city of France.",
    "Machine learning models map inputs to vectors; similar inputs map to nearby vectors.",
    "東京は日本の首都であり、世界有数の大都市である。",
    "Привет, как дела? Сегодня хорошая погода.",
    "def add(a, b):\n    return a + b  # 1 + 2 == 3",
    "€100, 42%, 3.14159, 2026-12-01T21:00:00Z, user@example.com",
    "emoji 🚀🔥 and accents: café, naïve, façade",
    " ".join(["a long input about search indexes, deduplication and clustering"] * 40),
)


def gate_embedding_dtype(engine: LLMEngine, checkpoint: Any,
                         max_position: int) -> EmbeddingAgreement | None:
    """The bf16 gate (module docstring); None when it does not apply (an explicit dtype, or
    "auto" came out fp32)."""
    runner = pooling_runner(engine)
    if engine.config.dtype != "auto" or runner.dtype == torch.float32:
        return None
    reference = PoolingModelRunner(engine.config, checkpoint, max_position, dtype=torch.float32)
    max_len = engine.max_model_len
    token_ids = [list(engine.tokenizer(t, truncation=True, max_length=max_len).input_ids)
                 for t in PROBE_TEXTS]
    report = embedding_agreement(reference, runner, token_ids, min_cosine=MIN_BF16_COSINE)
    if not report.passed:
        engine.model_runner = reference
    return report
