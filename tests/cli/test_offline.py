"""cli.offline.run_batch_file end to end: the fake engine first, then the real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from cli.offline import count_lines, run_batch_file, sample_percentiles, write_metrics_json
from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams
from engine.testing.fake_engine import FakeEngine


class OfflineEngine(FakeEngine):
    """The shared fake with a 256-token vocabulary (id = code point % 256), answers of 'x', a
    chat template without a tool role, and fixed stats."""

    def __init__(self, max_model_len: int = 64) -> None:
        super().__init__(max_num_seqs=2, max_model_len=max_model_len, answer="x")
        self.vocab_size = 256
        self.max_seen = 0

    @property
    def num_added(self) -> int:
        return len(self.added)

    def encode(self, prompt: str) -> list[int]:
        return [ord(c) % 256 for c in prompt]

    def apply_chat_template(self, messages: list[dict], *,
                            tools: list[dict] | None = None) -> list[int]:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("this template has no tool role")
        return super().apply_chat_template(messages, tools=tools)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    **kwargs: object) -> None:
        super().add_request(request_id, prompt, params, **kwargs)  # type: ignore[arg-type]
        self.max_seen = max(self.max_seen, self.num_unfinished_requests)

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=0, num_waiting=0, num_kv_blocks=8, num_free_kv_blocks=8, kv_usage=0.0,
            num_preemptions=1, prefix_cache_queries=4, prefix_cache_hits=1, num_steps=3,
            num_prompt_tokens=0, num_generated_tokens=0, batch_size_hist={1: 3},
            scheduled_tokens_hist={4: 3},
        )


def chat_line(custom_id: str, content: str = "Hi", **body: object) -> str:
    body = {"messages": [{"role": "user", "content": content}], **body}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def completion_line(custom_id: str, prompt: object = "Once", **body: object) -> str:
    return json.dumps({
        "custom_id": custom_id, "method": "POST", "url": "/v1/completions",
        "body": {"prompt": prompt, **body},
    })


def write_input(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "input.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


MIXED = [
    chat_line("chat-1", max_tokens=3),
    completion_line("cmpl-1", max_tokens=2),  # not the file's endpoint (its first line's)
    "{not json",
    json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}),
    chat_line("chat-1"),  # duplicate
    chat_line("too-long", "y" * 80),
    chat_line("bad-temp", temperature=5),
    json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
    chat_line("tool", max_tokens=2).replace('"role": "user"',
                                            '"role": "tool", "tool_call_id": "c"'),
    "",
    chat_line("chat-n", n=2, max_tokens=2, logprobs=True, top_logprobs=2),
    chat_line("other-model", model="gpt-4o", max_tokens=1),  # not this run's model
]
EXPECTED_ERRORS = {
    "cmpl-1": {"invalid_url"},
    "bad-url": {"invalid_url"},
    "chat-1": {"duplicate_custom_id"},
    "too-long": {"context_length_exceeded"},
    "bad-temp": {"invalid_value"},
    "tool": {"invalid_request"},
    "other-model": {"model_not_found"},
}
# Lines without a custom_id: in the summary by line number, not in the error file.
EXPECTED_LINE_ERRORS = [(3, "invalid_json"), (8, "missing_custom_id")]
EXPECTED_OK = {"chat-1", "chat-n"}
COMPLETIONS = [
    completion_line("cmpl-1", max_tokens=2),
    completion_line("bad-ids", [1, 300]),
    completion_line("ids", [72, 105], max_tokens=3, logprobs=1),
    chat_line("chat-1", max_tokens=1),
]


def check_failed_line(line: dict) -> str:
    """OpenAI's shape of a refused request; returns its code."""
    assert line["error"] is None
    response = line["response"]
    assert response["status_code"] == 400 and response["request_id"].startswith("req_")
    error = response["body"]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    return error["code"]


def test_run_batch_file_mixed(tmp_path: Path) -> None:
    engine = OfflineEngine()
    output = tmp_path / "out.jsonl"
    summary = run_batch_file(engine, write_input(tmp_path, MIXED), output, progress=False)

    lines = read_lines(output)
    ok = [line for line in lines if line["response"]["status_code"] == 200]
    errors = [line for line in lines if line["response"]["status_code"] != 200]
    assert sorted(line["custom_id"] for line in ok) == sorted(EXPECTED_OK)
    found: dict[str | None, set[str]] = {}
    for line in errors:
        found.setdefault(line["custom_id"], set()).add(check_failed_line(line))
    assert found == EXPECTED_ERRORS
    assert [(e["line"], e["code"]) for e in summary.line_errors] == EXPECTED_LINE_ERRORS
    assert len(lines) == len(MIXED) - 1 - len(EXPECTED_LINE_ERRORS)  # the blank line is skipped

    by_id = {line["custom_id"]: line["response"] for line in ok}
    for response in by_id.values():
        assert response["status_code"] == 200 and response["request_id"]
        assert response["body"]["model"] == "fake-model"
        ChatCompletion.model_validate(response["body"])
    chat_n = ChatCompletion.model_validate(by_id["chat-n"]["body"])
    assert [c.index for c in chat_n.choices] == [0, 1]
    assert chat_n.usage.completion_tokens == 4
    assert [t.token for t in chat_n.choices[0].logprobs.content[0].top_logprobs] == ["x", "y"]

    assert summary.num_lines == len(MIXED) - 1
    assert summary.num_ok == len(EXPECTED_OK) and summary.num_failed == 9
    assert summary.errors_by_code["invalid_value"] == 1
    assert summary.num_generated_tokens == 3 + 4
    assert summary.num_preemptions == 1 and summary.prefix_cache_hit_rate == 0.25
    assert summary.ttft_s["p50"] is not None
    assert "2 ok, 9 failed" in summary.format()


def test_run_batch_file_completions(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    summary = run_batch_file(OfflineEngine(), write_input(tmp_path, COMPLETIONS), output,
                             progress=False)
    by_id = {line["custom_id"]: line for line in read_lines(output)}
    assert check_failed_line(by_id["bad-ids"]) == "invalid_value"
    assert check_failed_line(by_id["chat-1"]) == "invalid_url"
    for custom_id in ("cmpl-1", "ids"):
        Completion.model_validate(by_id[custom_id]["response"]["body"])
    assert by_id["cmpl-1"]["response"]["body"]["choices"][0]["text"] == "xx"
    ids = by_id["ids"]["response"]["body"]
    assert ids["usage"]["prompt_tokens"] == 2
    assert ids["choices"][0]["logprobs"]["tokens"] == ["x", "x", "x"]
    assert summary.num_ok == 2 and summary.num_failed == 2


def test_errors_go_to_separate_file(tmp_path: Path) -> None:
    output, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    run_batch_file(
        OfflineEngine(), write_input(tmp_path, MIXED), output, errors_path=errors, progress=False
    )
    assert {line["custom_id"] for line in read_lines(output)} == EXPECTED_OK
    assert all(line["error"] is None for line in read_lines(output))
    error_lines = read_lines(errors)
    assert len(error_lines) == 7 and all(line["response"]["status_code"] == 400
                                         for line in error_lines)


def test_window_is_bounded_and_every_id_once(tmp_path: Path) -> None:
    engine = OfflineEngine()
    lines = [completion_line(f"r{i}", max_tokens=1 + i % 4) for i in range(50)]
    output = tmp_path / "out.jsonl"
    summary = run_batch_file(
        engine, write_input(tmp_path, lines), output, max_in_flight=5, progress=False
    )
    ids = [line["custom_id"] for line in read_lines(output)]
    assert sorted(ids) == sorted(f"r{i}" for i in range(50))
    assert engine.num_added == 50
    assert engine.max_seen == 5 and summary.max_in_flight_seen == 5
    assert summary.num_ok == 50 and summary.num_failed == 0


def test_default_window_is_a_few_times_max_num_seqs(tmp_path: Path) -> None:
    engine = OfflineEngine()
    lines = [completion_line(f"r{i}", max_tokens=2) for i in range(30)]
    summary = run_batch_file(
        engine, write_input(tmp_path, lines), tmp_path / "out.jsonl", progress=False
    )
    assert summary.max_in_flight == 4 * engine.config.max_num_seqs
    assert engine.max_seen == summary.max_in_flight


def test_input_is_read_lazily(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a window of 2, the engine never holds more than 2 requests, however long the file."""
    import cli.offline as offline

    lines = [completion_line(f"r{i}", max_tokens=3) for i in range(20)]
    path = write_input(tmp_path, lines)
    read: list[int] = []
    original = offline._read_lines

    def spy(f):  # noqa: ANN001, ANN202
        for item in original(f):
            read.append(item[0])
            yield item

    monkeypatch.setattr(offline, "_read_lines", spy)
    engine = OfflineEngine()
    added_when: list[int] = []
    original_add = engine.add_request

    def add(request_id, prompt, params, **kwargs):  # noqa: ANN001, ANN202
        added_when.append(len(read))
        original_add(request_id, prompt, params, **kwargs)

    engine.add_request = add  # type: ignore[method-assign]
    run_batch_file(engine, path, tmp_path / "out.jsonl", max_in_flight=2, progress=False)
    # When the 10th request goes in, only 10 lines have been read.
    assert added_when[9] == 10


def test_empty_input(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    summary = run_batch_file(OfflineEngine(), path, tmp_path / "out.jsonl", progress=False)
    assert summary.num_lines == 0 and (tmp_path / "out.jsonl").read_text() == ""


def test_metrics_json_and_helpers(tmp_path: Path) -> None:
    path = write_input(tmp_path, MIXED)
    assert count_lines(path) == len(MIXED) - 1
    summary = run_batch_file(OfflineEngine(), path, tmp_path / "out.jsonl", progress=True)
    metrics = tmp_path / "metrics.json"
    write_metrics_json(metrics, summary, model="fake-model")
    data = json.loads(metrics.read_text())
    assert data["num_ok"] == 2 and data["model"] == "fake-model"
    assert [e["line"] for e in data["line_errors"]] == [3, 8]
    assert data["engine_stats"]["num_kv_blocks"] == 8
    assert {"generated_tokens_per_s", "ttft_s", "tpot_s", "prefix_cache_hit_rate"} <= set(data)
    assert sample_percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert sample_percentiles([1.0, 2.0, 3.0, 4.0, 5.0])["p50"] == 3.0
    assert sample_percentiles([0.0, 10.0], (95,))["p95"] == pytest.approx(9.5)


# --- the real engine ---------------------------------------------------------------------------


@pytest.fixture
def real_engine(request: pytest.FixtureRequest):  # noqa: ANN201
    try:
        model_dir = request.getfixturevalue("tiny_model_dir")
    except pytest.FixtureLookupError:
        pytest.skip("tests/conftest.py has no tiny_model_dir fixture yet")
    from engine import EngineConfig, LLMEngine

    config = EngineConfig(
        model=str(model_dir), max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64,
        block_size=16, device="cpu", dtype="float32", max_model_len=256,
    )
    return LLMEngine(config)


def test_real_engine_end_to_end(tmp_path: Path, real_engine) -> None:  # noqa: ANN001
    system = "You are a helpful assistant that answers briefly. " * 3
    lines = [
        json.dumps({
            "custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"max_tokens": 4 + i % 3, "temperature": 0, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question number {i}?"},
            ]},
        })
        for i in range(8)
    ]
    lines += [
        "{bad json",
        chat_line("chat-0"),
        chat_line("huge", "word " * 400, max_tokens=4),
        chat_line("too-much", "Hi", max_tokens=1000),
        completion_line("other-url", "Once", max_tokens=2),
    ]
    output, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    summary = run_batch_file(
        real_engine, write_input(tmp_path, lines), output, errors_path=errors,
        max_in_flight=6, progress=False,
    )
    ok = read_lines(output)
    assert sorted(line["custom_id"] for line in ok) == sorted(f"chat-{i}" for i in range(8))
    for line in ok:
        parsed = ChatCompletion.model_validate(line["response"]["body"])
        assert parsed.usage.completion_tokens >= 1
    codes = {line["custom_id"]: check_failed_line(line) for line in read_lines(errors)}
    assert codes == {
        "chat-0": "duplicate_custom_id", "huge": "context_length_exceeded",
        "too-much": "context_length_exceeded", "other-url": "invalid_url",
    }
    assert [e["code"] for e in summary.line_errors] == ["invalid_json"]
    assert summary.num_ok == 8 and summary.num_failed == 5
    assert summary.max_in_flight_seen <= 6
    # The shared system prompt is a prefix-cache hit for the later chats.
    assert summary.num_cached_tokens > 0


def test_real_engine_completions(tmp_path: Path, real_engine) -> None:  # noqa: ANN001
    lines = [
        completion_line("cmpl", "Once upon a time", max_tokens=5, temperature=0, logprobs=2),
        completion_line("cmpl-ids", [1, 2, 3], max_tokens=3, seed=1),
        completion_line("seeded-n", "Hello", max_tokens=3, n=2, seed=3),
        completion_line("bad-ids", [1, 10**9], max_tokens=2),
    ]
    output = tmp_path / "out.jsonl"
    summary = run_batch_file(real_engine, write_input(tmp_path, lines), output, progress=False)
    by_id = {line["custom_id"]: line for line in read_lines(output)}
    for custom_id in ("cmpl", "cmpl-ids", "seeded-n"):
        Completion.model_validate(by_id[custom_id]["response"]["body"])
    assert len(by_id["seeded-n"]["response"]["body"]["choices"]) == 2
    cmpl = by_id["cmpl"]["response"]["body"]
    assert len(cmpl["choices"][0]["logprobs"]["tokens"]) == cmpl["usage"]["completion_tokens"]
    assert check_failed_line(by_id["bad-ids"]) == "invalid_value"
    assert "vocabulary" in by_id["bad-ids"]["response"]["body"]["error"]["message"]
    assert summary.num_ok == 3 and summary.num_failed == 1


def test_a_line_naming_another_model_fails_alone(tmp_path: Path) -> None:
    """A run serves one model: a line naming another is refused (as the service refuses a batch
    naming a model it does not serve); a line naming this one, or none, runs."""
    engine = OfflineEngine()
    output = tmp_path / "out.jsonl"
    lines = [chat_line("named", model="fake-model"), chat_line("other", model="gpt-4o-mini"),
             chat_line("none")]
    summary = run_batch_file(engine, write_input(tmp_path, lines), output, progress=False)
    by_id = {line["custom_id"]: line for line in read_lines(output)}
    assert by_id["named"]["response"]["status_code"] == 200
    assert by_id["none"]["response"]["status_code"] == 200
    assert check_failed_line(by_id["other"]) == "model_not_found"
    error = by_id["other"]["response"]["body"]["error"]
    assert error["param"] == "model" and "fake-model" in error["message"]
    assert summary.num_ok == 2 and summary.num_failed == 1
