"""gpt-oss's harmony completions: the final channel is the answer, the analysis channel the
reasoning (``reasoning_content``, ``usage.completion_tokens_details.reasoning_tokens``)."""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletion

from engine.checkpoint.tokenizer import special_token_id
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from openai_format.reasoning import harmony_tokens, split_harmony
from openai_format.types import CHAT_URL, COMPLETIONS_URL
from pipeline.engine_adapter import response_body
from tests.conftest import build_tokenizer

HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                    "<|call|>", "<|constrain|>"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": HARMONY_SPECIALS})
    return tok


class _Vocab:
    """The engine members the harmony split reads (``Engine.special_token_id``, ``decode``),
    over a bare tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def special_token_id(self, token: str) -> int | None:
        return special_token_id(self.tokenizer, token)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _specials(tokenizer):
    return harmony_tokens(_Vocab(tokenizer).special_token_id)


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


ANSWER = ("<|channel|>analysis<|message|>The user greets; answer kindly.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello world! How are you?<|return|>")


def test_final_channel_is_the_content_and_analysis_the_reasoning(tokenizer):
    specials = _specials(tokenizer)
    assert specials is not None
    ids = _ids(tokenizer, ANSWER)
    split = split_harmony(ids, _decode(tokenizer), specials)
    assert split is not None
    assert split.content == "Hello world! How are you?"
    assert split.reasoning == "The user greets; answer kindly."
    analysis = _ids(tokenizer, "<|channel|>analysis<|message|>The user greets; answer kindly."
                               "<|end|>")
    assert split.reasoning_tokens == len(analysis)


def test_cut_off_while_reasoning(tokenizer):
    ids = _ids(tokenizer, "<|channel|>analysis<|message|>The quick brown fox")
    split = split_harmony(ids, _decode(tokenizer), _specials(tokenizer))
    assert split is not None
    assert (split.content, split.reasoning, split.reasoning_tokens) == (
        "", "The quick brown fox", len(ids))


def test_a_recipient_or_constraint_after_the_channel_name(tokenizer):
    ids = _ids(tokenizer, "<|channel|>analysis<|message|>a<|end|><|start|>assistant"
                          "<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
                          "{}<|call|>")
    split = split_harmony(ids, _decode(tokenizer), _specials(tokenizer))
    assert split is not None and split.content == "" and split.reasoning == "a"


def test_plain_text_is_not_harmony(tokenizer):
    assert split_harmony(_ids(tokenizer, "Hello world!"), _decode(tokenizer),
                         _specials(tokenizer)) is None
    assert _specials(build_tokenizer()) is None


def _output(tokenizer, text: str) -> RequestOutput:
    ids = _ids(tokenizer, text)
    completion = CompletionOutput(index=0, text=tokenizer.decode(ids, skip_special_tokens=True),
                                  token_ids=ids, finish_reason="stop")
    return RequestOutput("r", None, [1, 2, 3], [completion], True,
                         RequestMetrics(arrival_time=0.0, num_prompt_tokens=3))


def test_chat_response_splits_the_channels_and_counts_reasoning(tokenizer):
    body, usage = response_body(_output(tokenizer, ANSWER), endpoint=CHAT_URL, model="m",
                                engine=_Vocab(tokenizer), hex_id="ab")
    completion = ChatCompletion.model_validate(body)
    message = completion.choices[0].message
    assert message.content == "Hello world! How are you?"
    assert (message.model_extra or {})["reasoning_content"] == "The user greets; answer kindly."
    assert completion.usage is not None and completion.usage.completion_tokens_details
    details = completion.usage.completion_tokens_details
    assert details.reasoning_tokens == split_harmony(
        _ids(tokenizer, ANSWER), _decode(tokenizer), _specials(tokenizer)).reasoning_tokens
    assert 0 < details.reasoning_tokens < completion.usage.completion_tokens
    assert usage.completion_tokens == len(_ids(tokenizer, ANSWER))


def test_other_models_and_endpoints_are_untouched(tokenizer):
    plain = build_tokenizer()
    body, _ = response_body(_output(plain, "Hello world!"), endpoint=CHAT_URL, model="m",
                            engine=_Vocab(plain), hex_id="ab")
    assert "completion_tokens_details" not in body["usage"]
    assert "reasoning_content" not in body["choices"][0]["message"]
    body, _ = response_body(_output(tokenizer, ANSWER), endpoint=COMPLETIONS_URL, model="m",
                            engine=_Vocab(tokenizer), hex_id="ab")
    assert "analysis" in body["choices"][0]["text"]  # raw text: a completion is not a chat


CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        "<|message|>{\"city\": \"Paris\"}<|call|>")


@pytest.mark.parametrize("text", [
    CALL,
    # the recipient after the role instead of after the channel name
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    "{\"city\": \"Paris\"}<|call|>",
])
def test_messages_to_functions_are_tool_calls(tokenizer, text):
    split = split_harmony(_ids(tokenizer, text), _decode(tokenizer), _specials(tokenizer))
    assert split is not None
    assert [(c.name, c.arguments) for c in split.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert split.content == ""  # the call is neither answer nor reasoning


def test_a_call_cut_off_before_call_is_not_a_call(tokenizer):
    ids = _ids(tokenizer, CALL.removesuffix("<|call|>")[:-4])
    split = split_harmony(ids, _decode(tokenizer), _specials(tokenizer))
    assert split is not None and split.tool_calls == ()


def test_harmony_tool_calls_in_the_chat_response(tokenizer):
    from openai_format.tools import ToolCallMode

    body, _ = response_body(_output(tokenizer, CALL), endpoint=CHAT_URL, model="m",
                            engine=_Vocab(tokenizer), hex_id="ab",
                            tool_mode=ToolCallMode("harmony"))
    completion = ChatCompletion.model_validate(body)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == '{"city": "Paris"}'
    assert (choice.message.model_extra or {})["reasoning_content"] == "Need the weather."
    # arguments that are not a JSON object: no call is made up; the answer stays as it is
    bad = CALL.replace('{"city": "Paris"}', "city=Paris")
    body, _ = response_body(_output(tokenizer, bad), endpoint=CHAT_URL, model="m",
                            engine=_Vocab(tokenizer), hex_id="ab",
                            tool_mode=ToolCallMode("harmony"))
    assert "tool_calls" not in body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_a_harmony_template_with_tools_is_recognised():
    from openai_format.tools import template_supports_tools

    template = ("{% if tools %}namespace functions {% endif %}{% for m in messages %}"
                "{% if m.tool_calls %}<|start|>assistant to=functions.{{ m.tool_calls[0]"
                ".function.name }}<|channel|>commentary json<|message|>...<|call|>{% endif %}"
                "{% endfor %}")
    assert template_supports_tools(template) == "harmony"
    assert template_supports_tools("<|call|> no tools here") is None
