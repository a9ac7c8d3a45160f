"""``boxcar run``: drive an OpenAI batch file through one in-process engine, streaming.

The input is read lazily; at most ``max_in_flight`` requests sit in the engine at once (a few
times ``max_num_seqs``, so every step stays full without holding the file in memory); each result
line is written the moment its request finishes, so output order follows completion, as OpenAI's
does. A bad line (bad JSON, missing or repeated custom_id, a url other than the file's endpoint,
invalid values, a prompt longer than the context) fails alone and every other line still runs:
one with a custom_id gets an error line in OpenAI's shape; one without (not JSON, no custom_id)
is listed by line number in the summary (``RunSummary.line_errors``), as a batch lists it in its
``errors``. Lines are prepared by the worker's pipeline (``pipeline.engine_adapter``), so a line
gets the same result or error here as in a batch.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from engine.outputs import RequestOutput
from engine.protocol import Engine
from openai_format.ids import new_id
from openai_format.parse import BatchLine, CustomIdTracker, LineError, parse_line
from openai_format.responses import output_line
from openai_format.tools import ToolCallMode
from pipeline.engine_adapter import PrepareError, add_to_engine, prepare, response_body
from pipeline.scoring import ScoreReadBack

IN_FLIGHT_PER_SEQ = 4
MAX_LINE_ERRORS = 100
PROGRESS_INTERVAL_S = 0.5


@dataclass
class _InFlight:
    line: BatchLine
    request_id: str  # the engine's id; the response's request_id is ``req_`` + it
    tool_mode: ToolCallMode | None = None
    response_echo: dict[str, Any] | None = None  # a /v1/responses line's
    lora_name: str | None = None  # the adapter the line named as its model
    encoding_format: str | None = None  # an embeddings line's: float or base64
    score: ScoreReadBack | None = None  # a rerank or score line's


@dataclass
class RunSummary:
    """What one run did; ``as_dict`` is the ``--metrics-json`` document."""

    num_lines: int = 0
    num_ok: int = 0
    num_failed: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    # Lines without a custom_id (not JSON, no custom_id): reported by line number only.
    line_errors: list[dict[str, Any]] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    elapsed_s: float = 0.0
    max_in_flight: int = 0
    max_in_flight_seen: int = 0
    ttft_s: dict[str, float | None] = field(default_factory=dict)
    tpot_s: dict[str, float | None] = field(default_factory=dict)
    e2e_latency_s: dict[str, float | None] = field(default_factory=dict)
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    engine_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def generated_tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        total = self.num_prompt_tokens + self.num_generated_tokens
        return total / self.elapsed_s if self.elapsed_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["generated_tokens_per_s"] = self.generated_tokens_per_s
        data["total_tokens_per_s"] = self.total_tokens_per_s
        return data

    def format(self) -> str:
        def ms(stats: dict[str, float | None]) -> str:
            return " ".join(
                f"{k}={v * 1000:.0f}ms" if v is not None else f"{k}=-" for k, v in stats.items()
            )

        errors = ", ".join(f"{code}: {n}" for code, n in sorted(self.errors_by_code.items()))
        return "\n".join([
            f"requests   {self.num_ok} ok, {self.num_failed} failed"
            + (f" ({errors})" if errors else ""),
            f"tokens     {self.num_prompt_tokens} prompt ({self.num_cached_tokens} cached), "
            f"{self.num_generated_tokens} generated in {self.elapsed_s:.1f}s",
            f"throughput {self.generated_tokens_per_s:.1f} generated tok/s, "
            f"{self.total_tokens_per_s:.1f} total tok/s",
            f"TTFT       {ms(self.ttft_s)}",
            f"TPOT       {ms(self.tpot_s)}",
            f"prefix cache hit rate {self.prefix_cache_hit_rate:.1%}, "
            f"preemptions {self.num_preemptions}",
        ])


def sample_percentiles(values: list[float],
                       qs: tuple[int, ...] = (50, 95, 99)) -> dict[str, float | None]:
    """Exact percentiles of the raw values, linearly interpolated, None when there are none
    (``metrics.snapshot.histogram_percentiles`` estimates them from histogram buckets)."""
    ordered = sorted(values)
    result: dict[str, float | None] = {}
    for q in qs:
        if not ordered:
            result[f"p{q}"] = None
            continue
        pos = (len(ordered) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        result[f"p{q}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    return result


def count_lines(path: str | Path) -> int:
    """Non-blank lines of ``path``: the progress bar's total, in one cheap pass."""
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def _read_lines(f: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    for line_no, raw in enumerate(f, start=1):
        if raw.strip():
            yield line_no, raw


def run_batch_file(
    engine: Engine,
    input_path: str | Path,
    output_path: str | Path,
    *,
    errors_path: str | Path | None = None,
    model_name: str | None = None,
    max_in_flight: int | None = None,
    progress: bool = True,
    count_total: bool = True,
    endpoint: str | None = None,
) -> RunSummary:
    """Run every line of ``input_path``; results (and errors, unless ``errors_path``) go to
    ``output_path``. Returns the run's summary; never raises on a bad line.

    ``endpoint``: the url every line must name (as a batch's endpoint); None takes the first
    valid line's."""
    if max_in_flight is None:
        max_in_flight = IN_FLIGHT_PER_SEQ * engine.config.max_num_seqs
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    runner = _Runner(engine, model_name or engine.model_name, max_in_flight, endpoint)
    total = count_lines(input_path) if count_total else None
    with ExitStack() as stack:
        f_in = stack.enter_context(open(input_path, "rb"))
        out = stack.enter_context(open(output_path, "w", encoding="utf-8"))
        err = out
        if errors_path is not None:
            err = stack.enter_context(open(errors_path, "w", encoding="utf-8"))
        bar = stack.enter_context(_progress_bar(total, progress))
        runner.run(_read_lines(f_in), out, err, bar)
    return runner.summary()


def _progress_bar(total: int | None, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total, unit="req", desc="boxcar run", file=sys.stderr, disable=not enabled,
        dynamic_ncols=True,
    )


def _served_names(engine: Engine, model_name: str) -> set[str]:
    """The names a line's ``model`` may use in this run: the reported name, the engine's, and
    the model setting with and without its folder and ``.gguf`` suffix (the ids and aliases the
    service gives the same setting)."""
    setting = engine.config.model
    base = os.path.basename(setting.rstrip("/")) or setting
    names = {model_name, engine.model_name, setting, base, base.removesuffix(".gguf")}
    return {name for name in names if name}


class _Runner:
    """The drain loop's state: in-flight requests, counters, latency samples."""

    def __init__(self, engine: Engine, model_name: str, max_in_flight: int,
                 endpoint: str | None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_in_flight = max_in_flight
        self.ids = CustomIdTracker()
        self.in_flight: dict[str, _InFlight] = {}
        self.result = RunSummary(max_in_flight=max_in_flight)
        self.errors: Counter[str] = Counter()
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.e2es: list[float] = []
        self.endpoint = endpoint
        self.model_names = _served_names(engine, model_name)
        self.lora_names = set(engine.lora_names)
        self.started = time.monotonic()

    def run(self, lines: Iterator[tuple[int, bytes]], out: IO[str], err: IO[str], bar: Any) -> None:
        exhausted = False
        last_progress = 0.0
        generated_before = self.engine.get_stats().num_generated_tokens
        while True:
            while not exhausted and len(self.in_flight) < self.max_in_flight:
                item = next(lines, None)
                if item is None:
                    exhausted = True
                    break
                error = self.submit(*item)
                if error is not None:
                    self.write_error(error, err)
                    bar.update(1)
            self.result.max_in_flight_seen = max(
                self.result.max_in_flight_seen, len(self.in_flight)
            )
            if not self.in_flight:
                break
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine lost {len(self.in_flight)} requests")
            finished = self.engine.step()
            for request_output in finished:
                self.write_result(request_output, out)
            if finished:
                out.flush()
                bar.update(len(finished))
            now = time.monotonic()
            if now - last_progress >= PROGRESS_INTERVAL_S:
                last_progress = now
                # The engine's count includes requests still running, so the rate is live.
                generated = self.engine.get_stats().num_generated_tokens - generated_before
                rate = generated / max(now - self.started, 1e-9)
                bar.set_postfix(gen_tok_s=f"{rate:.1f}", in_flight=len(self.in_flight))
        self.result.elapsed_s = time.monotonic() - self.started

    def submit(self, line_no: int, raw: bytes) -> LineError | None:
        """Parse one line and add it to the engine, or say why it cannot run: the worker's
        pipeline (``pipeline.engine_adapter``), so a line fails here as it fails in a batch."""
        self.result.num_lines += 1
        parsed = parse_line(raw, line_no=line_no, endpoint=self.endpoint)
        if isinstance(parsed, LineError):
            return parsed
        duplicate = self.ids.check(parsed.custom_id, line_no=line_no)
        if duplicate is not None:
            return duplicate
        model = getattr(parsed.body, "model", None)
        lora_name = model if model in self.lora_names else None
        if model is not None and model not in self.model_names and lora_name is None:
            # The service refuses a batch naming a model it does not serve; a run serves one
            # base model and the LoRA adapters registered with --lora-modules.
            served = ", ".join([*sorted(self.model_names), *sorted(self.lora_names)])
            return LineError("model_not_found",
                             f"body.model {model!r} is not served by this run (it serves: "
                             f"{served}); name one of those or leave model out", line_no,
                             parsed.custom_id, numbered=False, param="model")
        if self.endpoint is None:
            self.endpoint = parsed.url  # the batch's endpoint: every line must name it
        request_id = new_id()
        engine_input = prepare(self.engine, parsed.url, parsed.body)
        if not isinstance(engine_input, PrepareError):
            engine_input = (add_to_engine(self.engine, request_id, engine_input,
                                          lora_name=lora_name) or engine_input)
        if isinstance(engine_input, PrepareError):
            return LineError(engine_input.code, engine_input.message, line_no, parsed.custom_id,
                             numbered=False, param=engine_input.param)
        self.in_flight[request_id] = _InFlight(parsed, request_id, engine_input.tool_mode,
                                               engine_input.response_echo, lora_name,
                                               engine_input.encoding_format,
                                               engine_input.score)
        return None

    def write_error(self, error: LineError, f: IO[str]) -> None:
        self.result.num_failed += 1
        self.errors[error.code] += 1
        line = error.to_line(request_id=new_id("req_"))
        if line is None:
            if len(self.result.line_errors) < MAX_LINE_ERRORS:
                self.result.line_errors.append(
                    {"line": error.line_no, "code": error.code, "message": error.message})
            return
        _write(f, line)

    def write_result(self, request_output: RequestOutput, f: IO[str]) -> None:
        entry = self.in_flight.pop(request_output.request_id)
        metrics = request_output.metrics
        body, usage = response_body(
            request_output, endpoint=entry.line.url, model=entry.lora_name or self.model_name,
            engine=self.engine, hex_id=new_id(), tool_mode=entry.tool_mode,
            response_echo=entry.response_echo, encoding_format=entry.encoding_format,
            score=entry.score,
        )
        _write(f, output_line(entry.line.custom_id, body, request_id=f"req_{entry.request_id}"))
        self.result.num_ok += 1
        self.result.num_prompt_tokens += usage.prompt_tokens
        self.result.num_cached_tokens += usage.cached_tokens
        self.result.num_generated_tokens += usage.completion_tokens
        for values, value in (
            (self.ttfts, metrics.ttft), (self.tpots, metrics.tpot), (self.e2es, metrics.e2e_latency)
        ):
            if value is not None:
                values.append(value)

    def summary(self) -> RunSummary:
        result = self.result
        result.errors_by_code = dict(self.errors)
        result.ttft_s = sample_percentiles(self.ttfts)
        result.tpot_s = sample_percentiles(self.tpots)
        result.e2e_latency_s = sample_percentiles(self.e2es)
        stats = self.engine.get_stats()
        result.prefix_cache_hit_rate = stats.prefix_cache_hit_rate
        result.num_preemptions = stats.num_preemptions
        result.engine_stats = asdict(stats) | {"prefix_cache_hit_rate": stats.prefix_cache_hit_rate}
        return result


def _write(f: IO[str], line: dict[str, Any]) -> None:
    f.write(json.dumps(line, ensure_ascii=False) + "\n")


def write_metrics_json(path: str | Path, summary: RunSummary, **extra: Any) -> None:
    """The summary and engine stats as one JSON document (read by ``boxcar doctor``)."""
    document = summary.as_dict() | extra
    Path(path).write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
