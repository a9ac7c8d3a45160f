"""gpt-oss's chat format end to end in the engine: the prompt comes from the checkpoint's own
(harmony) template, generation stops where its generation_config says (``<|return|>``,
``<|call|>``), and the answer's channels are split when the response is built."""

from __future__ import annotations

import json

import pytest

from engine import LLM
from openai_format.reasoning import harmony_tokens, split_harmony
from openai_format.types import CHAT_URL
from pipeline.engine_adapter import add_to_engine, prepare, response_body
from tests.conftest import build_tokenizer
from tests.engine.moe_checkpoints import make_moe_checkpoint

SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
            "<|constrain|>"]
# The harmony rendering gpt-oss's template does, reduced to its message frame.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are a helpful assistant.\nReasoning: medium<|end|>"
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "<|start|>developer<|message|># Instructions\n{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = HARMONY_TEMPLATE
    path = make_moe_checkpoint(tmp_path_factory.mktemp("gpt-oss-harmony"), "gpt_oss",
                               tokenizer=tokenizer)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIALS}
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = [ids["<|return|>"], ids["<|call|>"]]
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path, ids


def test_prompt_is_the_models_template_and_stops_are_its_generation_config(gpt_oss):
    path, ids = gpt_oss
    llm = LLM(str(path), dtype="float32")
    prompt = llm.engine.apply_chat_template([{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hello world!"}])
    text = llm.tokenizer.decode(prompt)
    assert text.startswith("<|start|>system<|message|>")
    assert "<|start|>developer<|message|># Instructions\nBe brief.<|end|>" in text
    assert text.endswith("<|start|>user<|message|>Hello world!<|end|><|start|>assistant")
    assert {ids["<|return|>"], ids["<|call|>"]} <= set(llm.engine.eos_token_ids)


def test_a_chat_line_runs_and_its_response_is_well_formed(gpt_oss):
    path, _ = gpt_oss
    llm = LLM(str(path), dtype="float32")
    engine = llm.engine
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello world!"}],
            "max_tokens": 12, "temperature": 0}
    engine_input = prepare(engine, CHAT_URL, body)
    assert not hasattr(engine_input, "code"), engine_input
    assert add_to_engine(engine, "r0", engine_input) is None
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    body, usage = response_body(finished[0], endpoint=CHAT_URL, model="m",
                                engine=engine, hex_id="ab")
    message = body["choices"][0]["message"]
    assert usage.completion_tokens == len(finished[0].outputs[0].token_ids) > 0
    assert isinstance(message["content"], str)
    output = finished[0].outputs[0]
    split = split_harmony(list(output.token_ids), lambda ids: engine.decode(ids, True),
                          harmony_tokens(engine.special_token_id))
    if split is None:  # a random model rarely writes a channel header: the text is kept
        assert message["content"] == output.text
        assert "reasoning_content" not in message
    else:
        assert message["content"] == split.content
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == (
            split.reasoning_tokens)
