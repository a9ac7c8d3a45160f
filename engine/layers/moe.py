"""The mixture-of-experts block: a top-k router, experts computed grouped by expert, shared experts.

Routing as each family defines it (transformers' ``*TopKRouter`` modules):

- ``softmax_topk``: softmax over all experts in fp32, the top k of the probabilities, optionally
  renormalised to sum to one (Mixtral always; Qwen3-MoE and OLMoE when ``norm_topk_prob``).
- ``topk_softmax``: the top k of the logits (router bias included), then a softmax over those k
  (gpt-oss).

Ties go as ``torch.topk`` sends them, which is what transformers calls on the same values.

Expert compute (``FusedExperts``): the step's ``num_tokens * top_k`` (token, expert) pairs are
sorted by expert, so each expert's rows are contiguous; each expert's gate/up and down projections
run as one GEMM over its rows (``torch.nn.functional.grouped_mm`` where this torch has it for the
device and dtype, else one ``F.linear`` per expert that received rows: a loop over experts, never
over tokens); the rows are scaled by their routing weight, put back in (token, k) order and summed
over k. That is transformers' own ``grouped_mm`` experts path, so fp32 outputs agree with it. On
a GPU the Triton kernel (``engine/kernels/fused_moe.py``) does the same in two launches.

On a CPU the runner may ``pack()`` the experts for oneDNN (bf16 always, fp32 where oneDNN is the
CPU's fp32 GEMM: ``engine/layers/linear.py``): each expert's two weights in oneDNN's blocked
layout, one ``onednn_linear`` per expert with rows. ``grouped_mm`` hands every expert's weight to
a GEMM that repacks it on each call; on an AMD EPYC (1 thread, 16 experts of 512 x 1,024) the
packed loop took 6.6 ms against 17.7 ms at 8 rows an expert (decode) in fp32, and 14 ms against
100 ms at 128 rows in bf16.

The expert weights are stacked: ``w13`` ``[num_experts, 2 * intermediate, hidden]`` (the gate's
rows, then the up projection's) and ``w2`` ``[num_experts, hidden, intermediate]``, with optional
biases; models fill them from whatever layout their checkpoint stores.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import onednn_linear

Scoring = Literal["softmax_topk", "topk_softmax"]
Activation = Literal["silu", "swiglu_clamped"]


@dataclass(frozen=True)
class MoeConfig:
    """What a family's MoE block is; ``ValueError`` for values the block cannot run."""

    hidden_size: int
    intermediate_size: int  # per expert
    num_experts: int
    top_k: int
    scoring: Scoring = "softmax_topk"
    renormalize: bool = False  # softmax_topk only: the k weights rescaled to sum to 1
    router_bias: bool = False
    expert_bias: bool = False
    activation: Activation = "silu"
    swiglu_alpha: float = 1.702  # swiglu_clamped: gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # swiglu_clamped: gate <= limit, |up| <= limit
    # Mixtral keeps its routing weights in fp32; the others round them to the hidden dtype.
    fp32_weights: bool = False

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok (top-k) must be between 1 and num_experts "
                             f"({self.num_experts}), got {self.top_k}")
        if self.scoring not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"unknown router scoring {self.scoring!r}")
        if self.activation not in ("silu", "swiglu_clamped"):
            raise ValueError(f"unknown expert activation {self.activation!r}")


class TopKRouter(nn.Module):
    """``weight [num_experts, hidden]`` (+ ``bias``): each token's top-k experts and weights."""

    def __init__(self, config: MoeConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.empty(config.num_experts)) if config.router_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [num_tokens, hidden]`` -> ``(topk_weights [num_tokens, k], topk_ids [num_tokens,
        k] int64)``, in ``torch.topk``'s order (descending weight)."""
        c = self.config
        logits = F.linear(x, self.weight, self.bias)  # [num_tokens, num_experts]
        if c.scoring == "topk_softmax":
            top_logits, topk_ids = torch.topk(logits, c.top_k, dim=-1)
            return torch.softmax(top_logits, dim=-1), topk_ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = torch.topk(probs, c.top_k, dim=-1)
        if c.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        if not c.fp32_weights:
            topk_weights = topk_weights.to(logits.dtype)
        return topk_weights, topk_ids


def grouped_mm_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` runs ``x [rows, k] @ weight[e] [k, n]`` here: this torch has it,
    the dtype is one it takes on the device, and (CPU) rows and columns are 16-byte aligned."""
    if not hasattr(F, "grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    size = x.element_size()
    return all(dim * size % 16 == 0 for dim in (*x.shape[1:], *weight.shape[1:]))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   sorted_ids: torch.Tensor, counts: torch.Tensor,
                   packed: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``x[i] @ weight[e].T (+ bias[e])`` for rows grouped by expert: ``x [rows, in]`` sorted so
    expert e's ``counts[e]`` rows are contiguous, ``weight [num_experts, out, in]`` (or, where
    ``packed``, each expert's weight packed for oneDNN)."""
    w = weight.transpose(1, 2)  # [num_experts, in, out], a view
    if packed is not None:
        out = x.new_empty(x.shape[0], weight.shape[1])
        start = 0
        for expert, count in enumerate(counts.tolist()):  # one GEMM per expert with rows
            if count:
                out[start:start + count] = onednn_linear(x[start:start + count],
                                                         packed[expert], None)
                start += count
    elif grouped_mm_available(x, w):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        out = F.grouped_mm(x, w, offs=offsets)
    else:
        out = x.new_empty(x.shape[0], weight.shape[1])
        start = 0
        for expert, count in enumerate(counts.tolist()):  # one GEMM per expert with rows
            if count:
                torch.matmul(x[start:start + count], w[expert], out=out[start:start + count])
                start += count
    if bias is not None:
        out = out + bias[sorted_ids]
    return out


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gate: ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``;
    ``gate_up`` is ``[rows, 2 * intermediate]``, the gate's columns first."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


# The experts a block built inside ``held_experts`` holds: (first, count) of the router's
# num_experts (expert parallel: a rank holds a contiguous run of them, whole).
_HELD_EXPERTS: ContextVar[tuple[int, int] | None] = ContextVar("held_experts", default=None)


@contextmanager
def held_experts(start: int, count: int) -> Iterator[None]:
    """Build ``FusedExperts`` holding experts ``[start, start + count)`` only."""
    token = _HELD_EXPERTS.set((start, count))
    try:
        yield
    finally:
        _HELD_EXPERTS.reset(token)


class FusedExperts(nn.Module):
    """Every expert's gated MLP, stacked; computed grouped by expert (module docstring). Built
    inside ``held_experts``, it holds a run of the router's experts (``expert_start``,
    ``num_held``) and ``forward_held`` computes only the (token, expert) pairs routed to them."""

    def __init__(self, config: MoeConfig) -> None:
        super().__init__()
        self.config = config
        self.expert_start, self.num_held = _HELD_EXPERTS.get() or (0, config.num_experts)
        e, h, i = self.num_held, config.hidden_size, config.intermediate_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))  # gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * i)) if config.expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(e, h)) if config.expert_bias else None
        # Each expert's w13 and w2 packed for oneDNN, once ``pack()`` ran (CPU only).
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    @torch.no_grad()
    def pack(self) -> None:
        """Pack every expert's two weights for oneDNN (module docstring) and drop the stacked
        copies: ``w13``/``w2`` become zero-byte views of their shapes."""
        if self.w13.device.type != "cpu":
            raise ValueError(f"expert packing is for CPU weights, got {self.w13.device}")
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.packed = ([reorder(w.contiguous()) for w in self.w13.detach()],
                       [reorder(w.contiguous()) for w in self.w2.detach()])
        for name in ("w13", "w2"):
            weight = getattr(self, name)
            shape_only = torch.zeros((1, 1, 1), dtype=weight.dtype).expand(weight.shape)
            setattr(self, name, nn.Parameter(shape_only, requires_grad=False))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.activation == "swiglu_clamped":
            return swiglu_clamped(gate_up, c.swiglu_alpha, c.swiglu_limit)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, hidden]``, ``topk_* [num_tokens, k]`` -> ``[num_tokens, hidden]``."""
        if x.device.type == "cuda":
            from engine.kernels.fused_moe import fused_moe, fused_moe_supported

            if fused_moe_supported(x, self.w13, self.w2):
                return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids,
                                 self.w13_bias, self.w2_bias, self.activation)
        return experts_grouped(x, self.w13, self.w2, topk_weights, topk_ids, self.w13_bias,
                               self.w2_bias, self.activation, self.packed)

    def forward_held(self, x: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
        """``forward`` over the pairs whose expert this module holds (router ids), the other
        tokens' rows zero: a partial sum that the other ranks' experts complete."""
        local = topk_ids - self.expert_start
        held = (local >= 0) & (local < self.num_held)
        token_ids = held.nonzero()[:, 0]  # [num_pairs]: the token of each held pair
        if token_ids.numel() == 0:  # nothing routed here this step
            return torch.zeros_like(x)
        pairs = self(x.index_select(0, token_ids), topk_weights[held].unsqueeze(-1),
                     local[held].unsqueeze(-1))  # [num_pairs, hidden]
        return torch.zeros_like(x).index_add_(0, token_ids, pairs)


def experts_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                    activation,
                    packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
                    ) -> torch.Tensor:
    """The grouped torch path (module docstring); ``activation`` maps ``[rows, 2 * inter]``
    to ``[rows, inter]``; ``packed``: the experts' weights packed for oneDNN."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # [num_tokens * k], pair p is token p // k
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0])  # tokens per expert
    rows = x.index_select(0, order // top_k)  # [num_tokens * k, hidden], grouped by expert
    packed13, packed2 = packed if packed is not None else (None, None)
    hidden = activation(grouped_linear(rows, w13, w13_bias, sorted_ids, counts, packed13))
    # [num_tokens * k, hidden]
    out = grouped_linear(hidden, w2, w2_bias, sorted_ids, counts, packed2)
    out = out * topk_weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = torch.empty_like(out)
    unsorted[order] = out  # back to (token, k) order
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Router, experts, and (where a family has them) shared experts every token passes through,
    optionally scaled by a sigmoid gate (Qwen2-MoE's ``shared_expert_gate``)."""

    def __init__(self, config: MoeConfig, shared_expert: nn.Module | None = None,
                 shared_expert_gate: bool = False) -> None:
        super().__init__()
        self.config = config
        self.gate = TopKRouter(config)
        self.experts = FusedExperts(config)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (nn.Linear(config.hidden_size, 1, bias=False)
                                   if shared_expert is not None and shared_expert_gate else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        if self.experts.num_held == self.config.num_experts:
            out = self.experts(x, topk_weights, topk_ids)
        else:
            out = self.experts.forward_held(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def pack_experts(model: nn.Module) -> int:
    """Pack every ``FusedExperts`` of ``model`` for oneDNN; returns how many were packed."""
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    for module in experts:
        module.pack()
    return len(experts)
