"""Structured output on the real default model (SmolLM2-135M-Instruct): json_schema, a tool call
as a schema and as a structural tag, json_object; every complete output parses and validates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.checkpoint.model_cache import pull
from engine.sampling_params import StructuredOutputParams

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 40},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
# What the service builds for tool_choice "required" / a named function: one call object.
TOOL_CALL = {"anyOf": [{"type": "object",
                        "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
                        "required": ["name", "arguments"], "additionalProperties": False}]}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "hobbies": {"type": "array", "items": {"type": "string",
                                                                "maxLength": 30},
                                     "minItems": 1, "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
TAG = {"type": "structural_tag",
       "format": {"type": "triggered_tags", "triggers": ["<tool_call>"],
                  "tags": [{"begin": "<tool_call>",
                            "content": {"type": "json_schema", "json_schema": TOOL_CALL},
                            "end": "</tool_call>"}],
                  "at_least_one": True, "stop_after_first": True}}


@pytest.fixture(scope="module")
def llm():
    return LLM(str(pull()))


def test_schemas_and_tool_calls_on_the_default_model(llm):
    convs = [
        [{"role": "user", "content": "Describe a fictional person as JSON."}],
        [{"role": "user", "content": "What's the weather in Paris? Call get_weather."}],
        [{"role": "user", "content": "What's the weather in Tokyo? Use a tool."}],
        [{"role": "user", "content": "Describe a fictional person as JSON."}],
    ]
    so = StructuredOutputParams
    params = [
        SamplingParams(temperature=0, max_tokens=100, structured_output=so(json_schema=PERSON)),
        SamplingParams(temperature=0, max_tokens=100,
                       structured_output=so(json_schema=TOOL_CALL)),
        SamplingParams(temperature=0, max_tokens=100, structured_output=so(structural_tag=TAG)),
        SamplingParams(temperature=0.8, seed=3, max_tokens=100,
                       structured_output=so(json_schema=PERSON)),
    ]
    person, call, tagged, sampled = llm.chat(convs, params)
    for out, schema in ((person, PERSON), (call, TOOL_CALL), (sampled, PERSON)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert json.loads(call.text)["name"] == "get_weather"
    assert "Paris" in json.loads(call.text)["arguments"]["city"]
    assert tagged.finish_reason == "stop"
    assert tagged.text.startswith("<tool_call>") and tagged.text.endswith("</tool_call>")
    body = tagged.text[len("<tool_call>"):-len("</tool_call>")]
    jsonschema.validate(json.loads(body), TOOL_CALL)
