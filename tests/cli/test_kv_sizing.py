"""``boxcar run`` sizes the KV cache from its file: an upper bound on what its requests use,
None when a line may run to the model's context; the sized run answers exactly as the default."""

from __future__ import annotations

import json
import math

import pytest

from cli import main as cli
from cli.kv_sizing import TEMPLATE_TOKENS, kv_blocks_needed


def chat(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], **body}}


def write(path, lines) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_bound_counts_bytes_template_and_max_tokens(tmp_path):
    line = chat("a", "Hello there", max_tokens=40)
    path = write(tmp_path / "in.jsonl", [line, "not json", ""])
    raw = len(json.dumps(line).encode())
    assert kv_blocks_needed(path, block_size=16, max_num_seqs=8) == math.ceil(
        (raw + TEMPLATE_TOKENS + 40) / 16)


def test_bound_sums_the_largest_that_run_at_once(tmp_path):
    lines = [chat(f"r{i}", "x" * (i * 100), max_completion_tokens=10) for i in range(5)]
    lines.append(chat("n", "y", max_tokens=10, n=3))
    path = write(tmp_path / "in.jsonl", lines)
    needs = sorted([math.ceil((len(json.dumps(x).encode()) + TEMPLATE_TOKENS + 10) / 16)
                    for x in lines[:5]] + [math.ceil(
                        (len(json.dumps(lines[5]).encode()) + TEMPLATE_TOKENS + 10) / 16)] * 3,
                   reverse=True)
    assert kv_blocks_needed(path, block_size=16, max_num_seqs=4) == sum(needs[:4])


@pytest.mark.parametrize("body", [{}, {"max_tokens": None}])
def test_no_bound_when_a_line_may_run_to_the_context(tmp_path, body):
    path = write(tmp_path / "in.jsonl", [chat("a", "hi", max_tokens=5), chat("b", "hi", **body)])
    assert kv_blocks_needed(path, block_size=16, max_num_seqs=8) is None


def test_bound_counts_the_max_tokens_the_engine_gets(tmp_path):
    """Each line's budget is its engine fields': a /v1/completions line without max_tokens gets
    OpenAI's 16, a /v1/responses line its max_output_tokens, an embeddings line none; a line
    that fails to parse (max_tokens 0) never runs."""
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "hi"}},
             {"custom_id": "r", "method": "POST", "url": "/v1/responses",
              "body": {"input": "hi", "max_output_tokens": 7}},
             {"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": "hi"}},
             chat("bad", "hi", max_tokens=0)]
    path = write(tmp_path / "in.jsonl", lines)
    needs = [math.ceil((len(json.dumps(x).encode()) + TEMPLATE_TOKENS + budget) / 16)
             for x, budget in zip(lines[:3], (16, 7, 0), strict=True)]
    assert kv_blocks_needed(path, block_size=16, max_num_seqs=8) == sum(needs)


def test_no_bound_for_a_missing_or_empty_file(tmp_path):
    assert kv_blocks_needed(tmp_path / "none.jsonl", block_size=16, max_num_seqs=8) is None
    assert kv_blocks_needed(write(tmp_path / "e.jsonl", []), block_size=16, max_num_seqs=8) is None


def test_run_uses_the_bound_and_answers_the_same(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from engine import llm_engine

    engines = []
    init = llm_engine.LLMEngine.__init__

    def recording_init(self, config):
        init(self, config)
        engines.append(self)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", recording_init)
    source = write(tmp_path / "in.jsonl", [chat("a", "Hello", max_tokens=6, temperature=0)])
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--device", "cpu",
              "--threads", "1", "--no-progress"]
    sized, default = tmp_path / "sized.jsonl", tmp_path / "default.jsonl"
    assert cli.main(["run", source, "-o", str(sized), *common]) == 0
    assert cli.main(["run", source, "-o", str(default), "--num-kv-blocks", "256", *common]) == 0
    capsys.readouterr()
    small, fixed = engines
    assert small.config.max_kv_blocks == kv_blocks_needed(source, block_size=16, max_num_seqs=128)
    assert small.model_runner.num_kv_blocks == small.config.max_kv_blocks
    assert fixed.config.max_kv_blocks is None and fixed.model_runner.num_kv_blocks == 256

    def content(path):
        (line,) = path.read_text().splitlines()
        return json.loads(line)["response"]["body"]["choices"][0]["message"]["content"]

    assert content(sized) == content(default)


def test_max_kv_blocks_is_checked():
    from engine import EngineConfig

    with pytest.raises(ValueError, match="max_kv_blocks must be >= 2"):
        EngineConfig(model="m", max_kv_blocks=1)
