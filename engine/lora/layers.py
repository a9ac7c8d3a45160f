"""LoRA on the shared linears: each token's adapter delta, computed for the whole flat batch.

``LoRALinear`` wraps one of a decoder layer's projections (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``). A packed projection has one output *slice* per Hugging Face
module (q/k/v, gate/up), and an adapter may target any subset of them, each with its own rank.

A step's rows are ordered by adapter within its decodes and within its prefills
(``ModelRunner.prepare_inputs``), so the rows of one adapter form at most two contiguous
*segments*. The delta is the Punica / S-LoRA segmented GEMM: for each segment, shrink
``y = x[rows] @ A.T`` (one GEMM over the adapter's slices, their A stacked along the rank) and
expand ``out[rows, slice] += scaling * y[:, slice ranks] @ B.T`` per slice. Rows of the base
model are in no segment and pay nothing; a step without adapter rows runs no LoRA code at all.

Two paths, chosen by the manager: on the CPU a short segment (a decode's rows, under
``KERNEL_MAX_ROWS``) runs in the C++ kernel ``csrc/lora_segments.cpp``, which streams each
adapter's weights once from its own blocked copy, for all of a linear's short segments in one
call; a long one is one ``matmul`` + ``addmm_`` per slice on the adapter's own (unpadded)
tensors (on oneDNN's packed copies where oneDNN multiplies the base weights,
``ONEDNN_MIN_ROWS``). In bf16 on a CPU with bf16 dot products (``kernel.lora_bf16_pairs``)
every segment, a prompt chunk's too, runs in the kernel: on the tile units where it has AMX
(``csrc/lora_segments_amx.cpp``), else on AVX512-BF16's pair instruction; on the GPU
the adapters resident in the step sit in per-layer slot stacks padded to ``max_lora_rank`` and
two Triton kernels
(``kernels/lora_shrink.py``, ``kernels/lora_expand.py``) cover every segment in one launch each.

The step's ``LoRABatch`` travels in a scoped context (``lora_batch``), set around the forward
pass by the runner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from engine.layers.attention import SelfAttention
from engine.layers.linear import Linear, onednn_linear
from engine.layers.mlp import GatedMLP
from engine.layers.quantized import QuantizedLinear


@dataclass
class LoRAPiece:
    """One adapter's delta on some output columns of one linear: ``scaling * y_r @ B.T``."""

    col_offset: int
    col_size: int
    rank_offset: int  # where its rank columns start in the module's shrink output
    rank: int
    scaling: float
    lora_b: torch.Tensor  # [col_size, rank]
    # Which of the linear's slices it covers (a whole-module adapter on a packed linear,
    # Phi-3's qkv_proj, covers them all).
    slice_ids: tuple[int, ...] = ()


@dataclass
class ModuleLoRA:
    """One adapter on one linear: its A matrices stacked along the rank, and its pieces."""

    lora_a: torch.Tensor  # [sum of the pieces' ranks, in_features]
    pieces: list[LoRAPiece]
    # A, and each piece's B with its scaling folded in, packed for oneDNN (``onednn_weights``)
    _onednn: tuple[torch.Tensor, list[torch.Tensor]] | None = None
    # A and the pieces' B in the C++ kernel's blocked layouts (``kernel_args``), and whether
    # they are in bf16 pairs
    _kernel: tuple[bool, tuple[torch.Tensor, list[torch.Tensor], list[int]]] | None = None

    def kernel_args(self, kernel: ModuleType) -> tuple[torch.Tensor, list[torch.Tensor],
                                                       list[int]]:
        """(At, the pieces' scaled Bt, [col_offset, col_size, rank_offset, rank] a piece): what
        ``csrc/lora_segments.cpp`` takes for a segment under this adapter, laid out on first
        use so that its loops read each weight once, in order: At [R/16, in, 16] is A.T in
        blocks of 16 ranks, each piece's Bt [cols/16, rank, 16] (scaling * B).T in blocks of
        16 columns (both zero-padded to 16). The scaling is folded into B, as for oneDNN's
        copies: the kernel's inner loop is then one broadcast and FMAs. bf16 weights for a
        build with AVX512-BF16 (``kernel.lora_bf16_pairs``) come in pairs of depth,
        [blocks, ceil(depth / 2), 16, 2], for its dot-product instruction."""
        pairs = self.lora_a.dtype == torch.bfloat16 and bool(kernel.lora_bf16_pairs)
        if self._kernel is None or self._kernel[0] != pairs:
            meta = [v for p in self.pieces
                    for v in (p.col_offset, p.col_size, p.rank_offset, p.rank)]
            self._kernel = (pairs, (_lane_blocks(self.lora_a, pairs),
                                    [_lane_blocks(p.lora_b * p.scaling, pairs)
                                     for p in self.pieces], meta))
        return self._kernel[1]

    def onednn_weights(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A and the pieces' scaled B, packed for oneDNN on first use (the CPU path's long
        segments where oneDNN multiplies the base weights)."""
        if self._onednn is None:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            self._onednn = (reorder(self.lora_a),
                            [reorder((p.lora_b * p.scaling).contiguous()) for p in self.pieces])
        return self._onednn


def _lane_blocks(w: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """[n, depth] -> [ceil(n / 16), depth, 16]: w.T cut into blocks of 16 of its n rows, rows
    past n zero; with ``pairs``, [ceil(n / 16), ceil(depth / 2), 16, 2]: each lane's depth in
    pairs (an odd depth's last pair ends in a zero)."""
    n, depth = w.shape
    padded_depth = depth + depth % 2 if pairs else depth
    padded = torch.zeros(-(-n // KERNEL_LANES) * KERNEL_LANES, padded_depth, dtype=w.dtype)
    padded[:n, :depth] = w
    if pairs:  # [blocks, 16, depth/2, 2] -> [blocks, depth/2, 16, 2]
        return padded.view(-1, KERNEL_LANES, padded_depth // 2, 2).transpose(1, 2).contiguous()
    return padded.view(-1, KERNEL_LANES, depth).transpose(1, 2).contiguous()


def onednn_delta(x: torch.Tensor, out: torch.Tensor, rows: slice, module: ModuleLoRA) -> None:
    """``out[rows]`` += the adapter's delta on ``x[rows]``, on oneDNN's packed A and scaled B
    (a long segment where oneDNN multiplies the base weights)."""
    packed_a, packed_b = module.onednn_weights()
    shrunk = onednn_linear(x[rows], packed_a, None)  # [segment rows, ranks]
    for piece, b in zip(module.pieces, packed_b, strict=True):
        ranks = shrunk[:, piece.rank_offset: piece.rank_offset + piece.rank]
        out[rows, piece.col_offset: piece.col_offset + piece.col_size] += (
            onednn_linear(ranks.contiguous(), b, None))


@dataclass
class LoRASegment:
    """Contiguous rows of the flat batch under one adapter."""

    start: int
    end: int
    adapter: str
    # The adapter's per-linear weights, indexed by ``LoRALinear.index`` (CPU path).
    modules: list[ModuleLoRA | None]
    slot: int = 0  # its slot in the stacks (GPU path)


@dataclass
class LoRABatch:
    """A step's LoRA rows. ``stacked``: run the Triton kernels over the slot stacks."""

    segments: list[LoRASegment]  # empty in a captured graph's (``LoRAManager.graph_batch``):
    # its segments are a table on the device, written before each replay
    stacked: bool = False
    # [3, num_segments] int32 on the device (stacked path only): the segments' start, length
    # and slot rows
    seg_table: torch.Tensor | None = None
    max_seg_len: int = 0
    num_rows: int = 0  # rows under an adapter
    # The CPU kernels' module when its segment loop runs the short segments (CPU path; None:
    # the torch ops in Python, as where no compiler built the kernels)
    kernel: ModuleType | None = None


# The C++ kernel's (``csrc/lora_segments.cpp``) block width, and the longest segment it takes:
# past that the weights are read from cache by more rows than a register block holds, and the
# BLAS libraries' cache-blocked GEMMs win (their packing is paid once over many rows). Not in
# bf16 with bf16 dot products: on AMX tiles the kernel took a prompt's LoRA from 0.79 s to
# 0.35 s against oneDNN's (``bench.lora``'s 64 x 64 prompt tokens over 8 adapters, 1 thread),
# and AVX512-BF16's pair path is 1.9-2.2x oneDNN at 256 rows an adapter (Zen 5, 1-2 threads).
KERNEL_LANES = 16
KERNEL_MAX_ROWS = 32

# A segment of at least this many rows runs its LoRA GEMMs on oneDNN's packed A and B where
# oneDNN multiplies the base weights: on an AMD EPYC (1 thread, 576 -> 108 ranks -> 960) the two
# libraries were even at 8 rows and oneDNN 1.6-2.3x faster from 64 rows up (MKL leaves its
# AVX-512 kernels to Intel); shorter segments stay on ``matmul``/``addmm_``.
ONEDNN_MIN_ROWS = 32

_CURRENT: ContextVar[LoRABatch | None] = ContextVar("boxcar_lora_batch", default=None)


@contextlib.contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    """The step's LoRA rows for the forward pass inside this block (None: base only)."""
    token = _CURRENT.set(batch)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class LoRALinear(nn.Module):
    """A projection plus the step's per-segment adapter deltas (module docstring)."""

    def __init__(self, base: Linear | QuantizedLinear, index: int, slice_names: tuple[str, ...],
                 slice_sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.base = base
        self.index = index
        self.slice_names = slice_names
        self.slice_sizes = slice_sizes
        self.slice_offsets = tuple(sum(slice_sizes[:i]) for i in range(len(slice_sizes)))
        self.in_features = base.in_features
        self.out_features = base.out_features
        # Slot stacks (GPU path), made by ``allocate_stacks``:
        # a_stack [max_loras, num_slices * max_rank, in]; b_stacks[s] [max_loras, size_s, max_rank]
        self.a_stack: torch.Tensor | None = None
        self.b_stacks: list[torch.Tensor] = []

    def allocate_stacks(self, max_loras: int, max_rank: int, dtype: torch.dtype,
                        device: torch.device) -> None:
        num_slices = len(self.slice_sizes)
        self.a_stack = torch.zeros(max_loras, num_slices * max_rank, self.in_features,
                                   dtype=dtype, device=device)
        self.b_stacks = [torch.zeros(max_loras, size, max_rank, dtype=dtype, device=device)
                         for size in self.slice_sizes]

    @torch.no_grad()
    def write_slot(self, slot: int, module: ModuleLoRA | None) -> None:
        """Copy one adapter's weights into slot ``slot`` of the stacks, zero-padded to the
        stacks' rank, scaling folded into B (a whole-module piece is split per slice)."""
        assert self.a_stack is not None
        max_rank = self.b_stacks[0].shape[-1]
        self.a_stack[slot].zero_()
        for b in self.b_stacks:
            b[slot].zero_()
        if module is None:
            return
        for piece in module.pieces:
            a = module.lora_a[piece.rank_offset: piece.rank_offset + piece.rank]
            for s in piece.slice_ids:
                self.a_stack[slot, s * max_rank: s * max_rank + piece.rank].copy_(a)
                rows = slice(self.slice_offsets[s] - piece.col_offset,
                             self.slice_offsets[s] - piece.col_offset + self.slice_sizes[s])
                self.b_stacks[s][slot, :, : piece.rank].copy_(piece.lora_b[rows] * piece.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = _CURRENT.get()
        if batch is None:  # a base-only step runs no LoRA code
            return out
        if batch.stacked:
            self._stacked_delta(x, out, batch)
        else:
            self._segmented_delta(x, out, batch)
        return out

    def _segmented_delta(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
        index = self.index
        onednn = self.base.packed_by == "onednn"  # oneDNN multiplies the base weight
        kernel = batch.kernel if x.stride(1) == 1 and out.stride(1) == 1 else None
        # with bf16 dot products (AMX tiles, or AVX512-BF16 pairs) the kernel beats the
        # libraries at a prompt chunk's length too
        max_rows = (None if kernel is not None and x.dtype == torch.bfloat16
                    and kernel.lora_bf16_pairs else KERNEL_MAX_ROWS)
        short = []  # the kernel's segments
        for segment in batch.segments:
            module = segment.modules[index]
            if module is None:
                continue
            rows = slice(segment.start, segment.end)
            num_rows = segment.end - segment.start
            if kernel is not None and (max_rows is None or num_rows < max_rows):
                short.append((segment.start, segment.end, *module.kernel_args(kernel)))
                continue
            if onednn and num_rows >= ONEDNN_MIN_ROWS:
                onednn_delta(x, out, rows, module)
                continue
            shrunk = x[rows] @ module.lora_a.T  # [segment rows, sum of ranks]
            for piece in module.pieces:
                cols = out[rows, piece.col_offset: piece.col_offset + piece.col_size]
                cols.addmm_(shrunk[:, piece.rank_offset: piece.rank_offset + piece.rank],
                            piece.lora_b.T, alpha=piece.scaling)
        if short:
            assert kernel is not None
            kernel.lora_segments(x, out, short)

    def _stacked_delta(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
        from engine.kernels.lora_expand import lora_expand
        from engine.kernels.lora_shrink import lora_shrink

        assert self.a_stack is not None
        assert batch.seg_table is not None
        seg_start, seg_len, seg_slot = batch.seg_table.unbind(0)
        max_rank = self.b_stacks[0].shape[-1]
        # [num_tokens, num_slices * max_rank] fp32; rows outside the segments are never read
        shrunk = lora_shrink(x, self.a_stack, seg_start, seg_len, seg_slot, batch.max_seg_len)
        for s, b in enumerate(self.b_stacks):
            cols = out[:, self.slice_offsets[s]: self.slice_offsets[s] + self.slice_sizes[s]]
            lora_expand(shrunk[:, s * max_rank: (s + 1) * max_rank], b, cols,
                        seg_start, seg_len, seg_slot, batch.max_seg_len)


@dataclass(frozen=True)
class LoRATarget:
    """Where a Hugging Face module's LoRA goes: a wrapped linear and its slice (None: all)."""

    linear: LoRALinear
    slice_id: int | None


def wrap_lora_linears(model: nn.Module) -> tuple[list[LoRALinear], dict[str, LoRATarget]]:
    """Wrap every decoder layer's projections in ``LoRALinear``; returns them in index order
    and the map from each Hugging Face module path an adapter may name (``model.layers.0.
    self_attn.q_proj``, and the packed ``qkv_proj`` / ``gate_up_proj`` for fused checkpoints)
    to its target."""
    linears: list[LoRALinear] = []
    targets: dict[str, LoRATarget] = {}

    def wrap(parent: nn.Module, prefix: str, attr: str, names: tuple[str, ...],
             sizes: tuple[int, ...]) -> None:
        base = getattr(parent, attr)
        assert isinstance(base, Linear | QuantizedLinear)  # (a GGUF's weights kept quantized)
        linear = LoRALinear(base, len(linears), names, sizes)
        setattr(parent, attr, linear)
        linears.append(linear)
        targets[f"{prefix}.{attr}"] = LoRATarget(linear, None)
        if len(names) > 1:
            for i, name in enumerate(names):
                targets[f"{prefix}.{name}"] = LoRATarget(linear, i)

    for name, module in list(model.named_modules()):
        if isinstance(module, SelfAttention):
            wrap(module, name, "qkv_proj", ("q_proj", "k_proj", "v_proj"),
                 (module.q_size, module.kv_size, module.kv_size))
            wrap(module, name, "o_proj", ("o_proj",), (module.o_proj.out_features,))
        elif isinstance(module, GatedMLP):
            size = module.intermediate_size
            wrap(module, name, "gate_up_proj", ("gate_proj", "up_proj"), (size, size))
            wrap(module, name, "down_proj", ("down_proj",), (module.down_proj.out_features,))
    return linears, targets
