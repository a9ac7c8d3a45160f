"""Embeddings benchmark: boxcar against sentence-transformers and transformers on the real
all-MiniLM-L6-v2, one run side by side, then a 50,000-input batch through the service.

    python -m bench.embeddings [--num-inputs 4000] [--service-inputs 50000] [--threads N]

The corpus has the length distribution of a real one: many short inputs and a long tail
(lognormal word counts, median ~12 words, cut at the model's 256 tokens), seeded. Each side
embeds the whole corpus once after a warm-up:

- sentence-transformers' ``encode`` with its defaults (batches of 32, sorted by length);
- transformers' ``BertModel`` with padded batches of 32 in corpus order, mean pooling and
  normalization (what a hand-written loop does);
- boxcar fp32 and boxcar's default dtype (bf16 on a CPU with bf16 units, behind the quality
  gate), every input packed into full token-budget steps with no padding.

It prints tokens/s and inputs/s of each, the share of padding each padded peer computed, the
ratios against sentence-transformers fp32 (targets: fp32 >= 1.3x, default dtype >= 2.5x) and,
through the embedded service (REST upload, batch, worker, SQLite, files), a batch of
``--service-inputs`` inputs end to end: inputs/s and the service process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

_WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from "
          "at which but have an they you were her she there been one all we their its can "
          "search index cluster duplicate retrieval document vector batch offline corpus query "
          "embedding model token inference server hardware memory latency throughput price "
          "customer order shipping invoice refund warranty review product quality").split()


def make_corpus(num_inputs: int, *, seed: int = 0) -> list[str]:
    """Lognormal word counts (median ~12, long tail), capped so no input passes 256 tokens."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num_inputs):
        num_words = max(1, min(200, int(rng.lognormvariate(2.5, 0.9))))
        words = [rng.choice(_WORDS) for _ in range(num_words)]
        texts.append(" ".join(words).capitalize() + ".")
    return texts


@dataclass
class Side:
    name: str
    seconds: float
    num_inputs: int
    num_tokens: int  # real tokens (special tokens included)
    num_computed: int  # token positions computed, padding included

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def inputs_per_s(self) -> float:
        return self.num_inputs / self.seconds

    @property
    def padding_share(self) -> float:
        return 1 - self.num_tokens / self.num_computed if self.num_computed else 0.0


def model_dir() -> str:
    from engine.checkpoint import model_cache

    return str(model_cache.pull(model_cache.EMBEDDING_MODEL, quiet=True))


def run_sentence_transformers(texts: list[str], lengths: list[int]) -> Side:
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir(), device="cpu")
    model.encode(texts[:64], batch_size=32)  # warm-up
    start = time.perf_counter()
    with torch.inference_mode():
        model.encode(texts, batch_size=32)
    seconds = time.perf_counter() - start
    # encode sorts by length (longest first) and pads each batch of 32 to its longest
    ordered = sorted(lengths, reverse=True)
    computed = sum(max(ordered[i:i + 32]) * len(ordered[i:i + 32])
                   for i in range(0, len(ordered), 32))
    return Side("sentence-transformers fp32", seconds, len(texts), sum(lengths), computed)


def run_transformers(texts: list[str], lengths: list[int]) -> Side:
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer, BertModel

    folder = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = BertModel.from_pretrained(folder).eval()

    def embed(batch: list[str]) -> torch.Tensor:
        encoded = tokenizer(batch, padding=True, truncation=True, max_length=256,
                            return_tensors="pt")
        hidden = model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).float()
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    with torch.inference_mode():
        embed(texts[:32])  # warm-up
        start = time.perf_counter()
        for i in range(0, len(texts), 32):
            embed(texts[i:i + 32])
        seconds = time.perf_counter() - start
    computed = sum(max(lengths[i:i + 32]) * len(lengths[i:i + 32])
                   for i in range(0, len(lengths), 32))
    return Side("transformers padded fp32", seconds, len(texts), sum(lengths), computed)


def run_boxcar(texts: list[str], lengths: list[int], dtype: str) -> tuple[Side, dict]:
    from engine import EngineConfig, LLMEngine
    from engine.pooling_params import PoolingParams

    engine = LLMEngine(EngineConfig(model=model_dir(), dtype=dtype))
    params = PoolingParams()

    def embed_all(batch: list[str]) -> None:
        for i, text in enumerate(batch):
            engine.add_request(f"r{i}", text, params)
        while engine.has_unfinished_requests():
            engine.step()

    embed_all(texts[:64])  # warm-up
    before = engine.get_stats()
    start = time.perf_counter()
    embed_all(texts)
    seconds = time.perf_counter() - start
    stats = engine.get_stats()
    num_steps = stats.num_steps - before.num_steps
    gate = engine.dtype_gate
    extra = {
        "dtype": str(engine.model_runner.dtype).removeprefix("torch."),
        "steps": num_steps,
        "mean_tokens_per_step": round(sum(lengths) / max(num_steps, 1), 1),
        "gate_min_cosine": None if gate is None else round(gate.min_cosine, 6),
    }
    name = "boxcar fp32" if dtype == "float32" else f"boxcar default ({extra['dtype']})"
    return Side(name, seconds, len(texts), sum(lengths), sum(lengths)), extra


def _service_run(num_inputs: int, per_line: int, workdir: str) -> dict[str, Any]:
    """In a fresh process: the embedded service embeds a ``num_inputs`` batch end to end."""
    from cli.demo import _free_port, submit_and_wait
    from cli.embedded import EmbeddedServer
    from service.settings import Settings

    texts = make_corpus(num_inputs, seed=1)
    path = os.path.join(workdir, "service.jsonl")
    with open(path, "w") as f:
        for n, i in enumerate(range(0, num_inputs, per_line)):
            f.write(json.dumps({"custom_id": f"line-{n}", "method": "POST",
                                "url": "/v1/embeddings",
                                "body": {"input": texts[i:i + per_line]}}) + "\n")
    settings = Settings(database_url=f"sqlite:///{workdir}/service.db",
                        storage_url=os.path.join(workdir, "storage"), model=model_dir(),
                        poll_interval=0.5, finalize_scan_interval=0.5)
    server = EmbeddedServer(settings, port=_free_port()).start()
    try:
        start = time.monotonic()
        batch = submit_and_wait(server.base_url, server.api_key, path, poll=1.0,
                                progress=False)
        seconds = time.monotonic() - start
    finally:
        server.stop()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"inputs": num_inputs, "lines": batch["request_counts"]["total"],
            "completed_lines": batch["request_counts"]["completed"],
            "status": batch["status"], "seconds": round(seconds, 2),
            "inputs_per_s": round(num_inputs / seconds, 1),
            "peak_rss_mib": round(peak_kib / 1024, 1),
            "prompt_tokens": batch["usage"]["input_tokens"]}


def run_service(num_inputs: int, per_line: int) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="boxcar-bench-emb-") as workdir:
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            return pool.submit(_service_run, num_inputs, per_line, workdir).result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.embeddings", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-inputs", type=int, default=4000)
    parser.add_argument("--service-inputs", type=int, default=50_000,
                        help="inputs of the service batch (0: skip it)")
    parser.add_argument("--inputs-per-line", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    texts = make_corpus(args.num_inputs)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=256).input_ids]
    sides = [run_sentence_transformers(texts, lengths), run_transformers(texts, lengths)]
    fp32, fp32_extra = run_boxcar(texts, lengths, "float32")
    default, default_extra = run_boxcar(texts, lengths, "auto")
    sides += [fp32, default]
    st = sides[0]
    report: dict[str, Any] = {
        "num_inputs": len(texts), "num_tokens": sum(lengths),
        "median_tokens": sorted(lengths)[len(lengths) // 2], "max_tokens": max(lengths),
        "threads": torch.get_num_threads(),
        "sides": [{"name": s.name, "seconds": round(s.seconds, 3),
                   "tokens_per_s": round(s.tokens_per_s, 1),
                   "inputs_per_s": round(s.inputs_per_s, 1),
                   "padding_share": round(s.padding_share, 3)} for s in sides],
        "boxcar_fp32": fp32_extra, "boxcar_default": default_extra,
        "fp32_vs_sentence_transformers": round(st.seconds / fp32.seconds, 3),
        "default_vs_sentence_transformers": round(st.seconds / default.seconds, 3),
    }
    report["targets_met"] = {"fp32 >= 1.3x": report["fp32_vs_sentence_transformers"] >= 1.3,
                             "default >= 2.5x": report["default_vs_sentence_transformers"] >= 2.5}
    if args.service_inputs:
        report["service"] = run_service(args.service_inputs, args.inputs_per_line)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"corpus: {report['num_inputs']} inputs, {report['num_tokens']} tokens (median "
          f"{report['median_tokens']}, max {report['max_tokens']}), {report['threads']} threads")
    print(f"{'side':<30} {'seconds':>8} {'tokens/s':>10} {'inputs/s':>9} {'padding':>8}")
    for s in report["sides"]:
        print(f"{s['name']:<30} {s['seconds']:8.2f} {s['tokens_per_s']:10.1f} "
              f"{s['inputs_per_s']:9.1f} {s['padding_share']:8.1%}")
    print(f"boxcar fp32: {fp32_extra}; default: {default_extra}")
    print(f"boxcar fp32 / sentence-transformers: {report['fp32_vs_sentence_transformers']:.2f}x "
          "(target >= 1.3x)")
    print(f"boxcar default / sentence-transformers fp32: "
          f"{report['default_vs_sentence_transformers']:.2f}x (target >= 2.5x)")
    if "service" in report:
        s = report["service"]
        print(f"service: {s['inputs']} inputs in {s['lines']} lines, {s['status']} "
              f"({s['completed_lines']} completed) in {s['seconds']} s: {s['inputs_per_s']} "
              f"inputs/s, peak RSS {s['peak_rss_mib']} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
