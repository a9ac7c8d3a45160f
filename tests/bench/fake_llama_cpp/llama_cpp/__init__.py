"""A stand-in for llama-cpp-python's low-level API, for testing bench/llamacpp_run.py without
building llama.cpp. Its "model" always predicts (previous token + 1) mod the vocabulary, and it
checks what a real KV cache would need: each sequence's positions run 0, 1, 2, ... from its
last reset, and no sequence id reaches ``n_seq_max``. Decoded batch sizes are written to the
file named by ``FAKE_LLAMA_LOG`` so the test can see the batching."""

from __future__ import annotations

import ctypes
import os
import signal
from types import SimpleNamespace

__version__ = "fake"
N_VOCAB = 1000

llama_log_callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def llama_log_set(callback, user_data) -> None:
    pass


def llama_backend_init() -> None:
    pass


def llama_model_default_params() -> SimpleNamespace:
    return SimpleNamespace()


def llama_model_load_from_file(path: bytes, params) -> SimpleNamespace | None:
    if os.environ.get("FAKE_LLAMA_CRASH_WITH_EXTRA_BUFTS") and getattr(
            params, "use_extra_bufts", True):
        os.kill(os.getpid(), signal.SIGSEGV)  # as llama.cpp's AMX path did on a Xeon
    return SimpleNamespace(path=path) if os.path.isfile(path) else None


def llama_model_get_vocab(model) -> str:
    return "vocab"


def llama_vocab_n_tokens(vocab) -> int:
    return N_VOCAB


def llama_context_default_params() -> SimpleNamespace:
    return SimpleNamespace(n_ctx=0, n_batch=0, n_seq_max=1, n_threads=0, n_threads_batch=0,
                           kv_unified=True)


class _Context:
    def __init__(self, params) -> None:
        self.params = params
        self.next_position: dict[int, int] = {}
        self.logits = (ctypes.c_float * N_VOCAB)()
        self.rows: list[int] = []  # predicted token per batch row
        self.log = os.environ.get("FAKE_LLAMA_LOG")


def llama_init_from_model(model, params) -> _Context:
    return _Context(params)


def llama_get_memory(ctx: _Context) -> _Context:
    return ctx


def llama_memory_seq_rm(memory: _Context, seq: int, p0: int, p1: int) -> bool:
    if seq < 0:
        memory.next_position.clear()
    else:
        memory.next_position.pop(seq, None)
    return True


def llama_batch_init(n_tokens: int, embd: int, n_seq_max: int) -> SimpleNamespace:
    return SimpleNamespace(n_tokens=0, token=[0] * n_tokens, pos=[0] * n_tokens,
                           n_seq_id=[0] * n_tokens, seq_id=[[0] for _ in range(n_tokens)],
                           logits=[False] * n_tokens)


def llama_decode(ctx: _Context, batch) -> int:
    if batch.n_tokens > ctx.params.n_batch:
        return -1
    for i in range(batch.n_tokens):
        seq = batch.seq_id[i][0]
        if not 0 <= seq < ctx.params.n_seq_max:
            raise AssertionError(f"sequence id {seq} out of range")
        expected = ctx.next_position.get(seq, 0)
        if batch.pos[i] != expected:
            raise AssertionError(f"sequence {seq} at position {batch.pos[i]}, expected {expected}")
        ctx.next_position[seq] = expected + 1
    ctx.rows = [(batch.token[i] + 1) % N_VOCAB for i in range(batch.n_tokens)]
    if ctx.log:
        with open(ctx.log, "a") as f:
            f.write(f"{batch.n_tokens}\n")
    return 0


def llama_get_logits_ith(ctx: _Context, row: int):
    ctypes.memset(ctx.logits, 0, ctypes.sizeof(ctx.logits))
    ctx.logits[ctx.rows[row]] = 1.0
    return ctypes.cast(ctx.logits, ctypes.POINTER(ctypes.c_float))


def llama_batch_free(batch) -> None:
    pass


def llama_free(ctx) -> None:
    pass


def llama_model_free(model) -> None:
    pass
