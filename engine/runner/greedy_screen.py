"""Exact greedy tokens without the full fp32 output projection (CPU, fp32 and bf16 models).

The output layer is the largest GEMM of a decode step (49152 x 576 for the default model: 16 ms
of a ~200 ms step at 64 rows). A greedy request only needs the argmax of its fp32 logits, so:

1. screen: all logits in bf16 on the CPU's bf16 units (AMX / AVX512-BF16), ~5x faster;
2. bound: each screened logit is within ``B[r, v] = c * |h_r| * |w_v| + |y~[r, v]| * u'`` of
   the fp32 one, where ``c`` covers rounding h and w to bf16 (2u + u^2, u = 2^-8) and fp32
   accumulation over K terms (2 * gamma_K: one for the screen, one for the fp32 product it
   stands in for), by Cauchy-Schwarz on sum |h_i w_i|; ``u'`` covers rounding the screened
   logit itself to bf16;
3. candidates: the tokens whose upper bound reaches the best lower bound of the row. The fp32
   argmax is always among them; on the default model they number 4 per row on average;
4. the candidates' logits are computed in fp32 and the largest wins (the lowest id on a tie,
   as ``argmax`` does).

Rows that need the full distribution (sampling, penalties, logprobs, masked tokens) keep the
full fp32 projection: ``Sampler.needs_full_logits`` says which.

A bf16 model's output layer works the same way: its weight and hidden rows are bf16 values, so
the screen rounds nothing, and the token is the argmax of the fp32 products of those values —
what the fp32 logits the sampler reads would pick, not the argmax of logits rounded to bf16 (at
a logit of 20, bf16's step is 0.125: ties and swaps that fp32 does not make).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cpu_fused_ops
from engine.layers.linear import onednn_linear

_U = 2.0**-8  # unit roundoff of bf16 (round to nearest even)
_SAFETY = 1.25


class GreedyScreen:
    """``argmax(hidden @ weight.T)`` per row, exactly, from a bf16 screen (module docstring)."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
            raise ValueError("the greedy screen is for CPU float32 or bfloat16 output layers")
        self.weight = weight  # [vocab, hidden], shared with the model
        hidden = weight.shape[1]
        gamma = hidden * 2.0**-24 / (1 - hidden * 2.0**-24)
        self.relative = _SAFETY * (2 * _U + _U * _U + 2 * gamma * (1 + _U) ** 2)
        self.output_rounding = _SAFETY * _U / (1 - _U)
        self.row_norms = weight.float().norm(dim=1)  # [vocab]
        weight_bf16 = weight.to(torch.bfloat16)
        self._packed = None
        try:  # oneDNN's prepacked layout: measured 3.3 ms against 5.7 ms unpacked at 64 rows
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight_bf16)
        except (AttributeError, RuntimeError):
            self._weight_bf16 = weight_bf16

    def _screen_bf16(self, hidden_bf16: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return onednn_linear(hidden_bf16, self._packed, None)
        return F.linear(hidden_bf16, self._weight_bf16)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] float32 (or bfloat16) -> [rows] int64 token ids."""
        hidden = hidden.float()
        rows = hidden.shape[0]
        if rows == 0:
            return torch.empty(0, dtype=torch.int64)
        hidden_bf16 = hidden.to(torch.bfloat16)
        approx = self._screen_bf16(hidden_bf16)  # [rows, vocab] bf16
        row_bounds = hidden.norm(dim=1) * self.relative  # [rows]
        if cpu_fused_ops.available(hidden_bf16):
            # One C++ pass pair over the bf16 screen instead of ten torch ops over an fp32 copy
            # (~7% of a bf16 step; bench.step_overhead's sample phase at 256 rows: fp32 models
            # the same). The candidates may differ from the torch ops' by rounding in the bound,
            # never the token: the fp32 argmax is among either, and wins there.
            candidates = cpu_fused_ops.screen_candidates
        else:
            candidates = cpu_fused_ops.screen_candidates_ref
        row_ids, token_ids = candidates(approx, row_bounds, self.row_norms, self.output_rounding)
        exact = (hidden[row_ids] * self.weight[token_ids].float()).sum(dim=1)
        best = torch.full((rows,), float("-inf")).scatter_reduce(
            0, row_ids, exact, reduce="amax")
        winners = torch.where(exact == best[row_ids], token_ids, self.weight.shape[0])
        return torch.full((rows,), self.weight.shape[0], dtype=torch.int64).scatter_reduce(
            0, row_ids, winners, reduce="amin")
