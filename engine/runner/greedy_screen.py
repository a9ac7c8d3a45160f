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

An output layer kept in GGUF's Q8_0 blocks (``Int8GreedyScreen``) screens with int8 products
instead (``quant_gemm.q8_0_screen``: AVX512-VNNI, or AMX tiles where the CPU has them): the
hidden rows are quantized to int8 by blocks of 32 like the weight, and the bound adds the
quantization error of x (below). Its token is the argmax of the fp32 products of the hidden
rows and the exact dequantized weight.
"""

from __future__ import annotations

import abc
import math

import torch
import torch.nn.functional as F

from engine.kernels import cpu_fused_ops
from engine.kernels.quant_gemm import QuantWeight, q8_0_screen, quant_linear
from engine.layers.linear import onednn_linear

_U = 2.0**-8  # unit roundoff of bf16 (round to nearest even)
_SAFETY = 1.25
# The bf16 screen's output is rounded once, to nearest: |y~ - bf16(y~)| <= u' |bf16(y~)|.
_OUTPUT_ROUNDING = _SAFETY * _U / (1 - _U)


def _gamma(n: int) -> float:
    """Higham's gamma_n: the relative error bound of n fp32 roundings, n u / (1 - n u)."""
    return n * 2.0**-24 / (1 - n * 2.0**-24)


class Screen(abc.ABC):
    """The shared steps of a greedy screen (module docstring): candidates from an approximate
    product and its bound, then their fp32 logits; subclasses say how they approximate."""

    output_rounding = _OUTPUT_ROUNDING

    def __init__(self, vocab_size: int, weight_norms: torch.Tensor) -> None:
        self.vocab_size = vocab_size
        self.row_norms = weight_norms  # [vocab] fp32: the weight rows' 2-norms

    @abc.abstractmethod
    def _screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 [rows, hidden] -> (approx bf16 [rows, vocab] (rows may be strided), row_bounds
        fp32 [rows]): |fp32 logit - approx| <= row_bounds[r] * row_norms[v] + |approx| u'."""

    @abc.abstractmethod
    def _weight_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ``token_ids``, fp32 [len(token_ids), hidden], exactly."""

    @abc.abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """All the fp32 logits, [rows, vocab]: the values ``argmax`` takes the argmax of."""

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] float32 (or bfloat16) -> [rows] int64 token ids."""
        hidden = hidden.float()
        rows = hidden.shape[0]
        if rows == 0:
            return torch.empty(0, dtype=torch.int64)
        approx, row_bounds = self._screen(hidden)
        if cpu_fused_ops.available(approx):
            # One C++ pass pair over the bf16 screen instead of ten torch ops over an fp32 copy
            # (~7% of a bf16 step; bench.step_overhead's sample phase at 256 rows: fp32 models
            # the same). The candidates may differ from the torch ops' by rounding in the bound,
            # never the token: the fp32 argmax is among either, and wins there.
            candidates = cpu_fused_ops.screen_candidates
        else:
            candidates = cpu_fused_ops.screen_candidates_ref
        row_ids, token_ids = candidates(approx, row_bounds, self.row_norms, self.output_rounding)
        exact = (hidden[row_ids] * self._weight_rows(token_ids)).sum(dim=1)
        best = torch.full((rows,), float("-inf")).scatter_reduce(
            0, row_ids, exact, reduce="amax")
        winners = torch.where(exact == best[row_ids], token_ids, self.vocab_size)
        return torch.full((rows,), self.vocab_size, dtype=torch.int64).scatter_reduce(
            0, row_ids, winners, reduce="amin")


class GreedyScreen(Screen):
    """``argmax(hidden @ weight.T)`` per row, exactly, from a bf16 screen (module docstring)."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
            raise ValueError("the greedy screen is for CPU float32 or bfloat16 output layers")
        super().__init__(weight.shape[0], weight.float().norm(dim=1))
        self.weight = weight  # [vocab, hidden], shared with the model
        gamma = _gamma(weight.shape[1])
        self.relative = _SAFETY * (2 * _U + _U * _U + 2 * gamma * (1 + _U) ** 2)
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

    def _screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        approx = self._screen_bf16(hidden.to(torch.bfloat16))  # [rows, vocab] bf16
        return approx, hidden.norm(dim=1) * self.relative

    def _weight_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[token_ids].float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float() @ self.weight.float().T


# Rows of the weight dequantized at a time for its norms: 16,384 x 640 fp32 is 42 MB, where the
# whole Gemma 3 head would be 671 MB.
_NORM_CHUNK_ROWS = 16384
_Q8_BLOCK = 32  # values a Q8_0 block holds (one fp16 scale each)
_INT8_MAX = 127  # x's int8 values are symmetric, +-127, as ggml's Q8_0 quantizes


class Int8GreedyScreen(Screen):
    """``argmax(hidden @ W.T)`` per row, exactly, for a head kept as one Q8_0 ``QuantWeight`` in
    the kernel's tiles, from an int8 screen (``quant_gemm.q8_0_screen``: needs
    ``int8_screen_available()``).

    Each hidden row x is quantized by blocks b of 32: d_x[b] = max|x_b| / 127, q_x = round(x /
    d_x) (0 in a zero block), so x = x^ + e with x^ = q_x d_x. The screen computes, in fp32,
    y~ = sum_b fl(d_w[b] d_x[b]) * S_b, S_b = sum_i q_w q_x exact in int32; with the exact
    weight w (Q8_0's d_w q_w is exact in fp32) and y the fp32 logit the candidates get:

      |y - y~| <= |x.w - x^.w| + |x^.w - y~| + |y - x.w|
               <= ||e|| ||w|| + gamma_{nb+2} ||x^|| ||w|| + gamma_K ||x|| ||w||

    by Cauchy-Schwarz on each term: e.w; the screen's nb + 2 roundings (d_w d_x, then the fused
    multiply-add of each block's term into the sum, bounded as nb + 1 plus one to spare) of
    sum_b |d_w d_x S_b| <= sum_k |x^_k w_k|; the fp32 sum of K products of the candidates'
    logits. With ||x^|| <= ||x|| + ||e||: row_bounds = safety * (||e|| + gamma_{nb+2} (||x|| +
    ||e||) + gamma_K ||x||) (the norms in float64), times ``row_norms`` (the exact rows'
    norms, rounded up), plus the bf16 rounding of y~ (``output_rounding``). The token is the
    argmax of the fp32 products of the hidden rows with the exact dequantized weight (as the
    dequantize mode's fp32 model gives; a bf16 model's kept head multiplies by the weight
    rounded to bf16 instead, so a near tie may go the other way there).
    """

    def __init__(self, weight: QuantWeight, vocab_size: int) -> None:
        if weight.fmt != "Q8_0" or not weight.kernel or weight.device.type != "cpu":
            raise ValueError(f"the int8 screen takes a CPU Q8_0 weight in the kernel's tiles, "
                             f"got {weight!r}")
        if not 0 < vocab_size <= weight.out_features:
            raise ValueError(f"vocab_size must be in [1, {weight.out_features}], got "
                             f"{vocab_size}")
        super().__init__(vocab_size, _row_norms_rounded_up(weight, vocab_size))
        self.weight = weight
        blocks = weight.in_features // _Q8_BLOCK
        self._quant_gamma = _gamma(blocks + 2)
        self._sum_gamma = _gamma(weight.in_features)

    def _screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xq, scales, error_norms = quantize_rows(hidden)
        approx = q8_0_screen(self.weight, xq, scales)[:, : self.vocab_size]  # [rows, vocab]
        x_norms = hidden.double().norm(dim=1)
        bounds = (error_norms + self._quant_gamma * (x_norms + error_norms)
                  + self._sum_gamma * x_norms)
        return approx, (_SAFETY * bounds).float()

    def _weight_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(token_ids, torch.float32)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # fp32 x: the fp32 panel, the exact weight (a bf16 x would take the bf16 panel)
        out = quant_linear(hidden.float(), self.weight, out_dtype=torch.float32)
        return out[:, : self.vocab_size]


def quantize_rows(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [rows, K] -> (q_x int8 [rows, K], d_x fp32 [rows, K / 32], ||x - q_x d_x|| float64
    [rows]): each block of 32 scaled to +-127 (``Int8GreedyScreen``); a zero block is d_x = 0,
    q_x = 0."""
    rows, depth = hidden.shape
    blocks = hidden.view(rows, depth // _Q8_BLOCK, _Q8_BLOCK)
    scales = blocks.abs().amax(dim=2) / _INT8_MAX  # [rows, K / 32]
    inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    q = (blocks * inverse[..., None]).round().clamp_(-_INT8_MAX, _INT8_MAX)
    # float64 holds x - q d_x exactly (q: 8 bits, d_x and x: 24-bit fp32 mantissas)
    error = blocks.double() - q.double() * scales.double()[..., None]
    return (q.to(torch.int8).view(rows, depth), scales,
            error.reshape(rows, depth).norm(dim=1))


def _row_norms_rounded_up(weight: QuantWeight, vocab_size: int) -> torch.Tensor:
    """The first ``vocab_size`` rows' 2-norms (fp32 [vocab_size], each rounded up), from the
    exact dequantized rows, ``_NORM_CHUNK_ROWS`` at a time."""
    norms = torch.empty(vocab_size, dtype=torch.float64)
    for start in range(0, vocab_size, _NORM_CHUNK_ROWS):
        ids = torch.arange(start, min(start + _NORM_CHUNK_ROWS, vocab_size))
        norms[start: start + len(ids)] = weight.rows(ids, torch.float64).norm(dim=1)
    return torch.nextafter(norms.float(), torch.tensor(math.inf))
