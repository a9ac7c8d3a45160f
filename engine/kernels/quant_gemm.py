"""Linear products with weights kept in ggml's block-quantized formats, dequantized inside the
product: what a layer holds for a GGUF tensor kept quantized (``QuantWeight``), its C++ kernel
(``csrc/quant_gemm.cpp``, in the CPU kernels' one library) and its reference
(``linear_reference``).

A quantized weight is 3.5-7x smaller than its fp32 copy, and at decode a linear reads its whole
weight for a few rows of activations: reading fewer bytes is the speed-up, provided the weight is
never materialized whole. ``pack`` validates ggml's bytes and keeps one copy, in the form the
kernel here reads: where the library is loaded and has the format, tiles of 8 output rows with
their blocks interleaved (within 1.03x of ggml's bytes; ``raw()`` gives ggml's rows back, bit
for bit), else ggml's own rows, multiplied by ``triton_ggml_gemm`` on CUDA and by
``linear_reference`` elsewhere. The kernel runs a fused
unpack-and-FMA pass for up to 4 activation rows (memory-bound decode) and, above that,
dequantizes 16 rows x 256 values at a time into an L1 panel for a register-blocked FMA kernel
(the C++ file's header has the layout, the paths and why the values equal gguf's). On a CPU
with AVX512-BF16 a bf16 ``x`` above 4 rows takes a bf16 panel instead (``bf16_panel()``): the
dequantized values rounded to bf16, as the dequantize mode's bf16 weights are, multiplied by
``vdpbf16ps`` at twice the fp32 FMA's multiply-adds an instruction, or, where the CPU has AMX
(``amx_available()``), by ``tdpbf16ps`` on its tiles: the same products, the panel's
dequantization then the step's cost.

Measured on this repo's AVX2 EPYC, one thread, CPU time (the machine is shared), against
oneDNN's packed fp32 weight of the same values (``bench.quant_gemm`` prints the 2-thread
figures): Q4_1 576 -> 3072 (SmolLM2's gate/up) at 1 row 0.17 ms against 0.55 with 30 layers'
weights coming from memory (3.3x for 6.4x fewer bytes: unpacking ~10 G values/s, not memory,
bounds it there), at 4 rows 0.33 against 0.77; at 64 rows 68 against 58 GFLOP/s, at 1,024
rows 72 against 70; Q6_K 2048 -> 640 at 256 rows 72 against 68.

``linear_reference`` (dequantize, then an fp32 matmul) is what every kernel is tested against.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from engine.kernels import cpu_decode_attention
from engine.kernels.ggml_quants import FORMATS, dequantize, get_format, row_bytes

# The kernel's paths (quant_linear's ``path``); ``amx`` only for a bf16 x where amx_available().
PATHS = ("auto", "fused", "panel", "amx", "generic")


class QuantWeight:
    """A weight kept quantized: what a layer holds.

    ``fmt`` is a ``ggml_quants.FORMATS`` name; the weight is [out_features, in_features]. Made
    by ``pack``; ``kernel`` says whether ``linear`` runs the C++ kernel (the bytes are its tiles)
    or the reference (the bytes are ggml's rows).
    """

    def __init__(self, fmt: str, data: torch.Tensor, out_features: int, in_features: int, *,
                 kernel: bool = False):
        self.fmt = fmt
        self.out_features = out_features
        self.in_features = in_features
        self.kernel = kernel
        # kernel: uint8 [ceil(out / 8), tile bytes] (the kernel's tiles); else ggml's rows,
        # uint8 [out, row_bytes]
        self._data = data

    @property
    def nbytes(self) -> int:
        """The bytes it keeps resident."""
        return self._data.nbytes

    @property
    def device(self) -> torch.device:
        return self._data.device

    def __repr__(self) -> str:
        return (f"QuantWeight({self.fmt}, out_features={self.out_features}, "
                f"in_features={self.in_features}, {self.nbytes} bytes, "
                f"{'kernel' if self.kernel else 'reference'})")

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, *,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [..., in] @ W.T (+ bias)`` -> [..., out] in ``out_dtype`` (None: ``x.dtype``;
        fp32 gives the fp32 sums unrounded): the C++ kernel for a CPU fp32 or bf16 ``x`` where
        the weight is in its tiles, the Triton kernel (``triton_ggml_gemm``) for a weight on
        CUDA, else ``linear_reference``."""
        if self.kernel and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            return quant_linear(x, self, bias, out_dtype=out_dtype)
        if self._data.device.type == "cuda":
            from engine.kernels.triton_ggml_gemm import ggml_linear  # Triton: imported on CUDA

            out = ggml_linear(x, self.fmt, self._data, self.in_features, self.out_features, bias)
            return out if out_dtype is None else out.to(out_dtype)
        return linear_reference(x, self, bias, out_dtype=out_dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight, [out, in] in ``dtype`` (for a reference, or the dequantize mode)."""
        return dequantize(self.fmt, self.raw(), self.in_features).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``dequantize(dtype)[ids]`` without dequantizing the rest: an embedding lookup (a tied
        embedding shares its head's QuantWeight). ``ids``: integer, any shape -> [*ids.shape,
        in]."""
        flat = ids.reshape(-1).to(device=self._data.device, dtype=torch.long)
        if self.kernel:
            if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < self.out_features):
                raise IndexError(f"row ids must be in [0, {self.out_features}), got "
                                 f"{int(flat.min())}..{int(flat.max())}")
            raw = _library().quant_unpack_rows(self.fmt, self._data, self.in_features,
                                               flat.contiguous())
        else:
            raw = self._data.index_select(0, flat)
        values = dequantize(self.fmt, raw, self.in_features)
        return values.to(dtype).reshape(*ids.shape, self.in_features)

    def raw(self) -> torch.Tensor:
        """uint8 [out, row_bytes]: ggml's own bytes, row-major (what the model cache stores); a
        new tensor when the weight is in the kernel's tiles."""
        if not self.kernel:
            return self._data
        ids = torch.arange(self.out_features)
        return _library().quant_unpack_rows(self.fmt, self._data, self.in_features, ids)

    def to(self, device: torch.device | str) -> QuantWeight:
        """This weight on ``device``: itself where it is already there; else ggml's rows moved,
        and packed again (in tiles where the kernel runs there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        return pack(self.fmt, self.raw().to(device), self.in_features)


def pack(fmt: str, data: torch.Tensor, in_features: int) -> QuantWeight:
    """A ``QuantWeight`` of ggml's rows ``data`` (uint8 [out_features, row_bytes]): repacked into
    the kernel's tiles where the kernel runs here (a CPU tensor of a format in
    ``kernel_formats()``; ``data`` is then not kept), else ``data`` itself.

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
    out_features = data.shape[0]
    if data.device.type == "cpu" and fmt in kernel_formats() and out_features:
        tiles = _library().quant_repack(fmt, data.contiguous(), in_features)
        return QuantWeight(fmt, tiles, out_features, in_features, kernel=True)
    return QuantWeight(fmt, data.contiguous(), out_features, in_features)


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, *,
                 path: str = "auto", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The C++ kernel: ``x [..., in]`` (CPU fp32 or bf16) ``@ W.T (+ bias)`` -> [..., out] in
    ``out_dtype`` (fp32 or bf16; None: ``x.dtype``), for a weight packed in the kernel's tiles.
    ``path`` (``PATHS``): ``auto`` picks by row count (and a bf16 x's panel on AMX tiles where
    ``amx_available()``); the others force one, for tests and benchmarks (``panel``: the AVX-512
    or AVX2 panel; ``amx``: the bf16 panel on AMX tiles; ``generic``: the plain C++ loops that
    CPUs without AVX2 run)."""
    if not w.kernel:
        raise ValueError(f"{w!r} is not in the kernel's tiles (pack it where the kernel runs)")
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be a CPU float32 or bfloat16 tensor, got {x.dtype} on "
                         f"{x.device}")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {w.in_features}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path == "amx" and (x.dtype != torch.bfloat16 or not amx_available()):
        raise ValueError("path='amx' takes a bfloat16 x on a CPU with AMX tiles "
                         f"(x is {x.dtype}; AMX here: {amx_available()})")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    rows = x.numel() // w.in_features
    out = torch.empty((rows, w.out_features), dtype=out_dtype)
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    _library().quant_linear(w.fmt, w._data, w.in_features, w.out_features,
                            x.reshape(rows, w.in_features).contiguous(), bias, out, path)
    return out.view(*x.shape[:-1], w.out_features)


def linear_reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, *,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(x.float() @ w.dequantize(float32).T + bias).to(out_dtype or x.dtype)``: fp32 math,
    the kernels' reference."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {w.in_features}")
    out = x.float() @ w.dequantize(torch.float32).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype if out_dtype is None else out_dtype)


def kernel_formats(device_type: str = "cpu") -> frozenset[str]:
    """Formats with a kernel on ``device_type`` here: on the CPU the C++ library's (empty when
    it could not be built: ``cpu_decode_attention.load()`` returns None), on CUDA the Triton
    kernel's (``triton_ggml_gemm``: every format, where Triton imports), none elsewhere."""
    if device_type == "cuda":
        return frozenset(FORMATS) if importlib.util.find_spec("triton") else frozenset()
    if device_type != "cpu":
        return frozenset()
    module = cpu_decode_attention.load()
    return frozenset() if module is None else frozenset(module.quant_formats)


def kernel_isa() -> str | None:
    """The instruction set the loaded kernel runs (``avx512_bf16``: AVX2 paths and the bf16
    panel; ``avx2``; or ``generic``); None without it."""
    module = cpu_decode_attention.load()
    return None if module is None else str(module.quant_isa)


# Row counts up to this take the fused path under ``path="auto"`` (kFusedMaxRows in the C++).
FUSED_MAX_ROWS = 4


def amx_available() -> bool:
    """Whether a bf16 x's panel path runs on AMX tiles here (``path="amx"``, and ``auto``'s
    choice above ``FUSED_MAX_ROWS`` rows): the library was built with AMX and this process may
    use the tiles."""
    module = cpu_decode_attention.load()
    return module is not None and bool(module.quant_amx_available())


def bf16_panel(dtype: torch.dtype, rows: int, path: str = "auto") -> bool:
    """Whether ``quant_linear`` of ``rows`` rows of ``dtype`` multiplies the weight rounded to
    bf16 (the bf16 panel, on a CPU with AVX512-BF16, or on its AMX tiles), rather than its exact
    fp32 values."""
    panel = path in ("panel", "amx") or (path == "auto" and rows > FUSED_MAX_ROWS)
    return dtype == torch.bfloat16 and panel and kernel_isa() == "avx512_bf16"


def int8_screen_available() -> bool:
    """Whether ``q8_0_screen`` runs here: the library was built with AVX512-VNNI and VBMI (no
    other path: where they are absent the int8 screen is not used)."""
    module = cpu_decode_attention.load()
    return module is not None and bool(module.quant_int8_screen)


def amx_int8_screen_available() -> bool:
    """Whether ``q8_0_screen`` can run on AMX tiles here (``tdpbssd``; ``path="amx"``, and
    ``auto``'s choice where it can)."""
    module = cpu_decode_attention.load()
    return module is not None and bool(module.quant_amx_int8_available())


SCREEN_PATHS = ("auto", "vnni", "amx")  # q8_0_screen's kernels


def q8_0_screen(w: QuantWeight, xq: torch.Tensor, scales: torch.Tensor, *,
                path: str = "auto") -> torch.Tensor:
    """The int8 screen's approximate product (``Int8GreedyScreen``, ``runner/greedy_screen.py``):
    bf16 [rows, out] of ``sum_b fl(d_w[v, b] * scales[r, b]) * sum_i q_w[v, b, i] * xq[r, b, i]``
    over the blocks b of 32, the int32 sums exact, their sum fp32, rounded once to bf16.
    ``w``: a Q8_0 weight in the kernel's tiles; ``xq``: int8 [rows, in]; ``scales``: fp32
    [rows, in / 32]. Needs ``int8_screen_available()``. ``path``: ``vnni`` (vpdpbusd), ``amx``
    (the CPU's AMX tiles: ``amx_int8_screen_available()``) or ``auto`` (amx where it runs):
    the same sums in another order."""
    if path not in SCREEN_PATHS:
        raise ValueError(f"path must be one of {SCREEN_PATHS}, got {path!r}")
    available = amx_int8_screen_available()
    amx = path == "amx" or (path == "auto" and available)
    if amx and not available:
        raise ValueError("path='amx' needs a CPU with AMX tiles (none here, or the process may "
                         "not use them)")
    if w.fmt != "Q8_0" or not w.kernel:
        raise ValueError(f"the int8 screen takes a Q8_0 weight in the kernel's tiles, got {w!r}")
    blocks = w.in_features // 32
    if xq.dtype != torch.int8 or xq.dim() != 2 or xq.shape[1] != w.in_features:
        raise ValueError(f"xq must be int8 [rows, {w.in_features}], got {xq.dtype} "
                         f"{tuple(xq.shape)}")
    if scales.dtype != torch.float32 or scales.shape != (xq.shape[0], blocks):
        raise ValueError(f"scales must be float32 [{xq.shape[0]}, {blocks}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    out = torch.empty((xq.shape[0], w.out_features), dtype=torch.bfloat16)
    _library().quant_screen_q8_0(w._data, w.in_features, w.out_features, xq.contiguous(),
                                 scales.contiguous(), out, amx)
    return out


def q8_0_screen_reference(w: QuantWeight, xq: torch.Tensor, scales: torch.Tensor
                          ) -> torch.Tensor:
    """``q8_0_screen`` in torch, for the tests: the same int32 block sums (exact), fp32 scales,
    the blocks summed in fp32 in another order."""
    rows, blocks = scales.shape
    raw = w.raw().view(w.out_features, blocks, 34)  # ggml's Q8_0 block: d fp16, then 32 int8
    d = raw[:, :, :2].contiguous().view(torch.float16).float()[..., 0]  # [out, blocks]
    q = raw[:, :, 2:].contiguous().view(torch.int8).long()  # [out, blocks, 32]
    x = xq.long().view(rows, blocks, 32)
    sums = torch.einsum("rbi,vbi->rvb", x, q).float()  # [rows, out, blocks], exact
    return (sums * (d[None] * scales[:, None])).sum(-1).to(torch.bfloat16)


def _library() -> ModuleType:
    module = cpu_decode_attention.load()
    if module is None:
        raise RuntimeError("the CPU kernel library is not available")
    return module
