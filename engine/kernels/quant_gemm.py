"""Linear products with weights kept in ggml's block-quantized formats, dequantized inside the
product: what a layer holds for a GGUF tensor kept quantized (``QuantWeight``), and its
reference (``linear_reference``).

A quantized weight is 3.5-7x smaller than its fp32 copy, and at decode a linear reads its whole
weight for a few rows of activations: reading fewer bytes is the speed-up, provided the weight is
never materialized whole. ``pack`` validates ggml's bytes and keeps them in the one form the
kernel here reads; ``linear_reference`` (dequantize, then an fp32 matmul) is what every kernel
is tested against.
"""

from __future__ import annotations

import torch

from engine.kernels.ggml_quants import dequantize, get_format, row_bytes


class QuantWeight:
    """A weight kept quantized: what a layer holds.

    ``fmt`` is a ``ggml_quants.FORMATS`` name; the weight is [out_features, in_features].
    """

    def __init__(self, fmt: str, data: torch.Tensor, out_features: int, in_features: int):
        self.fmt = fmt
        self.out_features = out_features
        self.in_features = in_features
        self._data = data  # uint8 [out, row_bytes]: ggml's rows

    @property
    def nbytes(self) -> int:
        """The bytes it keeps resident."""
        return self._data.nbytes

    @property
    def device(self) -> torch.device:
        return self._data.device

    def __repr__(self) -> str:
        return (f"QuantWeight({self.fmt}, out_features={self.out_features}, "
                f"in_features={self.in_features}, {self.nbytes} bytes)")

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ W.T (+ bias)`` -> [..., out] in ``x.dtype``."""
        return linear_reference(x, self, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight, [out, in] in ``dtype`` (for a reference, or the dequantize mode)."""
        return dequantize(self.fmt, self._data, self.in_features).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``dequantize(dtype)[ids]`` without dequantizing the rest: an embedding lookup (a tied
        embedding shares its head's QuantWeight). ``ids``: integer, any shape -> [*ids.shape,
        in]."""
        flat = ids.reshape(-1).to(device=self._data.device, dtype=torch.long)
        values = dequantize(self.fmt, self._data.index_select(0, flat), self.in_features)
        return values.to(dtype).reshape(*ids.shape, self.in_features)

    def raw(self) -> torch.Tensor:
        """uint8 [out, row_bytes]: ggml's own bytes, row-major (what the model cache stores)."""
        return self._data

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.fmt, self._data.to(device), self.out_features, self.in_features)


def pack(fmt: str, data: torch.Tensor, in_features: int) -> QuantWeight:
    """A ``QuantWeight`` of ggml's rows ``data`` (uint8 [out_features, row_bytes]).

    Raises ValueError on a format, dtype or byte count that does not fit.
    """
    spec = get_format(fmt)
    expected = row_bytes(fmt, in_features)
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise ValueError(f"{fmt} weight data must be a 2-D uint8 tensor [out_features, "
                         f"{expected}], got {data.dtype} {tuple(data.shape)}")
    if data.shape[1] != expected:
        raise ValueError(
            f"{fmt} expects {expected} bytes a row ({in_features // spec.block_size} blocks of "
            f"{spec.type_size} bytes for {in_features} values), got {data.shape[1]}")
    return QuantWeight(fmt, data.contiguous(), data.shape[0], in_features)


def linear_reference(x: torch.Tensor, w: QuantWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(x.float() @ w.dequantize(float32).T + bias).to(x.dtype)``: fp32 math, the kernels'
    reference."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {w.in_features}")
    out = x.float() @ w.dequantize(torch.float32).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def kernel_formats() -> frozenset[str]:
    """Formats with a C++ kernel loaded here (empty when the kernel library is not built)."""
    return frozenset()
