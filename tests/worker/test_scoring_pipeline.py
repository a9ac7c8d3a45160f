"""Rerank and score lines through the one request pipeline (``pipeline.engine_adapter`` and
``pipeline.scoring``): a cross-encoder gets one input a pair with its token types, an embedding
model every text once and cosines; each line meets only a model kind that serves it (a
``wrong_model_kind`` line error otherwise, both ways); an input the model cannot take names its
field. On the fake engines (``FakeEngine(cross_encoder=True)``, ``is_embedding=True``)."""

from __future__ import annotations

import pytest
import torch

from engine.testing.fake_engine import FakeEngine
from pipeline.engine_adapter import PrepareError, add_to_engine, prepare, response_body
from pipeline.scoring import ScoreInput

RERANK = {"query": "abc", "documents": ["abd", "xyz", "abc", {"text": "cab"}], "top_n": 3}
SCORE = {"text_1": ["ab", "xy"], "text_2": ["ba", "zz"]}


def run(engine: FakeEngine, url: str, body: dict) -> dict:
    engine_input = prepare(engine, url, body)
    assert isinstance(engine_input, ScoreInput), engine_input
    assert add_to_engine(engine, "r", engine_input) is None
    (output,) = engine.step()
    response, usage = response_body(output, endpoint=url, model="m", engine=engine,
                                    hex_id="1", score=engine_input.score)
    assert response["usage"] == {"prompt_tokens": usage.prompt_tokens,
                                 "total_tokens": usage.prompt_tokens}
    assert usage.prompt_tokens == engine_input.num_tokens and usage.completion_tokens == 0
    return response


def test_cross_encoder_pairs_and_token_types():
    engine = FakeEngine(cross_encoder=True)
    engine_input = prepare(engine, "/v1/rerank", RERANK)
    assert isinstance(engine_input, ScoreInput)
    # One input a pair: the query's tokens, then the document's without its first token (a
    # BERT tokenizer's [CLS]; the fake has none); the document's are type 1.
    assert engine_input.inputs.token_ids[0] == [ord(c) for c in "abcbd"]
    assert engine_input.params.token_type_starts == (3, 3, 3, 3)
    body = run(engine, "/v1/rerank", RERANK)
    # The fake scores a pair by the share of the document's tokens the query holds.
    assert body["results"] == [
        {"index": 2, "relevance_score": 1.0, "document": {"text": "abc"}},
        {"index": 3, "relevance_score": 1.0, "document": {"text": "cab"}},
        {"index": 0, "relevance_score": 0.5, "document": {"text": "abd"}}]
    assert body["id"] == "rerank-1" and body["model"] == "m"
    assert body["usage"]["prompt_tokens"] == 4 * 5

    score = run(engine, "/v1/score", SCORE)
    assert [d["score"] for d in score["data"]] == [1.0, 0.0]
    assert score["object"] == "list" and score["data"][0]["object"] == "score"


def test_an_embedding_model_scores_by_cosine():
    engine = FakeEngine(is_embedding=True)
    engine_input = prepare(engine, "/v1/rerank", RERANK)
    assert isinstance(engine_input, ScoreInput)
    # Each text once: the query, then the documents.
    assert len(engine_input.inputs.token_ids) == 5
    assert engine_input.params.token_type_starts is None
    body = run(engine, "/v1/rerank", {**RERANK, "return_documents": False, "top_n": None})
    assert body["results"][0] == {"index": 2, "relevance_score": pytest.approx(1.0, abs=1e-6)}
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 4
    # The score of a pair is the cosine of its two vectors.
    fake_vectors = engine.check_embedding(["ab", "ba"], engine_input.params)
    assert fake_vectors.num_tokens == 4
    one_to_many = run(engine, "/v1/score", {"text_1": "ab", "text_2": ["ab", "ba"]})
    assert one_to_many["data"][0]["score"] == pytest.approx(1.0, abs=1e-6)
    assert len(one_to_many["data"]) == 2
    assert one_to_many["usage"]["prompt_tokens"] == 6  # "ab" once, then both texts


@pytest.mark.parametrize(("engine", "url", "body", "message"), [
    (FakeEngine(), "/v1/rerank", RERANK,
     "model fake-model generates text and cannot serve /v1/rerank or /v1/score: send this "
     "line to a cross-encoder or an embedding model"),
    (FakeEngine(), "/v1/score", SCORE, "cannot serve /v1/rerank or /v1/score"),
    (FakeEngine(cross_encoder=True), "/v1/embeddings", {"input": "x"},
     "model fake-model is a cross-encoder: it serves /v1/rerank and /v1/score only, not "
     "/v1/embeddings"),
    (FakeEngine(cross_encoder=True), "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}]},
     "is a cross-encoder: it serves /v1/rerank and /v1/score only, not chat or completions"),
    (FakeEngine(is_embedding=True), "/v1/completions", {"prompt": "hi"},
     "is an embedding model: it serves /v1/embeddings (and /v1/rerank, /v1/score by cosine)"),
])
def test_a_line_on_a_model_of_the_wrong_kind(engine, url, body, message):
    error = prepare(engine, url, body)
    assert isinstance(error, PrepareError)
    assert error.code == "wrong_model_kind" and error.param == "model"
    assert message in error.message and error.message.startswith("model fake-model")


def test_an_input_the_model_cannot_take_names_its_field():
    cross = FakeEngine(cross_encoder=True, max_model_len=8)
    error = prepare(cross, "/v1/rerank", {"query": "abc", "documents": ["ab", "abcdefg"]})
    assert isinstance(error, PrepareError)
    assert (error.code, error.param) == ("context_length_exceeded", "documents")
    assert error.message.startswith("body.documents[1] (paired with body.query): input is 9 "
                                    "tokens"), error.message
    error = prepare(cross, "/v1/score", {"text_1": ["a", "abcdefghi"], "text_2": ["b", "c"]})
    assert isinstance(error, PrepareError)
    assert error.message.startswith("body.text_2[1] (paired with body.text_1[1])")

    bi = FakeEngine(is_embedding=True, max_model_len=4)
    error = prepare(bi, "/v1/rerank", {"query": "abcde", "documents": ["ab"]})
    assert isinstance(error, PrepareError)
    assert (error.code, error.param) == ("context_length_exceeded", "query")
    assert error.message.startswith("body.query: input is 5 tokens")
    error = prepare(bi, "/v1/score", {"text_1": "a", "text_2": ["b", "abcdef"]})
    assert isinstance(error, PrepareError) and error.param == "text_2"
    assert error.message.startswith("body.text_2[1]: input is 6 tokens")


def test_scores_are_plain_floats():
    engine = FakeEngine(cross_encoder=True)
    body = run(engine, "/v1/score", {"text_1": "ab", "text_2": "ba"})
    assert type(body["data"][0]["score"]) is float
    assert torch.tensor(body["data"][0]["score"]).item() == 1.0
