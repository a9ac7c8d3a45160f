"""EngineConfig: every knob of the engine in one frozen, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("keep", "dequantize")
TASKS = ("auto", "generate", "embed")
POOLING_TYPES = ("cls", "mean", "last")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. ``model`` is a folder, a .gguf file or a name in the local model cache.

    The KV cache is sized by ``num_kv_blocks`` when given, else by ``kv_cache_memory`` bytes,
    but never larger than ``max_num_seqs`` full-length sequences need, nor than ``max_kv_blocks``
    (what a known set of requests needs: ``boxcar run`` sets it from its file).
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 4 << 30
    max_kv_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    seed: int = 0
    num_threads: int | None = None
    attention_backend: str | None = None
    # The library that multiplies fp32 weights on a CPU ("mkl" or "onednn"); None: by CPU
    # vendor (engine/layers/linear.py: MKL on Intel, oneDNN elsewhere).
    cpu_gemm: str | None = None
    enforce_eager: bool = False
    # Ranks one model is split over (tensor parallel, docs/tensor-parallel.md): this process
    # drives, and starts tensor_parallel_size - 1 helper processes, one per further device.
    tensor_parallel_size: int = 1
    # A mixture of experts' experts spread whole over the tensor_parallel_size ranks (vLLM's
    # --enable-expert-parallel) instead of each expert split across them (docs/moe.md).
    expert_parallel: bool = False
    # While an unfinished request is more urgent than others, the less urgent requests' tokens
    # (the running ones' decodes and prompt chunks in queue order, then admissions) share at
    # most this many per step; the rest skip the step, keeping their blocks. Keeps the urgent
    # request's steps short on a device whose step time grows with its tokens (a CPU: a step of
    # 128 decodes took 3.5x one of 16). None: no cap (a GPU's decode step barely grows with its
    # rows). No effect while every priority is equal.
    urgent_bulk_tokens: int | None = 64
    # LoRA adapters (docs/lora.md): NAME=PATH pairs, PATH a local PEFT folder. Empty: no LoRA
    # (the model's linears stay plain). ``max_loras``: distinct adapters in one step (a request
    # whose adapter would be one more waits); ``max_lora_rank``: the largest rank accepted;
    # ``max_cpu_loras``: adapters kept loaded, least recently used dropped (None: max_loras).
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    # Embeddings (docs/embeddings.md). ``task``: "auto" embeds with an embedding architecture
    # (BertModel, Qwen3Model, ...) or a sentence-transformers folder that pools, generates
    # otherwise; "embed" makes a decoder checkpoint an embedder (last-token pooling).
    task: str = "auto"
    # Override the pooling and normalization the model's sentence-transformers files declare.
    pooling: str | None = None
    normalize: bool | None = None
    # An input longer than the model's limit is cut to it (keeping a tokenizer's closing
    # special token) instead of failing its request, as OpenAI does.
    truncate_embedding_inputs: bool = False
    # A GGUF's quantized weights (docs/quantization.md): "keep" them in their ggml blocks,
    # multiplied by the C++ kernels (a model in about its file's memory); "dequantize" them at
    # load to the run's dtype. None: keep them where every quantized type has a kernel here and
    # the model runs on the CPU on one device, else dequantize, saying why.
    quantization: str | None = None
    # Overlapped ("async") scheduling (vLLM v1's async scheduling, SGLang's overlap scheduler):
    # while step N runs on the device, the host schedules step N+1 and finishes step N-1's
    # outputs; a decode's input token is read from step N's sampled tokens on the device.
    # Outputs are token for token those of the synchronous loop (greedy and seeded sampling,
    # penalties, min_tokens, grammars: their state advances where the tokens are drawn).
    # None: on for CUDA, off on a CPU (measured there with
    # ``python -m bench.step_overhead --async``). Not with tensor_parallel_size > 1.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a folder, a .gguf file or a cached model")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.max_kv_blocks is not None and self.max_kv_blocks < 2:
            raise ValueError(f"max_kv_blocks must be >= 2, got {self.max_kv_blocks}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.urgent_bulk_tokens is not None and self.urgent_bulk_tokens < 1:
            raise ValueError(
                f"urgent_bulk_tokens must be >= 1 (or None: no cap), "
                f"got {self.urgent_bulk_tokens}"
            )
        self._check_lora()
        if isinstance(self.tensor_parallel_size, bool) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}"
            )
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("expert_parallel spreads the experts over tensor_parallel_size "
                             "ranks: set tensor_parallel_size > 1, or leave expert_parallel "
                             "off")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling is not implemented with tensor_parallel_size > "
                             "1 (the helper ranks run each step in lockstep): leave it unset "
                             "or false")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {self.pooling!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} (or None: keep "
                             f"where kernels exist), got {self.quantization!r}")
        if self.cpu_gemm not in (None, "mkl", "onednn"):
            raise ValueError(f"cpu_gemm must be 'mkl' or 'onednn', got {self.cpu_gemm!r}")
        if self.attention_backend not in (None, "cpu", "torch", "triton"):
            raise ValueError(
                "attention_backend must be 'cpu', 'torch' or 'triton', "
                f"got {self.attention_backend!r}"
            )

    def _check_lora(self) -> None:
        if isinstance(self.lora_modules, str):
            raise ValueError("lora_modules must be a list of NAME=PATH entries, not one string")
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras}): a step's adapters must all be loaded")
        names = [parse_lora_module(m)[0] for m in self.lora_modules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"lora_modules names {duplicates} more than once")

    def overlaps_steps(self, device_type: str) -> bool:
        """Whether the engine on a ``device_type`` device schedules step N+1 while step N runs
        (``async_scheduling``, None resolved by device)."""
        if self.tensor_parallel_size > 1:
            return False
        if self.async_scheduling is None:
            return device_type == "cuda"
        return self.async_scheduling

    @property
    def lora_paths(self) -> dict[str, str]:
        """``lora_modules`` as name -> path, in the order given."""
        return dict(parse_lora_module(m) for m in self.lora_modules)


def parse_lora_module(text: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (name, path); ValueError naming the entry when it is not that."""
    name, sep, path = text.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise ValueError(f"lora_modules entry {text!r} must be NAME=PATH")
    return name, path
