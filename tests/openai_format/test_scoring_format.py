"""/v1/rerank and /v1/score lines: their bodies (Cohere's and Jina's rerank, vLLM's score with
its pairing rules), every bad input a line error naming the field, their engine fields, and the
response objects (results by relevance, ``top_n``, ``return_documents``)."""

from __future__ import annotations

import json

import pytest

from openai_format.engine_fields import engine_fields, ignores_eos, max_output_tokens
from openai_format.parse import BatchLine, LineError, parse_line
from openai_format.scoring import MAX_RERANK_DOCUMENTS, rerank_body, score_body
from service.lines import estimate_tokens, sort_key


def line(url: str, body: dict) -> BatchLine | LineError:
    raw = json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": body})
    return parse_line(raw, line_no=1)


def test_a_rerank_line_and_its_fields():
    parsed = line("/v1/rerank", {"model": "m", "query": "q", "top_n": 2,
                                 "documents": ["a", {"text": "b"}, "c"]})
    assert isinstance(parsed, BatchLine)
    fields = engine_fields(parsed.body)
    assert fields == {"score": {"kind": "rerank", "text_1": ["q"], "text_2": ["a", "b", "c"],
                                "top_n": 2, "return_documents": True}}
    assert max_output_tokens(fields) == 0 and not ignores_eos(fields)
    assert estimate_tokens(parsed) == (3 * 3, 0)
    assert sort_key(parsed).startswith("\x01score")
    no_docs = line("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": False})
    assert isinstance(no_docs, BatchLine)
    assert engine_fields(no_docs.body)["score"]["return_documents"] is False  # type: ignore


@pytest.mark.parametrize(("text_1", "text_2", "pairs"), [
    ("a", "b", (["a"], ["b"])),
    ("a", ["b", "c"], (["a"], ["b", "c"])),
    (["a"], ["b", "c"], (["a"], ["b", "c"])),
    (["a", "b"], ["c", "d"], (["a", "b"], ["c", "d"])),
])
def test_score_pairing(text_1, text_2, pairs):
    parsed = line("/v1/score", {"text_1": text_1, "text_2": text_2})
    assert isinstance(parsed, BatchLine)
    score = engine_fields(parsed.body)["score"]  # type: ignore[typeddict-item]
    assert (score["text_1"], score["text_2"]) == pairs and score["kind"] == "score"


@pytest.mark.parametrize(("url", "body", "code", "message"), [
    ("/v1/rerank", {"documents": ["a"]}, "invalid_request", "body.query is required"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "invalid_value",
     "body.query must not be an empty string"),
    ("/v1/rerank", {"query": "q", "documents": []}, "invalid_value",
     "body.documents must not be empty"),
    ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, "invalid_value",
     "body.documents[1] must not be an empty string"),
    ("/v1/rerank", {"query": "q", "documents": ["a", {"title": "x"}]}, "invalid_request",
     "body.documents[1] must be a string or an object with text"),
    ("/v1/rerank", {"query": "q", "documents": "a"}, "invalid_request",
     "body.documents must be a list, got a string"),
    ("/v1/rerank", {"query": "q", "documents": ["a"] * (MAX_RERANK_DOCUMENTS + 1)},
     "invalid_value", "body.documents must hold at most 1000 documents, got 1001"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "invalid_value",
     "body.top_n must be an integer >= 1"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": "yes"},
     "invalid_request", "body.return_documents must be a boolean, got a string"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "rank_fields": ["t"]}, "invalid_value",
     "body.rank_fields is not a supported parameter"),
    ("/v1/score", {"text_2": "b"}, "invalid_request", "body.text_1 is required"),
    ("/v1/score", {"text_1": 1, "text_2": "b"}, "invalid_request",
     "body.text_1 must be a string or a list of strings"),
    ("/v1/score", {"text_1": [], "text_2": "b"}, "invalid_value",
     "body.text_1 must not be empty"),
    ("/v1/score", {"text_1": "a", "text_2": ["b", ""]}, "invalid_value",
     "body.text_2[1] must not be an empty string"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "invalid_value",
     "body.text_1 holds 2 texts and body.text_2 3: give one text_1 to score against every "
     "text_2, or as many as text_2 to score pair by pair"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": "c"}, "invalid_value",
     "body.text_1 holds 2 texts and body.text_2 1"),
])
def test_bad_input_names_the_field(url, body, code, message):
    parsed = line(url, body)
    assert isinstance(parsed, LineError)
    assert parsed.code == code and parsed.detail.startswith(message), parsed.detail


def test_rerank_body_sorts_cuts_and_repeats_documents():
    body = rerank_body([0.2, 0.9, 0.5, 0.9], documents=["a", "b", "c", "d"], top_n=3,
                       model="m", prompt_tokens=12, rerank_id="rerank-1")
    assert body["results"] == [{"index": 1, "relevance_score": 0.9, "document": {"text": "b"}},
                               {"index": 3, "relevance_score": 0.9, "document": {"text": "d"}},
                               {"index": 2, "relevance_score": 0.5, "document": {"text": "c"}}]
    assert body["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
    bare = rerank_body([0.1, 0.3], documents=None, top_n=10, model="m", prompt_tokens=1,
                       rerank_id="rerank-2")
    assert bare["results"] == [{"index": 1, "relevance_score": 0.3},
                               {"index": 0, "relevance_score": 0.1}]


def test_score_body_keeps_pair_order():
    body = score_body([0.3, 0.7], model="m", prompt_tokens=5, score_id="score-1", created=7)
    assert body == {"id": "score-1", "object": "list", "created": 7, "model": "m",
                    "data": [{"index": 0, "object": "score", "score": 0.3},
                             {"index": 1, "object": "score", "score": 0.7}],
                    "usage": {"prompt_tokens": 5, "total_tokens": 5}}
