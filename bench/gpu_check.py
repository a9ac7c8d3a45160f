"""GPU acceptance check for the Triton path, in one run on an NVIDIA GPU (sized for an H200).

1. The kernel, backend and CUDA-graph tests, on CUDA tensors (no interpreter), with the LoRA
   and MoE kernels' and multi-LoRA's exactness tests (fp32 against peft, every scheduling mode).
1b. Multi-LoRA speed (issue 27, ``bench/lora.py``): the base model, 8 adapters mixed in one
   batch, and one adapter at a time with merged weights, on a random model of the default
   model's shapes in bf16; targets (b) >= 0.8x (a) and (b) >= 2x (c).
2. Decode-kernel bandwidth at serving shapes (bf16, 32 query / 8 kv heads, head_dim 128) against
   a measured device-to-device copy; target >= 70% of it. Prefill throughput for information.
3. End to end: boxcar's ``LLM`` against transformers' continuous batching on one workload of
   token-id prompts (random-weight ~0.6B Llama, greedy, ignore_eos); target >= 5x tokens/s.
4. Tensor parallel, on a machine with two or more GPUs (``bench/tp.py``): TP=2's greedy tokens
   equal TP=1's in fp32 (a small Llama), and the ~0.6B Llama's decode step at TP=1 and TP=2 in
   bf16 with the all-reduces' share of it. Skipped, with a row saying so, on one GPU.
3b. Device busy (issue 46): the share of a decode-heavy run's wall time the GPU spends in
   kernels (the union of their intervals in a torch profile), 256 requests of 32 prompt and 128
   output tokens on the same model, async scheduling on (the default on CUDA); target >= 90%.
5. Quantized linears (issue 48): AWQ-style int4 and FP8 (per channel through
   ``torch._scaled_mm``, 128x128 blocks through Triton) against bf16 on Llama-3-8B's linear
   shapes, decode and prefill rows; target at decode rows: faster than bf16.

Prints a summary table and writes it to ``$OUT/gpu_report.txt`` when ``OUT`` is set. Usage:
``bash bench/gpu_check.sh [--skip-tests] [--skip-lora] [--skip-kernels] [--skip-e2e]
[--skip-busy] [--skip-tp] [--skip-quantized] [--num-requests N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import inspect
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = [
    "tests/engine/test_kernel_store_kvcache.py",
    "tests/engine/test_kernel_decode.py",
    "tests/engine/test_kernel_prefill.py",
    "tests/engine/test_triton_backend.py",
    "tests/engine/test_cuda_graphs.py",
    "tests/engine/test_kernel_lora.py",
    "tests/engine/test_kernel_fused_moe.py",
    "tests/engine/test_lora.py",  # every scheduling mode on the GPU path, fp32, against peft
    "tests/engine/test_kernel_int4.py",  # AWQ / GPTQ int4 (Triton)
    "tests/engine/test_kernel_fp8.py",  # FP8 scaled matmul / dequantizing kernel
    "tests/engine/test_triton_ggml_gemm.py",  # GGUF blocks kept quantized (Triton)
    "tests/engine/test_hf_quant.py",  # AWQ / GPTQ / FP8 checkpoints end to end
    # async scheduling's steps on the GPU path (CUDA graphs replayed on the step thread) give
    # the synchronous engine's tokens
    "tests/engine/test_async_scheduling.py",
    # the sampler on CUDA logits: the CPU's tokens, and one crossing a step (issue 46)
    "tests/engine/test_sampler_on_device.py",
]


@dataclass
class Row:
    section: str
    metric: str
    value: str
    target: str = ""
    ok: bool | None = None

    def cells(self) -> list[str]:
        status = {True: "PASS", False: "FAIL", None: ""}[self.ok]
        return [self.section, self.metric, self.value, self.target, status]


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# 1. tests ---------------------------------------------------------------------------------------


def run_tests(timeout_s: float) -> list[Row]:
    # "0", not unset: tests/conftest.py defaults it to "1" (the interpreter) for CPU machines
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *KERNEL_TESTS]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "8"]  # the Triton compiles dominate; spread them over the CPU cores
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return [Row("tests", "kernel tests on CUDA", f"timed out after {timeout_s:.0f}s", ok=False)]
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n", flush=True)
    if out := os.environ.get("OUT"):  # the whole log: the first failure may be far up
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_tests.txt").write_text(proc.stdout + "\n" + proc.stderr)
    summary = next(
        (line for line in reversed(proc.stdout.splitlines()) if " in " in line), "no summary"
    )
    return [Row("tests", "kernel tests on CUDA", summary.strip("= "), "all pass",
                proc.returncode == 0)]


# 2. kernels -------------------------------------------------------------------------------------


def _bench_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy of 2 GiB (bytes read + bytes written)."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    return 2 * (1 << 31) / (ms * 1e-3)


def bench_decode() -> list[Row]:
    from engine.kernels.paged_decode_attention import (
        DecodeConfig,
        paged_decode_attention,
        paged_decode_attention_ref,
    )

    rows: list[Row] = []
    copy_bw = copy_bandwidth()
    rows.append(Row("decode", "d2d copy bandwidth", f"{copy_bw / 1e12:.2f} TB/s"))
    dtype, num_heads, num_kv_heads, head_dim, block_size = torch.bfloat16, 32, 8, 128, 16
    scale = head_dim**-0.5
    max_tokens = 256 * 8192
    num_blocks = max_tokens // block_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device="cuda", generator=gen)
    v_cache = torch.randn(cache_shape, dtype=dtype, device="cuda", generator=gen)
    token_bytes = 2 * num_kv_heads * head_dim * dtype.itemsize

    def inputs(batch: int, context: int) -> tuple[torch.Tensor, ...]:
        max_blocks = context // block_size
        # Scattered pages, as a long-running cache has them.
        tables = torch.randperm(num_blocks, device="cuda", generator=gen)[: batch * max_blocks]
        tables = tables.view(batch, max_blocks).int()
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device="cuda", generator=gen)
        return q, tables, lens

    shapes = [(64, 1024), (64, 8192), (128, 4096), (256, 2048), (256, 8192)]
    ratios = []
    for batch, context in shapes:
        q, tables, lens = inputs(batch, context)
        ms = _bench_ms(lambda q=q, tables=tables, lens=lens: paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale))
        moved = batch * context * token_bytes + 2 * q.numel() * q.element_size()
        moved += tables.numel() * tables.element_size()
        ratio = moved / (ms * 1e-3) / copy_bw
        ratios.append(ratio)
        rows.append(Row("decode", f"B={batch} ctx={context}",
                        f"{ms * 1e3:.0f} us, {moved / (ms * 1e-3) / 1e12:.2f} TB/s, {ratio:.0%}",
                        ">= 70% of copy", ratio >= 0.7))
        if (batch, context) == shapes[0]:
            out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
            ref = paged_decode_attention_ref(q[:4], k_cache, v_cache, tables[:4], lens[:4], scale)
            err = (out[:4].float() - ref.float()).abs().max().item()
            rows.append(Row("decode", "max |kernel - ref| (bf16)", f"{err:.2e}", "< 2e-2",
                            err < 2e-2))

    # A small sweep of launch knobs at one mid shape, to tune the defaults from.
    q, tables, lens = inputs(64, 4096)
    moved = 64 * 4096 * token_bytes
    best = ""
    best_bw = 0.0
    configs = [DecodeConfig(n, w, 2) for n in (32, 64, 128) for w in (4, 8)]
    configs += [DecodeConfig(64, 4, 3), DecodeConfig(64, 4, 4)]
    for config in configs:
        for splits in (None, 1, 2, 4):
            try:
                ms = _bench_ms(lambda c=config, s=splits: paged_decode_attention(
                    q, k_cache, v_cache, tables, lens, scale, s, config=c))
            except Exception as exc:  # e.g. out of shared memory
                log(f"config {config} splits={splits} failed: {exc}")
                continue
            if moved / (ms * 1e-3) > best_bw:
                best_bw = moved / (ms * 1e-3)
                best = f"{config} splits={splits}"
    rows.append(Row("decode", "best knobs B=64 ctx=4096",
                    f"{best_bw / copy_bw:.0%}: {best}"))
    rows.insert(1, Row("decode", "min ratio over shapes", f"{min(ratios):.0%}", ">= 70%",
                       min(ratios) >= 0.7))
    return rows


def bench_prefill() -> list[Row]:
    """For information: 8 prompts of 2048 tokens from scratch, bf16, 32/8 heads of 128."""
    from engine.kernels.paged_prefill_attention import paged_prefill_attention

    dtype, num_heads, num_kv_heads, head_dim, block_size = torch.bfloat16, 32, 8, 128, 16
    scale = head_dim**-0.5
    num_seqs, seq_len = 8, 2048
    blocks = num_seqs * seq_len // block_size
    pk = torch.randn(blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    pv = torch.randn_like(pk)
    tables = torch.arange(blocks, dtype=torch.int32, device="cuda").view(num_seqs, -1)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * seq_len
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    pq = torch.randn(num_seqs * seq_len, num_heads, head_dim, dtype=dtype, device="cuda")
    ms = _bench_ms(
        lambda: paged_prefill_attention(pq, pk, pv, tables, starts, lens, scale, seq_len)
    )
    flops = 4 * num_seqs * num_heads * head_dim * seq_len * (seq_len + 1) / 2
    return [Row("prefill", f"{num_seqs}x{seq_len} causal", f"{flops / ms / 1e9:.0f} TFLOP/s")]


# 3. end to end ----------------------------------------------------------------------------------

VOCAB = 32000


def build_model(folder: Path, device: str = "cuda", **overrides: int) -> None:
    """A random-weight ~0.6B Llama and an offline word-level tokenizer, saved for both engines."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=1536, intermediate_size=4096, num_hidden_layers=20,
        num_attention_heads=12, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    for key, value in overrides.items():  # smaller shapes for a CPU smoke run
        setattr(config, key, value)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params")
    model.save_pretrained(folder)
    del model
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<unk>",
    ).save_pretrained(folder)


def workload(num_requests: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, VOCAB) for _ in range(rng.randint(128, 1024))]
        for _ in range(num_requests)
    ]
    return prompts, [rng.randint(128, 512) for _ in range(num_requests)]


def run_engine(folder: Path, prompts: list[list[int]], max_tokens: list[int],
               async_scheduling: bool | None = None) -> tuple[int, float]:
    from engine import LLM, EngineConfig, SamplingParams

    wanted = {
        "max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 2048,
        "kv_cache_memory": 24 << 30, "attention_backend": "triton",
        "async_scheduling": async_scheduling,
    }
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    llm = LLM(model=str(folder), dtype="bfloat16", device="cuda",
              **{k: v for k, v in wanted.items() if k in fields})
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    llm.generate([p[:64] for p in prompts[:8]], params[:8])  # warm up (kernel compiles)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    short = sum(g != n for g, n in zip(generated, max_tokens, strict=True))
    if short:
        log(f"engine: {short} requests did not generate exactly max_tokens")
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()
    return sum(generated), elapsed


def run_transformers(
    folder: Path, prompts: list[list[int]], max_tokens: list[int], timeout_s: float,
    device: str = "cuda",
) -> tuple[int, float, str]:
    """transformers' continuous batching (the manager behind ``generate_batch``) with the same
    per-request ``max_new_tokens``. Returns tokens, seconds and a note."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    model.config.eos_token_id = None
    gen_config = GenerationConfig(
        do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=None, pad_token_id=0
    )
    cm = model.continuous_batching_context_manager
    cm_kwargs: dict[str, object] = {"generation_config": gen_config, "block": True, "timeout": 10}
    if "workload_hints" in inspect.signature(cm).parameters:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        cm_kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max(map(len, prompts)),
            max_generated_length=max(max_tokens),
            num_requests=len(prompts),
        )
    note = ""
    tokens = 0
    with torch.no_grad(), cm(**cm_kwargs) as manager:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            manager.add_request(input_ids=prompt, request_id=f"r{i}", max_new_tokens=n)
        done = 0
        while done < len(prompts):
            if time.perf_counter() - start > timeout_s:
                note = f"stopped after {timeout_s:.0f}s: {done}/{len(prompts)} finished"
                break
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                note = f"manager stopped: {done}/{len(prompts)} finished"
                break
        elapsed = time.perf_counter() - start
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, elapsed, note


def bench_e2e(num_requests: int, hf_timeout_s: float, deadline: float) -> list[Row]:
    rows: list[Row] = []
    prompts, max_tokens = workload(num_requests)
    rows.append(Row("e2e", "workload",
                    f"{num_requests} reqs, prompts {sum(map(len, prompts))} tok, "
                    f"max_tokens {sum(max_tokens)} tok"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama-random"
        build_model(folder)
        engine_tps = hf_tps = None
        try:
            tokens, seconds = run_engine(folder, prompts, max_tokens)
            engine_tps = tokens / seconds
            rows.append(Row("e2e", "boxcar LLM", f"{engine_tps:,.0f} tok/s "
                            f"({tokens} tok in {seconds:.1f}s)"))
        except Exception as exc:
            traceback.print_exc()
            rows.append(Row("e2e", "boxcar LLM", f"error: {type(exc).__name__}: {exc}"[:160],
                            ok=False))
        try:  # the default above overlaps steps on a GPU (async_scheduling): the same, without
            tokens, seconds = run_engine(folder, prompts, max_tokens, async_scheduling=False)
            rows.append(Row("e2e", "boxcar LLM, async_scheduling off",
                            f"{tokens / seconds:,.0f} tok/s ({tokens} tok in {seconds:.1f}s)"))
        except Exception as exc:
            traceback.print_exc()
            rows.append(Row("e2e", "boxcar LLM, async_scheduling off",
                            f"error: {type(exc).__name__}: {exc}"[:160], ok=False))
        try:
            timeout_s = max(30.0, min(hf_timeout_s, deadline - time.perf_counter()))
            tokens, seconds, note = run_transformers(folder, prompts, max_tokens, timeout_s)
            hf_tps = tokens / seconds
            rows.append(Row("e2e", "transformers CB", f"{hf_tps:,.0f} tok/s "
                            f"({tokens} tok in {seconds:.1f}s) {note}".strip()))
        except Exception as exc:
            traceback.print_exc()
            rows.append(Row("e2e", "transformers CB",
                            f"error: {type(exc).__name__}: {exc}"[:160], ok=False))
        if engine_tps and hf_tps:
            ratio = engine_tps / hf_tps
            rows.append(Row("e2e", "speedup", f"{ratio:.1f}x", ">= 5x", ratio >= 5))
    return rows


def busy_share(intervals: list[tuple[float, float]]) -> float:
    """The share of the span from the first interval's start to the last one's end that the
    union of ``intervals`` (start, end) covers: 1.0 when the device never idles."""
    if not intervals:
        return 0.0
    ordered = sorted(intervals)
    covered = 0.0
    start, end = ordered[0]
    first = start
    last = max(e for _, e in ordered)
    for s, e in ordered[1:]:
        if s > end:
            covered += end - start
            start, end = s, e
        else:
            end = max(end, e)
    covered += end - start
    return covered / (last - first) if last > first else 1.0


def bench_busy(num_requests: int = 256) -> list[Row]:
    """Issue 46's device-busy share: a decode-heavy run under the torch profiler, the GPU's
    kernel intervals' union over the run's span; greedy, then seeded sampling with penalties
    and min_tokens (rows that overlap too since their counts moved to the device)."""
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams

    runs = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True),
        "sampled, penalized": SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, seed=1, presence_penalty=0.3,
            frequency_penalty=0.2, min_tokens=8, max_tokens=128, ignore_eos=True),
    }
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama-random"
        build_model(folder)
        llm = LLM(model=str(folder), dtype="bfloat16", device="cuda", max_num_seqs=256,
                  attention_backend="triton")
        rng = random.Random(1)
        prompts = [[rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(num_requests)]
        for name, params in runs.items():
            llm.generate(prompts[:16], params)  # warm up: kernel compiles, graphs
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA]
            share = busy_share(kernels)
            rows += [Row("busy", f"decode-heavy run, {name}",
                         f"{tokens / seconds:,.0f} tok/s ({num_requests} reqs x 128 tok, "
                         f"profiled), {len(kernels)} kernels"),
                     Row("busy", f"device busy, {name}", f"{share:.1%} of the kernels' span",
                         ">= 90%", share >= 0.9)]
        del llm, outputs
        gc.collect()
        torch.cuda.empty_cache()
    return rows


# The default model's shapes (SmolLM2-135M): what issue 27's bench.lora runs on.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def bench_lora() -> list[Row]:
    """``bench.lora`` on the GPU: (a) base, (b) 8 adapters mixed, (c) one at a time merged, on a
    random model of the default model's shapes, bf16."""
    from bench.lora import measure

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "smollm2-shaped"
        build_model(folder, **SMOLLM2_SHAPE)
        result = measure(str(folder), lines=256, adapters=8, prompt_tokens=128, max_tokens=64,
                         rounds=2, device="cuda", dtype="bfloat16",
                         engine_options={"max_num_seqs": 256, "max_num_batched_tokens": 8192,
                                         "kv_cache_memory": 8 << 30})
    print("\n".join(result.report(8)), flush=True)
    ba, bc = result.b_tps / result.a_tps, result.b_tps / result.c_tps
    return [
        Row("lora", "(a) base / (b) 8 mixed / (c) one at a time",
            f"{result.a_tps:,.0f} / {result.b_tps:,.0f} / {result.c_tps:,.0f} tok/s"),
        Row("lora", "(b)/(a)", f"{ba:.2f}x", ">= 0.8x", ba >= 0.8),
        Row("lora", "(b)/(c)", f"{bc:.2f}x", ">= 2x", bc >= 2),
        Row("lora", "(b) and (c) agree (bf16)", f"{result.agree}/{result.lines} lines"),
    ]


def bench_tp() -> list[Row]:
    from bench.tp import measure

    count = torch.cuda.device_count()
    if count < 2:
        return [Row("tp", "TP=2", f"skipped: {count} GPU visible, TP=2 needs 2")]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "llama-small"
        build_model(small, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64)
        exact = [measure(small, tp, batch=8, prompt_len=64, steps=32, threads=None,
                         device="cuda", dtype="float32") for tp in (1, 2)]
        equal = exact[0].token_ids == exact[1].token_ids
        rows.append(Row("tp", "fp32 greedy TP=2 vs TP=1", "equal" if equal else "differ",
                        "equal", equal))
        folder = Path(tmp) / "llama-random"
        build_model(folder)
        one, two = (measure(folder, tp, batch=64, prompt_len=512, steps=32, threads=None,
                            device="cuda", dtype="bfloat16") for tp in (1, 2))
    rows.append(Row("tp", "decode step TP=1 / TP=2", f"{one.decode_ms:.2f} / "
                    f"{two.decode_ms:.2f} ms ({one.decode_ms / two.decode_ms:.2f}x)"))
    rows.append(Row("tp", "prefill step TP=1 / TP=2", f"{one.prefill_ms:.1f} / "
                    f"{two.prefill_ms:.1f} ms"))
    rows.append(Row("tp", "all-reduce share (TP=2 decode)", f"{two.reduce_share:.1%}"))
    agree = sum(a == b for x, y in zip(one.token_ids, two.token_ids, strict=True)
                for a, b in zip(x, y, strict=True)) / max(sum(map(len, one.token_ids)), 1)
    rows.append(Row("tp", "bf16 greedy agreement TP=2 vs TP=1", f"{agree:.1%}"))
    rows += bench_tp_moe()
    return rows


def bench_tp_moe() -> list[Row]:
    """A mixture of experts at TP=2, its experts split (tensor parallel) and spread whole
    (expert parallel): fp32 greedy tokens against TP=1, and each mode's decode step."""
    from bench.random_model import write_random_model
    from bench.tp import measure

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_random_model(Path(tmp) / "qwen3-moe", "qwen3_moe")
        one, split, spread = (
            measure(folder, tp, batch=32, prompt_len=256, steps=32, threads=None,
                    device="cuda", dtype="float32", expert_parallel=ep)
            for tp, ep in ((1, False), (2, False), (2, True)))
    for name, run in (("TP", split), ("EP", spread)):
        equal = run.token_ids == one.token_ids
        rows.append(Row("tp", f"MoE fp32 greedy TP=2 {name} vs TP=1",
                        "equal" if equal else "differ", "equal", equal))
        rows.append(Row("tp", f"MoE decode step TP=1 / TP=2 {name}",
                        f"{one.decode_ms:.2f} / {run.decode_ms:.2f} ms, all-reduce "
                        f"{run.reduce_share:.1%}"))
    return rows


# 5. quantized linears (issue 48) ----------------------------------------------------------------

# Llama-3-8B's linears: fused q/k/v, fused gate/up, down
QUANT_SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def bench_quantized() -> list[Row]:
    """AWQ-style int4 (group 128, the Triton kernel), FP8 per channel (``torch._scaled_mm``) and
    FP8 in 128x128 blocks (the Triton kernel) against bf16 ``F.linear`` on the same shapes: the
    time of one layer's three products at decode rows (1, 16) and prefill rows (256, 2048), and
    each kernel's error against its torch reference at 16 rows."""
    from engine.kernels.fp8_weights import Fp8Weight
    from engine.kernels.fp8_weights import linear_reference as fp8_reference
    from engine.kernels.int4_weights import Int4Weight, pack_int32
    from engine.kernels.int4_weights import linear_reference as int4_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    layers: dict[str, list[tuple[object, int]]] = {"bf16": [], "int4": [], "fp8": [],
                                                    "fp8 blocks": []}
    for n, k in QUANT_SHAPES.values():
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen)
        layers["bf16"].append((dense, k))
        layers["int4"].append((Int4Weight(
            pack_int32(codes).t().contiguous(), torch.full((k // 128, n), 8, dtype=torch.uint8,
                                                           device="cuda"),
            torch.full((k // 128, n), 0.002, dtype=torch.float16, device="cuda"), 128), k))
        fp8 = (dense * 2000).to(torch.float8_e4m3fn)
        layers["fp8"].append((Fp8Weight.from_checkpoint(
            fp8, torch.full((n, 1), 1e-5, device="cuda")), k))
        layers["fp8 blocks"].append((Fp8Weight.from_checkpoint(
            fp8, torch.full((n // 128, k // 128), 1e-5, device="cuda"), (128, 128)), k))
        del codes

    def run(kind: str, m: int) -> Callable[[], object]:
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
              for _, k in layers[kind]}

        def layer() -> None:
            for weight, k in layers[kind]:
                if isinstance(weight, torch.Tensor):
                    torch.nn.functional.linear(xs[k], weight)
                else:
                    weight.linear(xs[k])  # type: ignore[attr-defined]

        return layer

    rows: list[Row] = []
    for m in (1, 16, 256, 2048):
        ms = {kind: _bench_ms(run(kind, m)) for kind in layers}
        ratios = {kind: ms["bf16"] / ms[kind] for kind in ("int4", "fp8", "fp8 blocks")}
        decode = m <= 16
        rows.append(Row("quantized", f"M={m} layer (bf16 {ms['bf16'] * 1e3:.0f} us)",
                        ", ".join(f"{kind} {ms[kind] * 1e3:.0f} us ({ratios[kind]:.2f}x)"
                                  for kind in ratios),
                        "int4, fp8 > 1x bf16" if decode else "",
                        min(ratios["int4"], ratios["fp8"]) > 1.0 if decode else None))
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    for kind, reference, bound in (("int4", int4_reference, 2e-2),
                                   ("fp8 blocks", fp8_reference, 2e-2),
                                   ("fp8", fp8_reference, 6e-2)):  # activations in e4m3
        weight = layers[kind][0][0]
        out = weight.linear(x)  # type: ignore[attr-defined]
        ref = reference(x, weight)  # type: ignore[arg-type]
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        rows.append(Row("quantized", f"{kind} |kernel - ref| / |ref| (M=16, bf16)",
                        f"{err:.2e}", f"< {bound:g}", err < bound))
    return rows


def format_table(rows: list[Row]) -> str:
    header = ["section", "metric", "value", "target", "status"]
    cells = [header] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(header))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_report(table: str) -> None:
    if out := os.environ.get("OUT"):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_report.txt").write_text(table + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-busy", action="store_true")
    parser.add_argument("--skip-tp", action="store_true")
    parser.add_argument("--skip-lora", action="store_true")
    parser.add_argument("--skip-quantized", action="store_true")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--hf-timeout", type=float, default=180.0)
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for the whole run; the transformers run is cut to fit")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: this check times the compiled kernels", file=sys.stderr)
        return 2

    started = time.perf_counter()
    device = torch.cuda.get_device_properties(0)
    rows = [Row("env", "device", f"{device.name}, {device.multi_processor_count} SMs, "
                f"{device.total_memory / 2**30:.0f} GiB"),
            Row("env", "versions", f"torch {torch.__version__}, python {sys.version.split()[0]}")]
    sections: list[tuple[str, bool, Callable[[], list[Row]]]] = [
        ("tests", args.skip_tests, lambda: run_tests(180.0)),
        ("lora", args.skip_lora, bench_lora),
        ("decode", args.skip_kernels, bench_decode),
        ("prefill", args.skip_kernels, bench_prefill),
        ("busy", args.skip_busy, bench_busy),  # before e2e, whose transformers run is cut to fit
        ("e2e", args.skip_e2e, lambda: bench_e2e(
            args.num_requests, args.hf_timeout, started + args.budget - 45.0)),
        ("tp", args.skip_tp, bench_tp),
        ("quantized", args.skip_quantized, bench_quantized),
    ]
    for name, skip, section in sections:
        if skip:
            continue
        log(f"{name} ...")
        t = time.perf_counter()
        try:
            rows += section()
        except Exception as exc:
            traceback.print_exc()
            rows.append(Row(name, "section", f"error: {type(exc).__name__}: {exc}"[:160],
                            ok=False))
        log(f"{name} done in {time.perf_counter() - t:.0f}s")
        write_report(format_table(rows))  # so far: a run cut short keeps its sections
    rows.append(Row("env", "wall time", f"{time.perf_counter() - started:.0f}s", "< 600s"))

    table = format_table(rows)
    print("\n" + table, flush=True)
    write_report(table)
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
