"""The device and dtype policy: where an engine runs and in which precision ("auto" included)."""

from __future__ import annotations

import torch

from engine.layers.linear import bf16_packing_available


def bf16_is_native() -> bool:
    """True where the CPU multiplies bf16 in hardware (AMX or AVX512-BF16); elsewhere bf16 is
    emulated, slower than fp32 (the greedy screen and "auto" both ask)."""
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)()
                or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU; on a CPU, bf16 where it multiplies bf16 in hardware (AMX or
    AVX512-BF16, ``bf16_is_native``) and oneDNN packs bf16 weights, fp32
    elsewhere. ``float32`` is the exact mode, token for token transformers' fp32 (the tests that
    compare with transformers pin it).

    Why, measured on an AMX Xeon (2 cores, shared with other jobs; the default model, 32
    requests of the benchmark workload, ``bench.offline``): bf16 runs 1.75x fp32's output
    tokens at 2 threads (143 against 251 out tok/s, taken while the machine was quiet) and 1.82x
    at 1 thread; the quality gate holds (``python -m bench.bf16_quality``: 98.8% top-1 agreement
    with fp32's greedy tokens, mean |delta logprob| 0.016). The bound is the weight bytes a
    decode step streams: half in bf16, except the output layer, which both screen in bf16. On a
    CPU without bf16 units bf16 is emulated, 0.44x fp32 (AVX2 EPYC), so ``auto`` is fp32 there.
    With the cores oversubscribed, 2-thread wall time swings (each OpenMP region waits about a
    time slice for a descheduled peer; bf16's regions are short, so it loses most, down to
    0.17x in one shared run); that is the machine, not the dtype, and at 1 thread bf16 leads."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if bf16_is_native() and bf16_packing_available() else torch.float32
    return _DTYPES[name]
