"""An engine's start-up: the checkpoint, the tokenizer and the model runner built (an embedding
model's through its bf16 quality gate, ``engine.pooling.dtype_gate``), and where the seconds went
(``startup_seconds``: bench/startup.py prints it, a worker logs it)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from engine.checkpoint.hf_quant import choose_mode, dense_reason
from engine.checkpoint.loader import Checkpoint, load_checkpoint
from engine.checkpoint.tokenizer import tokenize
from engine.config import EngineConfig
from engine.kernels import cpu_decode_attention
from engine.kernels.quant_gemm import kernel_formats
from engine.models.moe_decoder import MoeForCausalLM
from engine.models.registry import get_model_class
from engine.pooling.dtype_gate import gate_embedding_dtype
from engine.pooling.inputs import EmbeddingSpec
from engine.pooling.runner import PoolingModelRunner
from engine.runner.base import Runner
from engine.runner.device import resolve_device, resolve_dtype
from engine.runner.model_runner import ModelRunner
from engine.runner.quality import EmbeddingAgreement

if TYPE_CHECKING:  # transformers is imported on the tokenizer's thread (see ``start``)
    from transformers import PreTrainedTokenizerBase

    from engine.distributed.runner import TPModelRunner

T = TypeVar("T")


@dataclass
class Started:
    """What ``start`` built for an ``LLMEngine``."""

    model_name: str
    hf_config: Any  # the checkpoint's transformers config
    tokenizer: PreTrainedTokenizerBase
    model_runner: Runner
    model_len: int  # the model's context, capped by the config's (not yet by the KV cache)
    startup_seconds: dict[str, float]
    eos_token_ids: tuple[int, ...]  # every id that ends a sequence
    # An embedding model's limits (``EngineConfig.task``, ``is_embedding_model``); None: the
    # engine generates.
    embedding: EmbeddingSpec | None
    dtype_gate: EmbeddingAgreement | None  # the bf16 gate's report, where it ran


def start(config: EngineConfig) -> Started:
    """Load the checkpoint, then build the model runner while the tokenizer loads beside it."""
    start_at = time.perf_counter()
    # a GGUF model is converted once to a cached folder; later starts read that instead
    checkpoint = load_checkpoint(config.model, config.tokenizer, convert_gguf=True)
    loaded = time.perf_counter()
    # The tokenizer (with the transformers import it needs) loads on a thread while this one
    # builds the model: reading and packing the weights is C code that releases the GIL, so
    # on two or more cores the two overlap (the start-up pays the longer, not the sum).
    with ThreadPoolExecutor(1, thread_name_prefix="boxcar-tokenizer") as pool:
        tokenizer_future = pool.submit(timed, checkpoint.load_tokenizer)
        try:
            model_runner, model_len, kernel_seconds, runner_seconds = _build_runner(
                config, checkpoint)
        except BaseException:
            tokenizer_future.cancel()
            raise
        tokenizer, tokenizer_seconds = tokenizer_future.result()
    kv_seconds = model_runner.kv_cache_seconds
    # The tokenizer ran beside the model, so the parts add up to more than the total.
    startup_seconds = {
        "checkpoint": loaded - start_at,
        "tokenizer": tokenizer_seconds,
        "model": runner_seconds - kv_seconds - kernel_seconds,  # build, weights, packing
        "kv_cache": kv_seconds,
        "kernel": kernel_seconds,
        "total": time.perf_counter() - start_at,
    }
    eos = eos_token_ids(checkpoint.config, tokenizer, checkpoint.generation_eos_token_ids())
    model_name = _model_name(config.model, checkpoint)
    embedding = dtype_gate = None
    if isinstance(model_runner, PoolingModelRunner):
        if config.tensor_parallel_size == 1:  # (its fp32 reference would be the whole model)
            model_runner, dtype_gate = gate_embedding_dtype(
                config, checkpoint, model_runner, partial(tokenize, tokenizer), model_len)
        embedding = EmbeddingSpec(
            model_name, model_runner.max_len, model_runner.vocab_size, model_runner.hidden_size,
            model_runner.pooler.matryoshka_dimensions, model_runner.pooler.normalize,
            config.truncate_embedding_inputs, model_runner.cross_encoder)
    return Started(model_name, checkpoint.config, tokenizer, model_runner, model_len,
                   startup_seconds, eos, embedding, dtype_gate)


def _build_runner(
    config: EngineConfig, checkpoint: Checkpoint,
) -> tuple[ModelRunner | PoolingModelRunner | TPModelRunner, int, float, float]:
    """Build the model runner (weights, KV cache, kernel): a PoolingModelRunner (no KV cache)
    for an embedding model, else a ModelRunner; returns it, the model's context length, the
    seconds spent loading the kernel and the seconds of the whole build."""
    start_at = time.perf_counter()
    hf_config = checkpoint.config
    model_len = int(getattr(hf_config, "max_position_embeddings", 2048))
    if config.max_model_len is not None:
        if config.max_model_len > model_len:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's {model_len}"
            )
        model_len = config.max_model_len
    kernel_seconds = cpu_decode_attention.load_seconds
    embedding = is_embedding_model(config, checkpoint)
    config = replace(config, quantization=resolve_quantization(config, checkpoint, embedding))
    model_runner: ModelRunner | PoolingModelRunner | TPModelRunner
    if embedding:
        if config.tensor_parallel_size > 1:  # a decoder embedder over several devices
            from engine.distributed.pooling_runner import TPPoolingRunner

            model_runner = TPPoolingRunner.start_driver(config, checkpoint, model_len)
        else:
            model_runner = PoolingModelRunner(config, checkpoint, model_len)
        model_len = model_runner.max_len
    elif config.tensor_parallel_size > 1:  # this process drives; helper ranks hold the rest
        from engine.distributed.runner import TPModelRunner

        model_runner = TPModelRunner.start_driver(config, checkpoint, model_len)
    else:
        model_runner = ModelRunner(config, checkpoint, max_position=model_len)
    kernel_seconds = cpu_decode_attention.load_seconds - kernel_seconds
    return model_runner, model_len, kernel_seconds, time.perf_counter() - start_at


def resolve_quantization(config: EngineConfig, checkpoint: Checkpoint,
                         embedding: bool = False) -> str:
    """"keep" or "dequantize" for the checkpoint's quantized weights (a GGUF's, or an AWQ /
    GPTQ / FP8 folder's: ``hf_quant.choose_mode``). ``config.quantization`` None keeps them
    where nothing stands in the way (``cannot_keep``) and says on one line which it does and
    why; "keep" where something does is a ValueError naming it and the way out, before any
    weight is read."""
    if config.quantization == "dequantize":
        return "dequantize"
    hf = checkpoint.hf_quantization
    if hf is not None:  # AWQ / GPTQ / FP8: their kernels are Triton's, on CUDA
        return choose_mode(hf, config.quantization, resolve_device(config.device).type,
                           dense_only=_loads_dense(config, checkpoint, embedding))
    types = checkpoint.quantized_types()
    if not types:
        return "dequantize"  # nothing to keep
    reason = cannot_keep(config, types, embedding)
    if config.quantization == "keep":
        if reason is not None:
            raise ValueError(f"quantization='keep': {reason}; use quantization='dequantize' "
                             "(or leave it unset: the engine dequantizes where it cannot keep)")
        return "keep"
    if reason is not None:
        print(f"[boxcar] dequantizing: {reason}", file=sys.stderr, flush=True)
        return "dequantize"
    print(f"[boxcar] keeping the weights quantized ({', '.join(_describe(types))}; every type "
          "has a kernel here)", file=sys.stderr, flush=True)
    return "keep"


def cannot_keep(config: EngineConfig, types: dict[str, list[str]],
                embedding: bool = False) -> str | None:
    """Why the quantized weights of ``types`` (block type -> tensor names) cannot stay
    quantized in this engine, or None: each type needs a kernel on the engine's device
    (``quant_gemm.kernel_formats``: the C++ kernels on a CPU, the Triton kernel on CUDA), and
    the tensor-parallel and embedding paths load dense weights. Left to choose
    (``quantization`` unset), a CUDA engine dequantizes still: its Triton kernel has run only
    under Triton's interpreter (``GPU_UNMEASURED``)."""
    if config.tensor_parallel_size > 1:
        return (f"tensor parallelism (tensor_parallel_size={config.tensor_parallel_size}) "
                "loads dense weights")
    if embedding:
        return "an embedding model loads dense weights"
    device = resolve_device(config.device)
    if device.type not in ("cpu", "cuda"):
        return (f"the GGUF block kernels run on a CPU or CUDA, and this engine runs on "
                f"{device.type} (device='cpu' keeps them)")
    formats = kernel_formats(device.type)
    missing = {fmt: names for fmt, names in types.items() if fmt not in formats}
    if missing:
        return "no kernel for " + "; ".join(_describe(missing))
    if device.type == "cuda" and config.quantization is None:
        return GPU_UNMEASURED
    return None


# Why "keep" is not chosen for a CUDA engine unasked: no GPU has run the Triton kernel yet.
GPU_UNMEASURED = ("the Triton GGUF kernel has been tested under Triton's interpreter but not yet "
                  "run or timed on a GPU (quantization='keep' uses it)")


def weight_summary(config: EngineConfig, checkpoint: Checkpoint) -> str:
    """What the checkpoint's weights will take in memory in an engine started with ``config``
    (``boxcar model pull`` prints it): kept quantized or dequantized as start-up will decide,
    in the run's dtype, and the other way's figure beside it."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    types = checkpoint.quantized_types()
    hf = checkpoint.hf_quantization
    dense = checkpoint.weight_bytes(dtype, quantized=False)
    if not types and hf is None:
        return f"weights in memory: {_mib(dense)} ({dtype_name})"
    kept = checkpoint.weight_bytes(dtype, quantized=True)
    embedding = is_embedding_model(config, checkpoint)
    if hf is not None:  # AWQ / GPTQ / FP8
        label = hf.describe()
        reason = dense_reason(hf, device.type, _loads_dense(config, checkpoint, embedding))
    else:
        label = ", ".join(sorted(types))
        reason = cannot_keep(config, types, embedding)
    if config.quantization == "dequantize" or reason is not None:
        why = "quantization='dequantize'" if reason is None else reason
        return (f"weights in memory: {_mib(dense)}, dequantized to {dtype_name} ({why}; kept "
                f"quantized they would take {_mib(kept)})")
    return (f"weights in memory: {_mib(kept)}, kept quantized ({label}; "
            f"dequantized to {dtype_name} they would take {_mib(dense)})")


def _loads_dense(config: EngineConfig, checkpoint: Checkpoint, embedding: bool) -> str | None:
    """Why this engine loads an AWQ / GPTQ / FP8 checkpoint's weights dense whatever the
    device (``hf_quant.choose_mode``), or None."""
    if config.tensor_parallel_size > 1:
        return (f"tensor parallelism (tensor_parallel_size={config.tensor_parallel_size}) "
                "loads dense weights")
    if embedding:
        return "an embedding model loads dense weights"
    if issubclass(get_model_class(checkpoint.config), MoeForCausalLM):
        return "a mixture of experts loads its experts dense"
    return None


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def _describe(types: dict[str, list[str]]) -> list[str]:
    """``Q3_K (12 tensors, e.g. blk.0.ffn_down.weight)`` a type, most tensors first."""
    ordered = sorted(types.items(), key=lambda item: -len(item[1]))
    return [f"{fmt} ({len(names)} tensor{'s' if len(names) > 1 else ''}, e.g. {names[0]})"
            for fmt, names in ordered]


def timed(function: Callable[[], T]) -> tuple[T, float]:
    start_at = time.perf_counter()
    return function(), time.perf_counter() - start_at


def eos_token_ids(hf_config: Any, tokenizer: PreTrainedTokenizerBase,
                  generation: list[int]) -> tuple[int, ...]:
    """Every id that ends a sequence: the model config's (one or several), the tokenizer's and
    ``generation_config.json``'s (``Checkpoint.generation_eos_token_ids``)."""
    ids: list[int] = []
    for source in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id, generation):
        if isinstance(source, int):
            ids.append(source)
        elif isinstance(source, list | tuple):
            ids.extend(int(x) for x in source)
    return tuple(dict.fromkeys(ids))


def is_embedding_model(config: EngineConfig, checkpoint: Checkpoint) -> bool:
    """Whether the engine pools (``EngineConfig.task``; "auto": an embedding architecture, or a
    sentence-transformers folder with a Pooling module)."""
    if config.task != "auto":
        return config.task == "embed"
    from engine.models.pooling_registry import is_embedding_architecture

    architectures = list(getattr(checkpoint.config, "architectures", None) or [])
    if architectures and is_embedding_architecture(architectures[0]):
        return True
    modules = checkpoint.path / "modules.json" if checkpoint.path.is_dir() else None
    return modules is not None and modules.is_file() and ".Pooling" in modules.read_text()


def _model_name(model: str, checkpoint: Checkpoint) -> str:
    path = checkpoint.source or checkpoint.path
    return path.stem if path.suffix == ".gguf" else path.name or model
