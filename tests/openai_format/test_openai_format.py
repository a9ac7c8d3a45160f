"""openai_format (parse, sampling, responses): every line error class, valid lines, the
sampling mapping, output shapes."""

from __future__ import annotations

import copy
import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from engine.sampling_params import SamplingParams
from openai_format.parse import BatchLine, CustomIdTracker, LineError, parse_line
from openai_format.responses import (
    ChoiceResult,
    TokenLogprobResult,
    chat_completion_body,
    error_line,
    output_line,
    output_line_json,
    text_completion_body,
)
from openai_format.sampling import to_sampling_kwargs
from openai_format.types import CHAT_URL, COMPLETIONS_URL, ChatCompletionRequest, CompletionRequest

CHAT_LINE = {
    "custom_id": "req-1",
    "method": "POST",
    "url": CHAT_URL,
    "body": {
        "model": "anything",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
        ],
        "max_tokens": 8,
    },
}
COMPLETION_LINE = {
    "custom_id": "req-2",
    "method": "POST",
    "url": COMPLETIONS_URL,
    "body": {"model": "anything", "prompt": "Once upon a time"},
}


def parse(data: object, *, line_no: int = 7, endpoint: str | None = None) -> BatchLine | LineError:
    raw = data if isinstance(data, str | bytes) else json.dumps(data)
    return parse_line(raw, line_no=line_no, endpoint=endpoint)


def chat(**body: object) -> dict:
    line = copy.deepcopy(CHAT_LINE)
    line["body"].update(body)
    return line


def completion(**body: object) -> dict:
    line = copy.deepcopy(COMPLETION_LINE)
    line["body"].update(body)
    return line


def expect_error(data: object, code: str, *fragments: str, **kwargs: object) -> LineError:
    result = parse(data, **kwargs)
    assert isinstance(result, LineError), result
    assert result.code == code, result
    assert result.message.startswith("line 7: "), result.message
    for fragment in fragments:
        assert fragment in result.message, result.message
    assert result.line_no == 7
    return result


# --- valid lines -------------------------------------------------------------------------------


def test_valid_chat_line() -> None:
    line = parse(CHAT_LINE)
    assert isinstance(line, BatchLine)
    assert line.custom_id == "req-1" and line.is_chat and line.line_no == 7
    assert isinstance(line.body, ChatCompletionRequest)
    assert line.body.template_messages() == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
    ]


def test_valid_completion_line_bytes_and_token_ids() -> None:
    line = parse(json.dumps(COMPLETION_LINE).encode())
    assert isinstance(line, BatchLine) and not line.is_chat
    assert isinstance(line.body, CompletionRequest)
    assert line.body.single_prompt == "Once upon a time"
    ids = parse(completion(prompt=[1, 2, 3]))
    assert isinstance(ids, BatchLine) and ids.body.single_prompt == [1, 2, 3]
    wrapped = parse(completion(prompt=[[4, 5]]))
    assert isinstance(wrapped, BatchLine) and wrapped.body.single_prompt == [4, 5]


def test_text_parts_developer_role_and_output_neutral_fields() -> None:
    line = parse(chat(
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "Be "},
                                              {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "Hi", "unknown": 1},
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ],
        user="u-1", metadata={"k": "v"}, store=False, service_tier="auto",
    ))
    assert isinstance(line, BatchLine)
    assert line.body.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]


def test_model_mismatch_is_not_an_error() -> None:
    assert isinstance(parse(chat(model="gpt-4o")), BatchLine)
    assert isinstance(parse(chat(model=None)), BatchLine)


# --- line errors -------------------------------------------------------------------------------


def test_bad_utf8() -> None:
    expect_error(b'{"custom_id": "\xff"}', "invalid_json", "UTF-8")


def test_lone_surrogate_fails_the_line_and_a_pair_is_one_character() -> None:
    line = ('{"custom_id": "%s", "method": "POST", "url": "/v1/chat/completions", '
            '"body": {"messages": [{"role": "user", "content": "%s"}]}}')
    for custom_id, content in (("a", "x \\ud800"), ("a", "\\uDFFF y"), ("\\udc00", "hi")):
        error = parse(line % (custom_id, content))
        assert isinstance(error, LineError) and error.code == "invalid_request"
        assert "lone surrogate" in error.detail
        assert error.custom_id == ("a" if custom_id == "a" else None)  # none that can't be stored
    ok = parse(line % ("a", "\\ud83d\\ude00"))
    assert isinstance(ok, BatchLine) and ok.body.messages[0].content == "\U0001f600"


@pytest.mark.parametrize("raw", ["{bad", '{"custom_id": "a",}', "", "   ", "[1, 2"])
def test_bad_json(raw: str) -> None:
    expect_error(raw, "invalid_json")


@pytest.mark.parametrize("raw", ["[1, 2]", '"text"', "42", "null"])
def test_not_an_object(raw: str) -> None:
    expect_error(raw, "invalid_request", "JSON object")


@pytest.mark.parametrize("custom_id", [None, "", 42, ["a"]])
def test_missing_custom_id(custom_id: object) -> None:
    data = copy.deepcopy(CHAT_LINE)
    if custom_id is None:
        del data["custom_id"]
    else:
        data["custom_id"] = custom_id
    error = expect_error(data, "missing_custom_id", "custom_id")
    assert error.custom_id is None


@pytest.mark.parametrize("method", ["GET", "post", None])
def test_method_not_post(method: object) -> None:
    data = chat()
    data["method"] = method
    error = expect_error(data, "invalid_method", "POST")
    assert error.custom_id == "req-1"


@pytest.mark.parametrize("url", ["/v1/moderations", "/v1/chat/completion", None, 3])
def test_unknown_url(url: object) -> None:
    data = chat()
    data["url"] = url
    expect_error(data, "invalid_url", "url")


def test_url_must_match_batch_endpoint() -> None:
    expect_error(COMPLETION_LINE, "invalid_url", "endpoint", endpoint=CHAT_URL)
    assert isinstance(parse(COMPLETION_LINE, endpoint=COMPLETIONS_URL), BatchLine)


@pytest.mark.parametrize("body", [None, "text", [1]])
def test_body_not_an_object(body: object) -> None:
    data = chat()
    if body is None:
        del data["body"]
    else:
        data["body"] = body
    expect_error(data, "invalid_request", "body")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"messages": "hi"}, "body.messages must be a list"),
        ({"messages": [{"content": "x"}]}, "body.messages[0].role is required"),
        ({"messages": [{"role": "user", "content": 5}]}, "body.messages[0].content must be"),
        ({"temperature": "0.5"}, "body.temperature must be a number"),
        ({"temperature": True}, "body.temperature must be a number"),
        ({"max_tokens": 2.5}, "body.max_tokens must be an integer"),
        ({"stop": 5}, "body.stop must be a string or a list of strings"),
        ({"logprobs": 1}, "body.logprobs must be a boolean"),
        ({"ignore_eos": "yes"}, "body.ignore_eos must be a boolean"),
    ],
)
def test_chat_body_wrong_types(body: dict, fragment: str) -> None:
    expect_error(chat(**body), "invalid_request", fragment)


def test_chat_body_missing_messages() -> None:
    data = chat()
    del data["body"]["messages"]
    expect_error(data, "invalid_request", "body.messages is required")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"temperature": 2.5}, "body.temperature must be between 0 and 2"),
        ({"temperature": -0.1}, "body.temperature must be between 0 and 2"),
        ({"top_p": 0}, "body.top_p must be greater than 0"),
        ({"top_p": 1.5}, "body.top_p"),
        ({"n": 0}, "body.n must be between 1"),
        ({"max_tokens": 0}, "body.max_tokens must be an integer >= 1"),
        ({"max_completion_tokens": -1}, "body.max_completion_tokens"),
        ({"presence_penalty": 3}, "body.presence_penalty must be between -2 and 2"),
        ({"frequency_penalty": -2.5}, "body.frequency_penalty"),
        ({"repetition_penalty": 0}, "body.repetition_penalty"),
        ({"min_p": 1.5}, "body.min_p"),
        ({"top_k": -3}, "body.top_k"),
        ({"min_tokens": -1}, "body.min_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, "body.min_tokens must be <= max_tokens"),
        ({"stop": ["ok", ""]}, "body.stop must not contain empty strings"),
        ({"top_logprobs": 2}, "body.top_logprobs requires body.logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "body.top_logprobs must be between 0 and 20"),
        ({"messages": []}, "body.messages must not be empty"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "body.messages[0].role must be"),
        ({"messages": [{"role": "user"}]}, "content is required for role 'user'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "only text parts"),
        ({"stream": True}, "body.stream"),
        ({"response_format": {"type": "xml"}}, "body.response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "body.response_format.json_schema is"),
        ({"some_future_field": 1}, "body.some_future_field is not a supported parameter"),
        ({"functions": []}, "body.functions is not supported (use tools)"),
        ({"reasoning_effort": "low"}, "body.reasoning_effort is not supported"),
        ({"prediction": {"type": "content"}}, "body.prediction is not supported"),
        ({"logit_bias": {"abc": 1}}, "body.logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 101}},
         "body.logit_bias values must be between -100 and 100, got 101 for token 5"),
        ({"tool_choice": "required"}, "body.tool_choice requires body.tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "names 'g', which is not in body.tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "function name"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "body.response_format must be 'text'"),
        ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "body.min_tokens"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}]}]},
         "arguments must be a JSON object as text"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id is required"),
    ],
)
def test_chat_body_invalid_values(body: dict, fragment: str) -> None:
    error = expect_error(chat(**body), "invalid_value", fragment)
    assert error.custom_id == "req-1"


def test_nan_temperature_is_rejected() -> None:
    raw = json.dumps(chat()).replace('"max_tokens": 8', '"temperature": NaN')
    expect_error(raw, "invalid_value", "body.temperature")


@pytest.mark.parametrize(
    ("body", "code", "fragment"),
    [
        ({"prompt": None}, "invalid_request", "body.prompt"),
        ({"prompt": 5}, "invalid_request", "body.prompt must be a string or a list of token ids"),
        ({"prompt": [1, -2]}, "invalid_request", "body.prompt"),
        ({"prompt": ""}, "invalid_value", "body.prompt must not be empty"),
        ({"prompt": []}, "invalid_value", "body.prompt must not be empty"),
        ({"prompt": ["a", "b"]}, "invalid_value", "one prompt"),
        ({"echo": True}, "invalid_value", "body.echo"),
        ({"suffix": "x"}, "invalid_value", "body.suffix"),
        ({"best_of": 3}, "invalid_value", "body.best_of"),
        ({"logprobs": 21}, "invalid_value", "body.logprobs must be between 0 and 20"),
        ({"logprobs": True}, "invalid_request", "body.logprobs must be an integer"),
        ({"temperature": 9}, "invalid_value", "body.temperature must be between 0 and 2"),
    ],
)
def test_completion_body_errors(body: dict, code: str, fragment: str) -> None:
    expect_error(completion(**body), code, fragment)


def test_completion_missing_prompt() -> None:
    data = completion()
    del data["body"]["prompt"]
    expect_error(data, "invalid_request", "body.prompt is required")


def test_custom_id_tracker() -> None:
    tracker = CustomIdTracker()
    assert tracker.check("a", line_no=1) is None
    assert tracker.check("b", line_no=2) is None
    error = tracker.check("a", line_no=3)
    assert isinstance(error, LineError)
    assert error.code == "duplicate_custom_id" and error.custom_id == "a" and error.line_no == 3
    assert error.message.startswith("line 3: ")
    assert "a" in tracker and len(tracker) == 2


# --- sampling mapping -------------------------------------------------------------------------


def test_sampling_defaults_follow_openai() -> None:
    chat_kwargs = to_sampling_kwargs(parse(chat(max_tokens=None)).body)
    assert chat_kwargs["temperature"] == 1.0 and chat_kwargs["top_p"] == 1.0
    assert chat_kwargs["max_tokens"] is None and chat_kwargs["logprobs"] is None
    assert to_sampling_kwargs(parse(COMPLETION_LINE).body)["max_tokens"] == 16
    SamplingParams(**chat_kwargs)


def test_sampling_mapping_chat() -> None:
    body = parse(chat(
        temperature=0, top_p=0.9, n=2, stop="END", seed=7, presence_penalty=0.5,
        frequency_penalty=-0.5, logprobs=True, top_logprobs=3, max_tokens=10,
        max_completion_tokens=12, top_k=40, min_p=0.05, repetition_penalty=1.1, min_tokens=2,
        ignore_eos=True, stop_token_ids=[5],
    )).body
    kwargs = to_sampling_kwargs(body)
    assert kwargs == {
        "n": 2, "temperature": 0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
        "stop": ["END"], "stop_token_ids": [5], "max_tokens": 12, "min_tokens": 2,
        "ignore_eos": True, "logprobs": 3, "logit_bias": None, "structured_output": None,
    }
    params = SamplingParams(**kwargs)
    assert params.greedy and params.stop == ["END"]


def test_sampling_mapping_logprobs_and_top_k() -> None:
    assert to_sampling_kwargs(parse(chat(logprobs=True)).body)["logprobs"] == 0
    assert to_sampling_kwargs(parse(chat(logprobs=False)).body)["logprobs"] is None
    assert to_sampling_kwargs(parse(completion(logprobs=4)).body)["logprobs"] == 4
    for disabled in (-1, 0):
        assert to_sampling_kwargs(parse(chat(top_k=disabled)).body)["top_k"] is None


# --- output shapes -----------------------------------------------------------------------------


LOGPROBS = [
    TokenLogprobResult("Hel", -0.1, [("Hel", -0.1), ("Hi", -2.5)]),
    TokenLogprobResult("lo", -0.2, [("lo", -0.2), ("p", -3.0)]),
]


def test_chat_completion_body_validates_with_openai_types() -> None:
    body = chat_completion_body(
        [ChoiceResult(0, "Hello", 2, "stop", LOGPROBS), ChoiceResult(1, "Hey there", 3, "length")],
        model="SmolLM2-135M-Instruct",
        prompt_tokens=10,
        cached_tokens=4,
        created=1700000000,
    )
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    assert parsed.created == 1700000000 and parsed.model == "SmolLM2-135M-Instruct"
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length"]
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "Hello"
    content = parsed.choices[0].logprobs.content
    assert [t.token for t in content] == ["Hel", "lo"]
    assert content[0].bytes == list(b"Hel") and content[0].top_logprobs[1].token == "Hi"
    assert parsed.choices[1].logprobs is None
    usage = parsed.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (10, 5, 15)
    assert usage.prompt_tokens_details.cached_tokens == 4
    assert set(body) == {
        "id", "object", "created", "model", "choices", "usage", "system_fingerprint",
    }
    assert set(body["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}


def test_text_completion_body_validates_with_openai_types() -> None:
    body = text_completion_body(
        [ChoiceResult(0, "Hello", 2, "length", LOGPROBS)], model="m", prompt_tokens=3
    )
    parsed = Completion.model_validate(body)
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-")
    choice = parsed.choices[0]
    assert choice.text == "Hello" and choice.finish_reason == "length"
    assert choice.logprobs.tokens == ["Hel", "lo"]
    assert choice.logprobs.token_logprobs == [-0.1, -0.2]
    assert choice.logprobs.text_offset == [0, 3]
    assert choice.logprobs.top_logprobs[0] == {"Hel": -0.1, "Hi": -2.5}
    assert parsed.usage.total_tokens == 5 and parsed.usage.prompt_tokens_details.cached_tokens == 0
    assert set(body["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}


def test_abort_finish_reason_is_reported_as_stop() -> None:
    body = text_completion_body([ChoiceResult(0, "", 0, "abort")], model="m", prompt_tokens=1)
    assert Completion.model_validate(body).choices[0].finish_reason == "stop"


def test_output_line_shape() -> None:
    body = chat_completion_body([ChoiceResult(0, "Hi", 1, "stop")], model="m", prompt_tokens=2)
    line = output_line("req-1", body, request_id="abc")
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("batch_req_") and line["custom_id"] == "req-1"
    assert line["response"] == {"status_code": 200, "request_id": "abc", "body": body}
    assert line["error"] is None
    json.dumps(line)


def test_error_line_shapes() -> None:
    # A request that never ran (cancelled, expired): error, no response.
    line = error_line("req-9", "batch_expired", "expired")
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("batch_req_") and line["custom_id"] == "req-9"
    assert line["response"] is None
    assert line["error"] == {"code": "batch_expired", "message": "expired"}
    # A refused request: OpenAI's HTTP error inside the response, error null.
    error = parse(chat(n=0))
    assert isinstance(error, LineError)
    refused = error.to_line(request_id="req_1")
    assert refused is not None and refused["error"] is None
    assert refused["custom_id"] == "req-1"
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["request_id"] == "req_1"
    assert refused["response"]["body"]["error"] == {
        "message": error.message, "type": "invalid_request_error", "param": None,
        "code": "invalid_value"}
    # A line without a custom_id has no error-file line (the batch's errors name it).
    assert parse("{oops").to_line(request_id="req_2") is None


# --- structured outputs, tools, logit_bias -------------------------------------------------------

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                  "required": ["a"]}, "strict": True}}
NOOP_TOOL = {"type": "function", "function": {"name": "noop"}}


def test_response_format_maps_to_structured_output() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    for strict_mode, expected in ((True, True), (False, False), (None, False)):
        spec: dict = {"name": "x", "schema": schema}
        if strict_mode is not None:
            spec["strict"] = strict_mode
        body = parse(chat(response_format={"type": "json_schema", "json_schema": spec})).body
        assert to_sampling_kwargs(body)["structured_output"] == {"json_schema": schema,
                                                                 "strict": expected}
    body = parse(completion(response_format={"type": "json_object"})).body
    assert to_sampling_kwargs(body)["structured_output"] == {"json_object": True}
    assert to_sampling_kwargs(parse(chat(response_format={"type": "text"})).body)[
        "structured_output"] is None
    kwargs = to_sampling_kwargs(parse(completion(logit_bias={"7": -100, "9": 2.5})).body)
    assert kwargs["logit_bias"] == [[7, -100.0], [9, 2.5]]  # JSON: [token id, bias] pairs


def test_forced_tool_calls_map_to_schemas() -> None:
    named = parse(chat(tools=[ADD_TOOL, NOOP_TOOL],
                       tool_choice={"type": "function", "function": {"name": "add"}})).body
    assert to_sampling_kwargs(named)["structured_output"] == {
        "json_schema": ADD_TOOL["function"]["parameters"], "strict": True, "compact": True}
    required = parse(chat(tools=[ADD_TOOL, NOOP_TOOL], tool_choice="required")).body
    structured = to_sampling_kwargs(required)["structured_output"]
    branches = structured["json_schema"]["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [{"const": "add"}, {"const": "noop"}]
    assert branches[1]["properties"]["arguments"]["additionalProperties"] is False
    assert structured["strict"] is False  # noop is not strict
    assert structured["compact"] is True
    assert required.tool_mode == "required" and named.tool_mode == "named"
    assert parse(chat(tools=[ADD_TOOL])).body.tool_mode == "auto"
    none = parse(chat(tools=[ADD_TOOL], tool_choice="none")).body
    assert none.tool_mode is None and none.template_tools() is None
    assert to_sampling_kwargs(none)["structured_output"] is None


def test_tool_calls_in_the_history_reach_the_template() -> None:
    body = parse(chat(messages=[
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ], tools=[ADD_TOOL])).body
    assert body.template_messages()[1]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    assert body.template_tools() == [ADD_TOOL]


def test_chat_body_with_tool_calls_is_an_openai_chat_completion() -> None:
    from openai_format.tools import ToolCallMode, tool_calls_from_text

    content, calls = tool_calls_from_text(ToolCallMode("forced_any"),
                                          '{"name": "add", "arguments": {"a": 3}}')
    assert content is None and calls[0]["function"] == {"name": "add", "arguments": '{"a": 3}'}
    assert tool_calls_from_text(ToolCallMode("forced_name", "add"), '{"a": 4}')[1][0][
        "function"] == {"name": "add", "arguments": '{"a": 4}'}
    # A cut-off call stays text.
    assert tool_calls_from_text(ToolCallMode("forced_name", "add"), '{"a": ') == ('{"a": ', [])
    body = chat_completion_body([ChoiceResult(0, "", 5, "stop", tool_calls=calls)], model="m",
                                prompt_tokens=2)
    parsed = ChatCompletion.model_validate(body, strict=True)
    assert parsed.choices[0].finish_reason == "tool_calls"
    assert parsed.choices[0].message.content is None
    assert parsed.choices[0].message.tool_calls[0].function.name == "add"


def test_a_byte_order_mark_on_line_one_is_skipped() -> None:
    raw = b"\xef\xbb\xbf" + json.dumps(chat()).encode()
    assert isinstance(parse_line(raw, line_no=1), BatchLine)
    assert isinstance(parse_line(raw.decode(), line_no=1), BatchLine)
    expect_error(raw, "invalid_json", "not valid JSON")  # line 7: not the file's start


@pytest.mark.parametrize("body", [
    {"id": "chatcmpl-1", "choices": [{"message": {"role": "assistant", "content": "ok"}}],
     "usage": {"prompt_tokens": 3, "completion_tokens": 1}, "temperature": 0.1, "x": None},
    {"text": "quotes \" and \\ backslash, tab\t newline\n", "n": [1, 2.5, -3e-07, True]},
    {"text": "caf\u00e9 \u2603 \U0001f600"},  # non-ASCII: stored escaped, written unescaped
    {"text": "control \u001b char"},
])
def test_output_line_json_is_the_output_line_dumped(body):
    stored = json.dumps(body)  # how SQLAlchemy's JSON type stores a response
    fast = output_line_json("cid-\u00e9", stored, request_id="req_1")
    expected = json.dumps(output_line("cid-\u00e9", json.loads(stored), request_id="req_1"),
                          ensure_ascii=False)
    if "\\u" in stored:
        assert fast is None  # the caller decodes and dumps, as before
        return
    assert fast is not None
    same_id = json.loads(fast)["id"]
    assert fast == expected.replace(json.loads(expected)["id"], same_id)
