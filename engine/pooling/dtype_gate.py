"""The bf16 quality gate of an embedding model, run at start-up: an engine whose ``dtype`` is
"auto" and came out bf16 embeds a fixed probe corpus in bf16 and in fp32; if any probe's cosine
to fp32 is below ``MIN_BF16_COSINE`` the engine runs in fp32 instead (``LLMEngine.dtype_gate``
says which). A cross-encoder under "auto" runs fp32."""

from __future__ import annotations

import torch

from engine.checkpoint.loader import Checkpoint
from engine.config import EngineConfig
from engine.pooling.inputs import Tokenize
from engine.pooling.runner import PoolingModelRunner
from engine.runner.quality import EmbeddingAgreement, embedding_agreement

MIN_BF16_COSINE = 0.999

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


def gate_embedding_dtype(
    config: EngineConfig, checkpoint: Checkpoint, runner: PoolingModelRunner,
    tokenize: Tokenize, max_position: int,
) -> tuple[PoolingModelRunner, EmbeddingAgreement | None]:
    """The runner to serve with (``runner``, or an fp32 one where bf16 fails the gate) and the
    gate's report; None when the gate does not apply (an explicit dtype, or "auto" came out
    fp32)."""
    if config.dtype != "auto" or runner.dtype == torch.float32:
        return runner, None
    reference = PoolingModelRunner(config, checkpoint, max_position, dtype=torch.float32)
    if runner.cross_encoder:
        # One score a pair: a cosine to fp32 says nothing of it (no gate for it yet), so "auto"
        # serves a cross-encoder in fp32.
        return reference, None
    token_ids = [tokenize(text, runner.max_len) for text in PROBE_TEXTS]
    report = embedding_agreement(reference, runner, token_ids, min_cosine=MIN_BF16_COSINE)
    return (runner if report.passed else reference), report
