"""api.json_items: a body's array items decoded as its chunks arrive, whatever the split."""

from __future__ import annotations

import json

import pytest

from api.json_items import ArrayItems, JsonBodyError

ITEMS = [{"custom_id": "a", "params": {"text": "héllo ✓ 🚀", "n": 12345}}, {"x": [1, 2.5e3]},
         "a string with ] and }", 3.14159, -7, True, None, [], {}]


def read(body: bytes, size: int) -> list:
    parser = ArrayItems("requests")
    got = []
    for start in range(0, len(body), size):
        got += parser.feed(body[start:start + size])
    parser.finish()
    return got


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
def test_every_split_gives_the_same_items(size):
    body = json.dumps({"requests": ITEMS}, ensure_ascii=False, indent=1).encode()
    assert read(body, size) == ITEMS  # splits inside numbers, keys and UTF-8 sequences too


def test_an_empty_array_and_whitespace():
    assert read(b' \n{ "requests" : [ ] }\n ', 3) == []


@pytest.mark.parametrize(("body", "says"), [
    (b'{"other": []}', 'expected the key "requests"'),
    (b'{"requests": {}}', "expected an array"),
    (b'[{"requests": []}]', "expected a JSON object"),
    (b'{"requests": [1 2]}', "expected ',' or ']'"),
    (b'{"requests": [1]} x', "after the body's object"),
    (b'{"requests": [1, {"a": ', "item 1"),
    (b'{"requests": [1]', "ended early: expected '}'"),
    (b'{"requests": [1', "ended early: expected ',' or ']'"),
    (b'{"requests": [\xff]}', "not UTF-8"),
])
def test_a_body_that_is_not_the_shape_is_refused_saying_where(body, says):
    with pytest.raises(JsonBodyError, match=says):
        read(body, 4)


def test_only_an_item_and_a_chunk_are_held():
    item = {"custom_id": "x", "params": {"text": "y" * 1000}}
    body = json.dumps({"requests": [item] * 5000}).encode()  # ~5 MB
    parser = ArrayItems("requests")
    held = count = 0
    for start in range(0, len(body), 65536):
        count += len(parser.feed(body[start:start + 65536]))
        held = max(held, len(parser._buffer))
    parser.finish()
    assert count == 5000 and held < 70_000


def test_an_unfinished_item_past_the_limit_is_refused():
    parser = ArrayItems("requests", max_item_chars=100)
    with pytest.raises(JsonBodyError, match="longer than 100"):
        parser.feed(b'{"requests": [{"a": "' + b"z" * 200)
