"""/v1/responses lines: parsing, the mapping onto the chat request, refusals by name, and the
Response object, validated strictly against the ``openai`` package's type."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response

from openai_format.engine_fields import engine_fields
from openai_format.parse import LineError, parse_line
from openai_format.response_object import response_object
from openai_format.responses import ChoiceResult
from openai_format.responses_request import RESPONSES_UNSUPPORTED, ResponsesRequest
from tests.openai_shapes import check_line, strict

URL = "/v1/responses"
ADD = {"type": "function", "name": "add", "description": "a + b", "strict": True,
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                      "b": {"type": "integer"}},
                      "required": ["a", "b"], "additionalProperties": False}}


def parse(body: dict):
    return parse_line(json.dumps({"custom_id": "r1", "method": "POST", "url": URL,
                                  "body": body}), line_no=3)


def parsed(body: dict) -> ResponsesRequest:
    line = parse(body)
    assert not isinstance(line, LineError), line.message
    assert isinstance(line.body, ResponsesRequest)
    return line.body


def refused(body: dict) -> str:
    line = parse(body)
    assert isinstance(line, LineError), line
    assert line.custom_id == "r1"
    return line.message


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    body = parsed({"model": "m", "input": "What is 2+2?", "instructions": "Be brief.",
                   "max_output_tokens": 12, "temperature": 0.5, "top_p": 0.9})
    fields = engine_fields(body)
    assert fields["messages"] == [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "What is 2+2?"}]
    sampling = fields["sampling"]
    assert (sampling["max_tokens"], sampling["temperature"], sampling["top_p"]) == (12, 0.5, 0.9)
    assert body.as_chat.model == "m"
    assert fields["response"]["instructions"] == "Be brief."
    assert fields["response"]["max_output_tokens"] == 12


def test_input_items_become_the_chat_history_with_tool_calls_and_results():
    body = parsed({"tools": [ADD], "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": "2+3?"},
        {"type": "function_call", "call_id": "call_1", "name": "add",
         "arguments": "{\"a\": 2, \"b\": 3}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is 5."}]},
    ]})
    messages = engine_fields(body)["messages"]
    assert messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is 5."},
    ]


def test_text_format_and_tool_choice_reach_the_chat_path():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = parsed({"input": "x", "text": {"format": {"type": "json_schema", "name": "out",
                                                      "schema": schema, "strict": True}}})
    fields = engine_fields(body)
    assert fields["sampling"]["structured_output"] == {"json_schema": schema, "strict": True}
    assert fields["format_field"] == "body.text.format.schema"
    assert fields["response"]["text"] == {"format": {"type": "json_schema", "name": "out",
                                                     "schema": schema, "strict": True}}
    loose = engine_fields(parsed({"input": "x", "text": {"format": {"type": "json_object"}}}))
    assert loose["sampling"]["structured_output"] == {"json_object": True}
    plain = engine_fields(parsed({"input": "x", "text": {"format": {"type": "text"}}}))
    assert plain["sampling"]["structured_output"] is None

    named = engine_fields(parsed({"input": "x", "tools": [ADD],
                                  "tool_choice": {"type": "function", "name": "add"}}))
    assert named["tool_mode"] == "named" and named["tool_name"] == "add"
    assert named["sampling"]["structured_output"] == {"json_schema": ADD["parameters"],
                                                      "strict": True, "compact": True}
    assert named["format_field"] == "body.tools[].parameters"
    assert named["tools"] == [{"type": "function", "function": {
        k: v for k, v in ADD.items() if k != "type"}}]
    required = engine_fields(parsed({"input": "x", "tools": [ADD], "tool_choice": "required"}))
    assert required["tool_mode"] == "required"
    auto = engine_fields(parsed({"input": "x", "tools": [ADD]}))
    assert auto["tool_mode"] == "auto" and auto["response"]["tool_choice"] == "auto"
    none = engine_fields(parsed({"input": "x", "tools": [ADD], "tool_choice": "none"}))
    assert "tool_mode" not in none and none["tools"] is None


@pytest.mark.parametrize("field", sorted(RESPONSES_UNSUPPORTED))
def test_fields_a_batch_cannot_honour_are_refused_by_name_with_the_reason(field):
    message = refused({"input": "x", field: "anything"})
    assert message == f"line 3: body.{field} is not supported ({RESPONSES_UNSUPPORTED[field]})"


def test_refusals_name_the_field():
    assert refused({"input": "x", "stream": True}) == (
        "line 3: body.stream must be false: a batch line has one response")
    assert "no conversation store" in refused({"input": "x", "previous_response_id": "resp_1"})
    assert refused({"input": "x", "background": True}).startswith(
        "line 3: body.background must be false: a batch line already runs in the background")
    cases = {
        "body.input must be a string or a list of input items": {"input": 3},
        "body.input is required": {"instructions": "x"},
        "body.input must not be empty": {"input": []},
        "body.input[0] is an item_reference": {"input": [{"type": "item_reference",
                                                          "id": "msg_1"}]},
        "body.input[1] has type 'reasoning'": {"input": [{"role": "user", "content": "x"},
                                                         {"type": "reasoning"}]},
        "body.input[0] must be an input item object": {"input": ["hi"]},
        "body.input[0].content has a 'input_image' part": {"input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "body.input[0] arguments must be a JSON object as text": {"input": [
            {"type": "function_call", "call_id": "c", "name": "add", "arguments": "[1]"}]},
        "body.input[0].role must be": {"input": [{"role": "bot", "content": "x"}]},
        "body.text.format.schema is required": {"input": "x", "text": {"format": {
            "type": "json_schema", "name": "out"}}},
        "body.text.format.name must be": {"input": "x", "text": {"format": {
            "type": "json_schema", "name": "a b", "schema": {}}}},
        "body.text.verbosity is not supported": {"input": "x", "text": {"verbosity": "low"}},
        "body.text.format must be 'text' when body.tool_choice forces": {
            "input": "x", "tools": [ADD], "tool_choice": "required",
            "text": {"format": {"type": "json_object"}}},
        "body.tools[0].type must be 'function'": {"input": "x", "tools": [{"type": "web_search"}]},
        "body.tool_choice requires body.tools": {"input": "x", "tool_choice": "required"},
        "body.tool_choice names 'sub', which is not in body.tools": {
            "input": "x", "tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}},
        "body.truncation 'auto' is not supported": {"input": "x", "truncation": "auto"},
        "body.temperature must be between 0 and 2": {"input": "x", "temperature": 2.5},
        "body.max_output_tokens must be an integer >= 1": {"input": "x", "max_output_tokens": 0},
        "body.metadata must hold at most 16 pairs, got 17": {
            "input": "x", "metadata": {str(i): "v" for i in range(17)}},
        "body.metadata keys must be at most 64 characters": {"input": "x",
                                                             "metadata": {"k" * 65: "v"}},
        "body.metadata values must be at most 512 characters": {"input": "x",
                                                                "metadata": {"k": "v" * 513}},
        "body.messages is not a supported parameter": {"input": "x", "messages": []},
    }
    for expected, body in cases.items():
        assert refused(body).startswith(f"line 3: {expected}"), (expected, refused(body))


def test_output_neutral_fields_are_accepted():
    body = parsed({"input": "x", "store": False, "user": "u", "service_tier": "auto",
                   "prompt_cache_key": "k", "safety_identifier": "s", "stream": False,
                   "background": False, "truncation": "disabled"})
    assert body.as_chat.messages[0].text == "x"


def _body(choice: ChoiceResult, request: dict) -> dict:
    echo = engine_fields(parsed(request))["response"]
    return response_object(choice, echo=echo, model="tiny", prompt_tokens=9, cached_tokens=4,
                           response_id="resp_abc", created=1_700_000_000)


def test_the_response_object_is_openais_type_strictly():
    text = _body(ChoiceResult(0, "Four.", 3, "stop"),
                 {"input": "2+2?", "metadata": {"k": "v"}, "tools": [ADD],
                  "text": {"format": {"type": "json_schema", "name": "o", "schema": {}}}})
    parsed_text = strict(Response, text)
    assert parsed_text.output_text == "Four." and parsed_text.status == "completed"
    assert parsed_text.id == "resp_abc" and parsed_text.object == "response"
    assert text["incomplete_details"] is None and text["metadata"] == {"k": "v"}
    assert text["usage"] == {"input_tokens": 9, "input_tokens_details": {
        "cached_tokens": 4, "cache_write_tokens": 0}, "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}

    cut = strict(Response, _body(ChoiceResult(0, "Fo", 2, "length"),
                                 {"input": "x", "max_output_tokens": 2}))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.max_output_tokens == 2

    call = {"id": "call_9", "type": "function",
            "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}
    called = _body(ChoiceResult(0, "", 8, "stop", tool_calls=[call]),
                   {"input": "x", "tools": [ADD], "tool_choice": "required"})
    typed = strict(Response, called)
    assert [item.type for item in typed.output] == ["function_call"]
    fc = typed.output[0]
    assert (fc.call_id, fc.name, json.loads(fc.arguments)) == ("call_9", "add", {"a": 1, "b": 2})
    assert called["tool_choice"] == "required" and called["tools"][0]["name"] == "add"
    with_text = strict(Response, _body(ChoiceResult(0, "Let me add.", 8, "stop",
                                                    tool_calls=[call]),
                                       {"input": "x", "tools": [ADD]}))
    assert [item.type for item in with_text.output] == ["message", "function_call"]


def test_an_output_line_holding_a_response_passes_the_line_check():
    body = _body(ChoiceResult(0, "ok", 1, "stop"), {"input": "x"})
    line = {"id": "batch_req_1", "custom_id": "r1", "error": None,
            "response": {"status_code": 200, "request_id": "req_1", "body": body}}
    check_line(line)
    check_line(line, URL)
    body["output"][0]["content"][0]["type"] = "text"  # not OpenAI's shape: the check fails
    with pytest.raises(ValueError):
        check_line(line, URL)
