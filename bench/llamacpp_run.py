"""Greedy batched generation with llama.cpp's low-level API; runs inside the llama.cpp venv.

``python bench/llamacpp_run.py REQUESTS.json`` prints one JSON object on stdout:
``{"seconds": ..., "outputs": [[token ids], ...], "version": ...}``.

REQUESTS.json: ``{"model": GGUF path, "prompts": [[token ids], ...], "max_tokens": [...],
"parallel": 16, "threads": 2, "batch_tokens": 2048}``. Up to ``parallel`` requests are in
flight, one sequence id each; every ``llama_decode`` carries one token per decoding sequence
plus prompt tokens of newly admitted ones (chunked to ``batch_tokens``), the way llama.cpp's
own server batches. The next token is the argmax of the logits (greedy); EOS does not stop a
request, ``max_tokens`` does, so the work matches the other systems'. A finished sequence's
cache cells are freed and its id goes to the next request. Only the generation loop is timed,
after a short warm-up decode.

This file imports nothing of boxcar: it runs with the venv's Python, where only llama-cpp-python
(and its numpy) are installed.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import llama_cpp as llama
import numpy as np


@dataclass
class Slot:
    request: int
    pending: list[int]  # prompt tokens not yet decoded
    position: int = 0  # next position of this sequence
    generated: list[int] = field(default_factory=list)


def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    pass


_LOG_CALLBACK = llama.llama_log_callback(_quiet_log)  # kept alive: llama.cpp holds the pointer


def generate(spec: dict) -> dict:
    prompts: list[list[int]] = spec["prompts"]
    max_tokens: list[int] = spec["max_tokens"]
    parallel = int(spec.get("parallel", 16))
    threads = int(spec.get("threads", 2))
    batch_tokens = int(spec.get("batch_tokens", 2048))
    if len(prompts) != len(max_tokens) or not prompts:
        raise ValueError("prompts and max_tokens must be non-empty lists of one length")

    llama.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
    llama.llama_backend_init()
    model_params = llama.llama_model_default_params()
    if not spec.get("extra_buffer_types", True):
        # ggml's extra CPU weight layouts (AMX, repacked quants); see bench/llamacpp.py.
        model_params.use_extra_bufts = False
    model = llama.llama_model_load_from_file(spec["model"].encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {spec['model']}")
    n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    per_sequence = -(-longest // 256) * 256
    params = llama.llama_context_default_params()
    params.n_ctx = parallel * per_sequence
    params.n_batch = batch_tokens
    params.n_seq_max = parallel
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = False  # per-sequence cells: these requests share no prefix
    ctx = llama.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    memory = llama.llama_get_memory(ctx)
    batch = llama.llama_batch_init(batch_tokens, 0, 1)

    def decode(rows: list[tuple[int, int, int, bool]]) -> None:
        """``rows``: (token, position, sequence id, wants logits)."""
        batch.n_tokens = len(rows)
        for i, (token, position, seq, logits) in enumerate(rows):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        status = llama.llama_decode(ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def argmax(row: int) -> int:
        logits = llama.llama_get_logits_ith(ctx, row)
        return int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())

    # Warm up (weights paged in, threads started), then leave the cache empty.
    warm = prompts[0][:8]
    decode([(t, i, 0, i == len(warm) - 1) for i, t in enumerate(warm)])
    argmax(len(warm) - 1)
    llama.llama_memory_seq_rm(memory, -1, -1, -1)

    outputs: list[list[int]] = [[] for _ in prompts]
    waiting = deque(range(len(prompts)))
    slots: dict[int, Slot] = {}  # sequence id -> slot
    free = deque(range(parallel))
    start = time.perf_counter()
    while waiting or slots:
        while waiting and free:
            i = waiting.popleft()
            slots[free.popleft()] = Slot(i, list(prompts[i]))
        rows: list[tuple[int, int, int, bool]] = []
        samplers: list[tuple[int, int]] = []  # (batch row, sequence id)
        for seq, slot in slots.items():  # decodes first: one token each
            if not slot.pending:
                samplers.append((len(rows), seq))
                rows.append((slot.generated[-1], slot.position, seq, True))
                slot.position += 1
        for seq, slot in slots.items():  # then prompt chunks, in the budget left
            room = batch_tokens - len(rows)
            if not slot.pending or room <= 0:
                continue
            chunk, slot.pending = slot.pending[:room], slot.pending[room:]
            for k, token in enumerate(chunk):
                last = not slot.pending and k == len(chunk) - 1
                if last:
                    samplers.append((len(rows), seq))
                rows.append((token, slot.position, seq, last))
                slot.position += 1
        decode(rows)
        for row, seq in samplers:
            slot = slots[seq]
            slot.generated.append(argmax(row))
            if len(slot.generated) >= max_tokens[slot.request]:
                outputs[slot.request] = slot.generated
                llama.llama_memory_seq_rm(memory, seq, -1, -1)
                del slots[seq]
                free.append(seq)
    seconds = time.perf_counter() - start
    llama.llama_batch_free(batch)
    llama.llama_free(ctx)
    llama.llama_model_free(model)
    return {"seconds": seconds, "outputs": outputs, "version": llama.__version__}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    print(json.dumps(generate(spec)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
