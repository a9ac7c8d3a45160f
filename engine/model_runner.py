"""ModelRunner: the only code that touches device tensors.

It owns the model weights and the paged KV cache, turns a SchedulerOutput into one flat batch
(input ids, positions, slot mapping, block tables), runs the forward pass and samples.
"""

from __future__ import annotations

import math
import mmap
import os
import time

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import CUDAGraphRunner
from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.layers.greedy_screen import GreedyScreen, bf16_is_native
from engine.layers.linear import (
    bf16_packing_available,
    mkl_packing_available,
    pack_linear_weights,
)
from engine.layers.lora import lora_batch, wrap_lora_linears
from engine.layers.torch_attention import TorchAttentionBackend
from engine.lora.manager import LoRAManager
from engine.models.causal_lm import CausalLM
from engine.models.no_init import no_init_weights
from engine.models.registry import get_model_class
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprob
from engine.request import Request
from engine.sampler import Sampler

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return torch.device(name)


def _zeroed_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zero-filled cache whose host memory is only committed where it is written.

    The attention paths read unwritten slots of a block (masked, then multiplied by 0), so the
    cache must hold zeros, not garbage that could be NaN. ``torch.zeros`` writes every byte up
    front: seconds and the whole budget in RSS for a cache a short run barely touches. On the CPU,
    an anonymous mapping is zero by definition and the kernel hands pages out at the first write;
    the block pool hands blocks out in id order, so the resident part grows with what the run uses.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps ``buffer`` alive; the mapping is released with the last view of it
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU; on a CPU, bf16 where it multiplies bf16 in hardware (AMX or
    AVX512-BF16, ``greedy_screen.bf16_is_native``) and oneDNN packs bf16 weights, fp32
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


class ModelRunner:
    def __init__(self, config: EngineConfig, checkpoint, max_position: int) -> None:
        self.max_position = max_position
        self.config = config
        self.block_size = config.block_size
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        hf_config = checkpoint.config
        model_cls: type[CausalLM] = get_model_class(hf_config)
        # No random init: load_weights fills every parameter (and raises if one is missing).
        with torch.device(self.device), no_init_weights():
            model = model_cls(hf_config, max_position)
        model.to(dtype=self.dtype)
        model.keep_fp32()  # the rotary tables stay fp32 whatever the weights are
        # Weights stored in the run's dtype are read straight into the parameters (no copy).
        model.load_weights(checkpoint.iter_weights(self.dtype, model.weight_destination()))
        self.model: CausalLM = model.eval()
        self.vocab_size = hf_config.vocab_size
        self.sampler = Sampler(self.vocab_size, config.seed)
        self.attn = self._make_attention_backend()
        self.packed_weights = False
        self.greedy_screen: GreedyScreen | None = None
        self.lora: LoRAManager | None = None
        if config.lora_modules:
            self._enable_lora(checkpoint)
        if self._native_cpu_path():
            self._pack_weights()
        self._allocate_kv_cache(hf_config)
        self.graphs: CUDAGraphRunner | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_cuda_graphs()

    def _enable_lora(self, checkpoint) -> None:
        """Wrap the projections in ``LoRALinear`` (before packing: packing finds the base
        linears inside) and read every registered adapter, so a bad one fails the start."""
        linears, targets = wrap_lora_linears(self.model)
        stacked = self.device.type == "cuda" or self.config.attention_backend == "triton"
        self.lora = LoRAManager(self.config, linears, targets, dtype=self.dtype,
                                device=self.device, base_names=base_model_names(
                                    self.config.model, checkpoint), stacked=stacked)

    def _capture_cuda_graphs(self) -> None:
        """Decode-only steps replay CUDA graphs captured at bucketed batch sizes."""
        from engine.cuda_graphs import bucket_sizes

        def forward(input_ids, positions, metadata):
            return self.model(input_ids, positions, self.kv_caches, self.attn, metadata)

        self.graphs = CUDAGraphRunner(
            forward,
            bucket_sizes(min(self.config.max_num_seqs, 256)),
            max_num_blocks=-(-self.max_position // self.block_size),
            device=self.device,
        )
        self.graphs.capture()

    def _native_cpu_path(self) -> bool:
        """CPU, fp32 or bf16, and the native kernels on (the ``torch`` backend keeps stock
        torch)."""
        return (
            self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
            and self.config.attention_backend in (None, "cpu")
            and not os.environ.get("BOXCAR_NO_CPU_KERNELS")
        )

    def _pack_weights(self) -> None:
        """Prepack the linear weights (``engine/layers/linear.py``: MKL for fp32, oneDNN for
        bf16 where the CPU has bf16 units) and screen greedy rows' output projection
        (``greedy_screen.py``): in fp32 where the CPU has bf16 units; in bf16 always, since
        the screen's token is the fp32 argmax and the plain bf16 projection's is not. The
        output layer keeps its weight when the embedding or the screen reads it."""
        head = self.model.lm_head.weight
        fp32 = self.dtype == torch.float32
        if not fp32 or bf16_is_native():
            self.greedy_screen = GreedyScreen(head.detach()[: self.vocab_size])
        can_pack = mkl_packing_available() if fp32 else bf16_packing_available()
        if not can_pack:
            return
        keep = self.model.tie_word_embeddings or self.greedy_screen is not None
        pack_linear_weights(self.model, shared={id(head)} if keep else set())
        self.packed_weights = True

    def _make_attention_backend(self) -> AttentionBackend:
        name = self.config.attention_backend
        if name is None:
            name = "triton" if self.device.type == "cuda" else "cpu"
        if name == "triton":
            from engine.layers.triton_attention import TritonAttentionBackend

            return TritonAttentionBackend()
        return TorchAttentionBackend(self.block_size, use_cpu_kernel=name == "cpu")

    def _allocate_kv_cache(self, hf_config) -> None:
        start = time.perf_counter()
        num_kv_heads, head_dim = self.model.num_kv_heads, self.model.head_dim
        num_layers = hf_config.num_hidden_layers
        per_block = 2 * num_layers * self.block_size * num_kv_heads * head_dim
        bytes_per_block = per_block * torch.empty((), dtype=self.dtype).element_size()
        num_blocks = self.config.num_kv_blocks
        if num_blocks is None:
            # What the budget buys, capped at what max_num_seqs full-length sequences can use.
            blocks_per_seq = -(-self.max_position // self.block_size)
            num_blocks = min(
                self.config.kv_cache_memory // bytes_per_block,
                self.config.max_num_seqs * blocks_per_seq,
            )
            if self.config.max_kv_blocks is not None:
                num_blocks = min(num_blocks, self.config.max_kv_blocks)
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory={self.config.kv_cache_memory} bytes holds {num_blocks} blocks "
                f"of {bytes_per_block} bytes; give it at least {2 * bytes_per_block}"
            )
        self.num_kv_blocks = int(num_blocks)
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        shape = (num_layers, 2, self.num_kv_blocks, self.block_size, num_kv_heads, head_dim)
        self.kv_cache = _zeroed_kv_cache(shape, self.dtype, self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(num_layers)]
        self.kv_cache_seconds = time.perf_counter() - start

    def _block_table(self, rows: list[list[int]]) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        table = torch.zeros(len(rows), max(width, 1), dtype=torch.int32)
        for i, row in enumerate(rows):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return table

    def prepare_inputs(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Request]]:
        """Flatten the step: decodes (one token each) first, then prefill chunks."""
        bs = self.block_size
        decodes, prefills = self._flat_order(scheduler_output, requests)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_indices: list[int] = []
        sample_requests: list[Request] = []

        decode_tables, decode_lens = [], []
        for s in decodes:
            request = requests[s.request_id]
            pos = s.num_computed_tokens
            input_ids.append(request.token_ids[pos])
            positions.append(pos)
            slots.append(request.block_ids[pos // bs] * bs + pos % bs)
            decode_tables.append(request.block_ids)
            decode_lens.append(pos + 1)
            if s.sample:
                sample_indices.append(len(input_ids) - 1)
                sample_requests.append(request)

        prefill_tables, prefill_lens, query_lens = [], [], []
        for s in prefills:
            request = requests[s.request_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = request.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            prefill_tables.append(blocks)
            prefill_lens.append(end)
            query_lens.append(s.num_new_tokens)
            if s.sample:
                sample_indices.append(len(input_ids) - 1)
                sample_requests.append(request)

        device = self.device
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decodes=len(decodes),
            decode_block_tables=self._block_table(decode_tables).to(device),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32, device=device),
            num_prefills=len(prefills),
            prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            prefill_block_tables=self._block_table(prefill_tables).to(device),
            prefill_context_lens=torch.tensor(prefill_lens, dtype=torch.int32, device=device),
            prefill_query_lens_list=query_lens,
            prefill_context_lens_list=prefill_lens,
            decode_context_lens_list=decode_lens,
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            metadata,
            sample_indices,
            sample_requests,
        )

    def _flat_order(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
                    ) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
        """The step's decodes and prefills in flat-batch order; with LoRA on, each ordered by
        adapter (base first), so an adapter's rows are contiguous (``layers/lora.py``)."""
        decodes = [s for s in scheduler_output.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduler_output.scheduled if s.num_new_tokens > 1]
        if self.lora is not None:
            def by_adapter(s: ScheduledRequest) -> tuple[bool, str]:
                name = requests[s.request_id].lora_name
                return name is not None, name or ""

            decodes.sort(key=by_adapter)
            prefills.sort(key=by_adapter)
        return decodes, prefills

    def _lora_batch(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]):
        if self.lora is None:
            return None
        decodes, prefills = self._flat_order(scheduler_output, requests)
        return self.lora.step_batch([(requests[s.request_id].lora_name, s.num_new_tokens)
                                     for s in (*decodes, *prefills)])

    @torch.inference_mode()
    def execute(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> ModelRunnerOutput:
        input_ids, positions, metadata, sample_indices, sample_requests = self.prepare_inputs(
            scheduler_output, requests
        )
        lora = self._lora_batch(scheduler_output, requests)
        # The graphs were captured base-only: a step with adapter rows runs eagerly.
        if self.graphs is not None and metadata.num_prefills == 0 and lora is None:
            hidden = self.graphs.run(
                input_ids, positions, metadata.decode_block_tables,
                metadata.decode_context_lens, metadata.slot_mapping,
            )
        else:
            self.attn.prepare(metadata)
            with lora_batch(lora):
                hidden = self.model(input_ids, positions, self.kv_caches, self.attn, metadata)
        if not sample_indices:
            return ModelRunnerOutput({})
        # Only the rows we sample from go through the (large) output projection; plain greedy
        # rows take the screened argmax instead where there is one.
        index = torch.tensor(sample_indices, dtype=torch.int64, device=self.device)
        hidden = hidden.index_select(0, index)
        tokens: list[int] = [0] * len(sample_requests)
        logprobs: dict[str, TokenLogprob] = {}
        screen = self.greedy_screen
        needs_full = [screen is None or Sampler.needs_full_logits(r) for r in sample_requests]
        full = [i for i, f in enumerate(needs_full) if f]
        screened = [i for i, f in enumerate(needs_full) if not f]
        if screen is not None and screened:
            rows = hidden if not full else hidden[screened]
            for i, token in zip(screened, screen.argmax(rows).tolist(), strict=True):
                tokens[i] = token
        if full:
            full_requests = [sample_requests[i] for i in full]
            rows = hidden if len(full) == len(sample_requests) else hidden[full]
            logits = self.model.compute_logits(rows)
            token_ids, row_logprobs = self.sampler(logits.float().cpu(), full_requests)
            for i, request, token, lp in zip(full, full_requests, token_ids, row_logprobs,
                                             strict=True):
                tokens[i] = token
                if lp is not None:
                    logprobs[request.request_id] = lp
        return ModelRunnerOutput(
            {r.request_id: t for r, t in zip(sample_requests, tokens, strict=True)}, logprobs
        )

    @torch.inference_mode()
    def score_tokens(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher forcing: ``[len(token_ids) - 1, vocab]`` fp32 log-probabilities of each next
        token of one sequence, from one prefill pass.

        The logits are the fp32 products of the final hidden rows and the output weight (the
        values the greedy screen takes its argmax of). K/V go to a scratch cache, so the
        engine's cache and its prefix cache are untouched and requests may be in flight.
        """
        num_tokens = len(token_ids)
        if num_tokens < 2:
            raise ValueError("token_ids needs at least 2 tokens to score")
        if num_tokens > self.max_position:
            raise ValueError(f"token_ids has {num_tokens} tokens; the model takes "
                             f"{self.max_position}")
        num_blocks = -(-num_tokens // self.block_size)
        k_cache, v_cache = self.kv_caches[0]
        scratch = torch.zeros((len(self.kv_caches), 2, num_blocks, *k_cache.shape[1:]),
                              dtype=k_cache.dtype, device=self.device)
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=device),
            num_decodes=0,
            decode_block_tables=self._block_table([]).to(device),
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
            num_prefills=1,
            prefill_query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32,
                                                 device=device),
            prefill_block_tables=self._block_table([list(range(num_blocks))]).to(device),
            prefill_context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
            prefill_query_lens_list=[num_tokens],
            prefill_context_lens_list=[num_tokens],
        )
        self.attn.prepare(metadata)
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.arange(num_tokens, device=device),
            [(scratch[i, 0], scratch[i, 1]) for i in range(len(self.kv_caches))],
            self.attn, metadata,
        )[:-1]
        if self.greedy_screen is not None:  # the output layer's weight may be packed away
            weight = self.greedy_screen.weight
        else:
            weight = self.model.lm_head.weight[: self.vocab_size]
            if self.packed_weights:
                return torch.log_softmax(
                    self.model.compute_logits(hidden)[:, : self.vocab_size].float(), dim=-1
                ).cpu()
        logits = hidden.float() @ weight.float().T  # [num_tokens - 1, vocab]
        return torch.log_softmax(logits, dim=-1).cpu()


def base_model_names(model: str, checkpoint) -> set[str]:
    """The names an adapter's ``base_model_name_or_path`` may give for this model: the setting,
    its last part, the checkpoint folder's name and the name its config was saved under."""
    names = {model, os.path.basename(model.rstrip("/"))}
    for path in (checkpoint.path, checkpoint.source):
        if path is not None:
            names |= {str(path), path.name, path.stem}
    saved = getattr(checkpoint.config, "_name_or_path", None) or ""
    if saved:
        names |= {saved, os.path.basename(saved.rstrip("/"))}
    return {n for n in names if n}
