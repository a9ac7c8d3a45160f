"""Linear layers whose weights can be prepacked for the CPU's GEMM: MKL or oneDNN for fp32 (by
CPU vendor, ``fp32_gemm``), oneDNN for bf16.

A plain ``F.linear`` on the CPU hands the weight to ``sgemm``, which repacks it into its own
panel layout on every call: at decode sizes (a few to a few dozen rows against a 576x3072
weight) the repacking costs as much as the multiply. ``torch.ops.mkl._mkl_linear`` takes the
weight packed once at load time (``cblas_sgemm_pack``), measured 1.2x faster at 64 rows and
1.6-1.8x at 4-16 rows on the default model's shapes, equal above 512 rows. The result is the
same sgemm arithmetic, so packing changes no bits at 2+ rows.

bf16 weights go to oneDNN's own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``),
which oneDNN offers only on CPUs with bf16 units (AVX512-BF16 or AMX): the output layer's screen
measured 3.3 ms packed against 5.7 ms unpacked at 64 rows (``greedy_screen.py``).

oneDNN compiles a primitive per (weight, row count) and keeps the last 1,024 in an LRU cache.
A continuous batch changes its row count nearly every step, so five weight shapes times hundreds
of row counts overflowed that cache and every call compiled again: 400 row counts x 4 shapes ran
at ~3 ms a call against ~0.27 ms with the primitives cached. bf16 rows are therefore padded to a
bucket (``row_bucket``: exact up to 16, then multiples of 16 to 256, of 64 beyond), which bounds
the primitives to ~60 a weight; the padded rows cost little next to streaming the weight.

fp32 goes to MKL on Intel CPUs and to oneDNN elsewhere (``fp32_gemm``): MKL takes its AVX-512
kernels only on Intel. On an AMD EPYC with AVX-512 (1 thread, quiet, ``python -m
bench.cpu_gemm`` over the default model's and MiniLM's shapes) MKL's packed sgemm ran 90-93
GFLOP/s at 2,048 rows against oneDNN's 208-217, and oneDNN led at every shape and row count from
4 to 2,048 (1.8-2.7x). oneDNN's fp32 rows are bucketed as bf16's are. Its
results differ from sgemm's in the last bits (another summation order), so the exact mode stays
token for token transformers' on the tested configs, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP32_GEMMS = ("mkl", "onednn")


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of ``dtype`` here (bf16: only where the CPU multiplies
    bf16 natively); ask it."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except (AttributeError, RuntimeError):
        return False
    return True


def cpu_vendor() -> str:
    """``GenuineIntel``, ``AuthenticAMD``, ... from /proc/cpuinfo ("" where it is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def fp32_gemm(choice: str | None = None) -> str | None:
    """The library that multiplies packed fp32 weights: ``choice`` when given (an error where
    it cannot pack here), else MKL on Intel and oneDNN elsewhere (module docstring); None when
    neither packs on this machine."""
    available = {"mkl": mkl_packing_available(),
                 "onednn": onednn_packing_available(torch.float32)}
    if choice is not None:
        if choice not in FP32_GEMMS:
            raise ValueError(f"cpu_gemm must be one of {FP32_GEMMS}, got {choice!r}")
        if not available[choice]:
            raise ValueError(f"cpu_gemm {choice!r}: this torch cannot pack fp32 weights for "
                             f"{choice} here; leave cpu_gemm unset to choose by CPU")
        return choice
    preferred = ("mkl", "onednn") if cpu_vendor() == "GenuineIntel" else ("onednn", "mkl")
    return next((name for name in preferred if available[name]), None)


def packing_gemm(dtype: torch.dtype, cpu_gemm: str | None = None) -> str | None:
    """The library a CPU model's ``dtype`` weights are packed for (``pack_linear_weights``'s
    ``gemm``): fp32 by ``fp32_gemm(cpu_gemm)``, bf16 oneDNN where it packs bf16; None where
    nothing packs them (the linears stay plain)."""
    if dtype == torch.float32:
        return fp32_gemm(cpu_gemm)
    if dtype == torch.bfloat16 and bf16_packing_available():
        return "onednn"
    return None


def bf16_packing_available() -> bool:
    """oneDNN packs bf16 weights only where the CPU multiplies bf16 natively; ask it."""
    return onednn_packing_available(torch.bfloat16)


def row_bucket(rows: int) -> int:
    """The row count a bf16 oneDNN call runs at: ``rows`` up to 16, then rounded up to a
    multiple of 16 up to 256 and of 64 beyond."""
    if rows <= 16:
        return rows
    step = 16 if rows <= 256 else 64
    return -(-rows // step) * step


# GELU's forms oneDNN applies inside the product (``Linear.forward_gelu``): torch's
# ``approximate`` values, which are oneDNN's algorithm names too.
GELU_ALGORITHMS = ("none", "tanh")


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  gelu: str | None = None) -> torch.Tensor:
    """``x [rows, in] @ W.T (+ bias)`` for a weight packed by ``_reorder_linear_weight`` (bf16
    or fp32), at the row count's bucket (module docstring); ``gelu`` (one of
    ``GELU_ALGORITHMS``): GELU applied to the fp32 sums inside the product."""
    rows = x.shape[0]
    padded = row_bucket(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    if gelu is None:
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    else:
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "gelu", [], gelu)
    return out[:rows] if padded != rows else out


class Linear(nn.Linear):
    """``nn.Linear`` that ``pack()`` switches to a prepacked weight: MKL or oneDNN for CPU
    fp32, oneDNN for CPU bf16."""

    packed_weight: torch.Tensor | None = None
    packed_by: str | None = None  # "mkl" or "onednn" once packed

    @torch.no_grad()
    def pack(self, *, keep_weight: bool = False, gemm: str = "mkl") -> None:
        """Pack the weight, fp32 for ``gemm`` (``FP32_GEMMS``; bf16 always goes to oneDNN).
        Unless ``keep_weight`` (another module shares it, like a tied embedding), the unpacked
        copy is dropped: ``weight`` becomes a zero-byte view of the right shape, which is all
        ``_mkl_linear`` reads of it (oneDNN reads none of it)."""
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"packing needs a CPU float32 or bfloat16 weight, got "
                             f"{weight.dtype} on {weight.device}")
        if gemm not in FP32_GEMMS:
            raise ValueError(f"gemm must be one of {FP32_GEMMS}, got {gemm!r}")
        if weight.dtype == torch.bfloat16:
            if not bf16_packing_available():
                raise ValueError("oneDNN packs bf16 weights only on a CPU with bf16 units")
            gemm = "onednn"
        if gemm == "onednn":
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        else:
            self.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 64)
        self.packed_by = gemm
        if not keep_weight:
            shape_only = torch.zeros((1, 1), dtype=weight.dtype).expand(weight.shape)
            self.weight = nn.Parameter(shape_only, requires_grad=False)

    def forward_gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """``F.gelu(self(x), approximate=approximate)``; for a bf16 weight packed by oneDNN,
        one call with GELU applied to the fp32 sums before they are rounded (a [2,048, 1,536]
        product 7.6 -> 6.2 ms, 2 threads, Zen 4). fp32 keeps the two steps."""
        if (self.packed_by == "onednn" and self.weight.dtype == torch.bfloat16
                and approximate in GELU_ALGORITHMS and x.numel()):
            return self._onednn(x, gelu=approximate)
        return F.gelu(self(x), approximate=approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows == 0:
            return x.new_empty((*x.shape[:-1], self.out_features))
        if self.packed_by == "onednn":
            return self._onednn(x)
        return torch.ops.mkl._mkl_linear(x, self.packed_weight, self.weight, self.bias, rows)

    def _onednn(self, x: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
        """``onednn_linear`` over x's rows (at least one), in x's leading shape."""
        assert self.packed_weight is not None
        rows = x.numel() // x.shape[-1]
        out = onednn_linear(x.reshape(rows, x.shape[-1]), self.packed_weight, self.bias, gelu)
        return out.view(*x.shape[:-1], self.out_features)


def pack_linear_weights(model: nn.Module, shared: set[int] | None = None, *,
                        gemm: str = "mkl") -> int:
    """Pack every ``Linear`` of ``model`` (fp32 for ``gemm``); weights whose ``id`` is in
    ``shared`` are kept. Returns how many were packed."""
    shared = shared or set()
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(keep_weight=id(module.weight) in shared, gemm=gemm)
            count += 1
    return count
