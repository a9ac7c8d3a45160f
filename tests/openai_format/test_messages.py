"""/v1/messages lines: a Messages API body (Anthropic's ``params``) mapped onto the chat request
it runs as, each refusal naming its ``params.*`` field, and the Message object it answers with,
checked by the anthropic client's own types."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message

from openai_format.engine_fields import engine_fields
from openai_format.message_object import message_object
from openai_format.parse import BatchLine, LineError, parse_line
from openai_format.responses import ChoiceResult

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def parse(params: dict) -> BatchLine | LineError:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/messages", "body": params}
    return parse_line(json.dumps(line), line_no=1)


def valid(params: dict) -> BatchLine:
    parsed = parse(params)
    assert isinstance(parsed, BatchLine), parsed
    return parsed


def user(content) -> dict:
    return {"role": "user", "content": content}


def test_the_body_runs_as_its_chat_request():
    body = valid({
        "model": "m", "max_tokens": 7, "system": [{"type": "text", "text": "Be brief."}],
        "temperature": 0.3, "top_p": 0.9, "top_k": 5, "stop_sequences": ["END"],
        "metadata": {"user_id": "u1"}, "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "messages": [
            user([{"type": "text", "text": "Paris?"}]),
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "P"}}]},
            user([{"type": "tool_result", "tool_use_id": "t1",
                   "content": [{"type": "text", "text": "21 C"}]},
                  {"type": "text", "text": "And Rome?"}])],
    }).body
    chat = body.as_chat
    assert chat.max_tokens == 7 and chat.stop == ["END"] and chat.top_k == 5
    assert chat.parallel_tool_calls is False
    assert [(m["role"], m.get("content")) for m in chat.template_messages()] == [
        ("system", "Be brief."), ("user", "Paris?"), ("assistant", "Looking."),
        ("tool", "21 C"), ("user", "And Rome?")]
    assert chat.template_messages()[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    fields = engine_fields(body)
    assert fields["tool_mode"] == "named" and fields["tool_name"] == "get_weather"
    assert fields["format_field"] == "params.tools[].input_schema"
    assert fields["sampling"]["max_tokens"] == 7 and fields["sampling"]["stop"] == ["END"]


@pytest.mark.parametrize(("choice", "mode"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, None)])
def test_tool_choice(choice, mode):
    body = valid({"max_tokens": 5, "tools": [WEATHER], "tool_choice": choice,
                  "messages": [user("x")]}).body
    assert engine_fields(body).get("tool_mode") == mode


@pytest.mark.parametrize(("params", "fragment"), [
    ({"messages": [user("x")]}, "params.max_tokens is required"),
    ({"max_tokens": 0, "messages": [user("x")]}, "params.max_tokens must be"),
    ({"max_tokens": 5, "messages": [user([{"type": "image", "source": {}}])]},
     "params.messages[0].content[0].type 'image': image blocks are not supported"),
    ({"max_tokens": 5, "messages": [user([{"type": "document", "source": {}}])]},
     "params.messages[0].content[0].type 'document'"),
    ({"max_tokens": 5, "messages": [user([{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}])]},
     "params.messages[0].content[0].type must be one of 'text', 'tool_result'"),
    ({"max_tokens": 5, "messages": [user([{"type": "text"}])]},
     "params.messages[0].content[0].text is required"),
    ({"max_tokens": 5, "messages": []}, "params.messages must not be empty"),
    ({"max_tokens": 5, "messages": [user("x"), {"role": "assistant", "content": "y"}]},
     "params.messages: the last message must be the user's"),
    ({"max_tokens": 5, "temperature": 1.5, "messages": [user("x")]},
     "params.temperature must be between 0 and 1"),
    ({"max_tokens": 5, "stream": True, "messages": [user("x")]}, "params.stream must be false"),
    ({"max_tokens": 5, "thinking": {"type": "enabled"}, "messages": [user("x")]},
     "params.thinking is not supported"),
    ({"max_tokens": 5, "frequency_penalty": 1, "messages": [user("x")]},
     "params.frequency_penalty is not a supported parameter"),
    ({"max_tokens": 5, "tool_choice": {"type": "any"}, "messages": [user("x")]},
     "params.tool_choice 'any' requires params.tools"),
    ({"max_tokens": 5, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"},
      "messages": [user("x")]}, "params.tool_choice.name 'nope' is not in params.tools"),
    ({"max_tokens": 5, "tools": [{"name": "f"}], "messages": [user("x")]},
     "params.tools[0].input_schema is required"),
    ({"max_tokens": 5, "system": [{"type": "image"}], "messages": [user("x")]},
     "params.system[0].type 'image'"),
    ({"max_tokens": 5, "metadata": {"tags": "x"}, "messages": [user("x")]},
     "params.metadata.tags"),
])
def test_a_bad_body_names_its_field(params, fragment):
    error = parse(params)
    assert isinstance(error, LineError) and fragment in error.message, error


def choice(text: str = "", *, finish: str = "stop", stop: str | int | None = None,
           calls: tuple = ()) -> ChoiceResult:
    return ChoiceResult(0, text, 3, finish, tool_calls=calls, stop_reason=stop)


@pytest.mark.parametrize(("result", "reason", "sequence"), [
    (choice("Hi"), "end_turn", None),
    (choice("Hi", stop=2), "end_turn", None),  # the end-of-sequence token
    (choice("Hi", stop="END"), "stop_sequence", "END"),
    (choice("Hi", finish="length"), "max_tokens", None),
    (choice(calls=({"id": "call_1", "type": "function",
                    "function": {"name": "f", "arguments": '{"a": 1}'}},)), "tool_use", None),
])
def test_the_message_object(result, reason, sequence):
    body = message_object(result, model="m", prompt_tokens=10, cached_tokens=4,
                          message_id="msg_1")
    message = Message.model_validate(body)
    assert (message.stop_reason, message.stop_sequence) == (reason, sequence)
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens,
            message.usage.output_tokens) == (6, 4, 3)
    if reason == "tool_use":
        (block,) = message.content
        assert block.type == "tool_use" and block.input == {"a": 1} and block.id == "call_1"
    else:
        assert message.content[0].type == "text" and message.content[0].text == "Hi"
