"""Structured outputs through ``boxcar run``: the same chat lines with and without
``response_format: json_schema``, interleaved, on the default model.

``python -m bench.structured_run [--num-lines 8] [--rounds 4] [--max-tokens 64]``

The schema file runs first (warm-up) and fixes each line's output length; the plain file's lines
then ask for exactly that many tokens (``ignore_eos``), so both do the same work. Each round runs
both files through ``cli.offline.run_batch_file`` (parse, the request pipeline, the engine, the
response and the output file) and the same prepared requests straight through ``LLM.generate``,
order alternating; the figure is schema/plain throughput, as medians of per-round ratios, for
the whole path and for the engine alone: their difference is what the service path adds. Outputs
of the schema file are parsed and validated with jsonschema.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import jsonschema

from bench.structured import SCHEMA, SUBJECTS, args_and_llm
from cli.offline import run_batch_file
from pipeline.engine_adapter import PrepareError, prepare

CHAT = "/v1/chat/completions"


def line(i: int, **body: object) -> dict:
    content = (f"Describe {SUBJECTS[i % len(SUBJECTS)]} (person {i}) as JSON with name, age, "
               "city, hobbies and employed.")
    return {"custom_id": f"line-{i}", "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": content}], **body}}


def write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def main() -> None:
    args, llm = args_and_llm(__doc__.splitlines()[0])
    engine = llm.engine
    tmp = Path(tempfile.mkdtemp(prefix="bench-structured-run-"))
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    schema_lines = [line(i, temperature=0, max_tokens=args.max_tokens,
                         response_format=response_format) for i in range(args.num_lines)]
    schema_file = write(tmp / "schema.jsonl", schema_lines)
    out = tmp / "out.jsonl"
    run_batch_file(engine, schema_file, out, progress=False, count_total=False)
    lengths, num_valid = {}, 0
    for raw in out.read_text().splitlines():
        result = json.loads(raw)
        choice = result["response"]["body"]["choices"][0]
        lengths[result["custom_id"]] = result["response"]["body"]["usage"]["completion_tokens"]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
            num_valid += 1
    print(f"schema lines: {num_valid}/{args.num_lines} complete and valid, "
          f"{sum(lengths.values())} tokens (the rest cut by max_tokens={args.max_tokens})")
    plain_lines = [line(i, temperature=0, max_tokens=lengths[f"line-{i}"], ignore_eos=True)
                   for i in range(args.num_lines)]
    files = {"plain": write(tmp / "plain.jsonl", plain_lines), "schema": schema_file}
    prepared = {}
    for name, lines in (("plain", plain_lines), ("schema", schema_lines)):
        inputs = [prepare(engine, CHAT, x["body"]) for x in lines]
        assert not any(isinstance(x, PrepareError) for x in inputs)
        prepared[name] = inputs

    def via_run(name: str) -> tuple[float, int]:
        start = time.perf_counter()
        summary = run_batch_file(engine, files[name], out, progress=False, count_total=False)
        return time.perf_counter() - start, summary.num_generated_tokens

    def via_engine(name: str) -> tuple[float, int]:
        inputs = prepared[name]
        start = time.perf_counter()
        outs = llm.generate([x.prompt for x in inputs], [x.params for x in inputs])
        return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)

    via_run("plain")  # warm up the plain path (the schema path ran above)
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        order = ["plain", "schema"] if r % 2 == 0 else ["schema", "plain"]
        for path, measure in (("run", via_run), ("engine", via_engine)):
            for name in order:
                seconds, num_tokens = measure(name)
                assert num_tokens == sum(lengths.values()), (path, name, num_tokens)
                times.setdefault(f"{path}/{name}", []).append(seconds)
                print(f"round {r} {path:6s} {name:6s} {seconds:7.2f} s "
                      f"{num_tokens / seconds:7.1f} tok/s", flush=True)
    tokens = sum(lengths.values())
    for path in ("run", "engine"):
        ratios = [p / s for p, s in zip(times[f"{path}/plain"], times[f"{path}/schema"],
                                        strict=True)]
        plain = statistics.median(times[f"{path}/plain"])
        print(f"{path:6s}: plain {tokens / plain:7.1f} tok/s (median); schema/plain throughput "
              f"= {statistics.median(ratios):.3f} (median of {args.rounds} per-round ratios)")


if __name__ == "__main__":
    main()
