"""4-bit AWQ and GPTQ weights: their packings, the torch references, the weight the engine keeps.

Both formats store ``W [out, in]`` as 4-bit codes ``q`` with, per group of ``group_size`` input
features and per output feature, a zero point ``z`` and a scale ``s``: ``W[n, k] = (q - z) * s``.
They differ in how the codes are packed eight to an int32:

* AWQ (AutoAWQ's "gemm" version): ``qweight [in, out / 8]`` packed along the outputs, nibble ``i``
  (bits ``4i .. 4i + 3``) of word ``c`` holding output ``8c + AWQ_ORDER[i]`` (the interleave its
  CUDA kernel unpacks in one shift-and-mask); ``qzeros [in / group, out / 8]`` the same way;
  ``scales [in / group, out]`` fp16.
* GPTQ: ``qweight [in / 8, out]`` packed along the inputs in order (nibble ``j`` of row ``r`` is
  input ``8r + j``); ``qzeros [groups, out / 8]`` in order along the outputs; ``scales [groups,
  out]``; ``g_idx [in]`` the group of each input. With act-order (``desc_act``) the inputs were
  quantized in a permuted order, so a group's inputs are scattered. The original format
  (``checkpoint_format`` "gptq", v1) stores ``z - 1`` in ``qzeros``; GPTQModel's "gptq_v2" stores
  ``z``. A symmetric v1 checkpoint's zeros are therefore all 7 (``0x77777777``).

``Int4Weight`` keeps either in one layout the Triton kernel reads: the codes packed along the
inputs as GPTQ does, zeros unpacked to uint8 (a v1 zero of 15 + 1 = 16 does not fit a nibble),
the scales as stored, and act-order undone by sorting the inputs by group, so each group is
``group_size`` consecutive rows and the activations' columns are gathered in the same order
(``perm``) before the product. The zeros cost ``1 / group_size`` of a byte per weight: 0.8% of
the packed bytes at group 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACK = 8  # 4-bit codes per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8c + AWQ_ORDER[i]
_AWQ_NIBBLE_OF = tuple(AWQ_ORDER.index(j) for j in range(PACK))  # output 8c + j -> its nibble


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` int32 -> ``[..., 8n]`` uint8 codes, nibble ``j`` of word ``c`` at ``8c + j``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2).to(torch.uint8)


def pack_int32(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of ``unpack_int32``: ``[..., 8n]`` codes 0..15 -> ``[..., n]`` int32."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (codes.to(torch.int64).unflatten(-1, (-1, PACK)) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's ``[rows, out / 8]`` int32 -> ``[rows, out]`` uint8 codes in output order."""
    nibbles = unpack_int32(packed).unflatten(-1, (-1, PACK))  # [rows, out / 8, 8] by nibble
    order = torch.tensor(_AWQ_NIBBLE_OF, device=packed.device)
    return nibbles[..., order].flatten(-2)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """AWQ's tensors -> ``W [out, in]`` in fp32 (the reference)."""
    q = unpack_awq(qweight).float()  # [in, out]
    z = unpack_awq(qzeros).float().repeat_interleave(group_size, dim=0)  # [in, out]
    s = scales.float().repeat_interleave(group_size, dim=0)
    return ((q - z) * s).t()


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor, zero_offset: int) -> torch.Tensor:
    """GPTQ's tensors -> ``W [out, in]`` in fp32 (the reference); ``zero_offset`` is 1 for v1
    checkpoints (which store ``z - 1``), 0 for v2."""
    q = unpack_int32(qweight.t()).t().float()  # [in, out]
    groups = g_idx.long()
    z = unpack_int32(qzeros).float()[groups] + zero_offset  # [in, out]
    return ((q - z) * scales.float()[groups]).t()


@dataclass(frozen=True, eq=False)
class Int4Weight:
    """A 4-bit grouped weight kept packed (``engine.layers.quantized.PackedWeight``).

    ``qweight [in / 8, out]`` int32 packed along the inputs; ``zeros [groups, out]`` uint8;
    ``scales [groups, out]``; ``group_size`` rows of ``qweight`` a group (``in`` for one group a
    row); ``perm [in]``: row ``k`` multiplies input feature ``perm[k]`` (None: in order)."""

    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[0]) * PACK

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.zeros, self.scales, self.perm)
        return sum(t.nbytes for t in parts if t is not None)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int) -> Int4Weight:
        """AWQ's tensors, checked against each other (``ValueError`` naming the one that does
        not fit), repacked along the inputs."""
        check_awq(qweight, qzeros, scales, group_size)
        codes = unpack_awq(qweight)  # [in, out]
        packed = pack_int32(codes.t()).t().contiguous()  # [in / 8, out]
        return cls(packed, unpack_awq(qzeros), scales.contiguous(), group_size)

    @classmethod
    def from_gptq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: torch.Tensor | None, group_size: int | None,
                  zero_offset: int) -> Int4Weight:
        """GPTQ's tensors (``group_size`` None: one group a row; ``g_idx`` None: inputs in
        order), checked; act-order undone by sorting the inputs by group."""
        check_gptq(qweight, qzeros, scales, g_idx, group_size)
        in_features = qweight.shape[0] * PACK
        size = in_features if group_size is None else group_size
        zeros = (unpack_int32(qzeros).to(torch.int16) + zero_offset).to(torch.uint8)
        if g_idx is None:
            return cls(qweight.contiguous(), zeros, scales.contiguous(), size)
        g_idx = g_idx.long()
        perm = torch.sort(g_idx, stable=True).indices  # [in]
        in_order = torch.arange(in_features, device=g_idx.device)
        if not torch.equal(g_idx[perm], in_order // size):
            raise ValueError(f"g_idx does not give every group {size} inputs (a layout the "
                             "GPTQ format does not write)")
        if torch.equal(perm, in_order):
            return cls(qweight.contiguous(), zeros, scales.contiguous(), size)
        codes = unpack_int32(qweight.t()).t()[perm]  # [in, out], sorted by group
        packed = pack_int32(codes.t()).t().contiguous()
        return cls(packed, zeros, scales.contiguous(), size, perm)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W [out, in]`` in ``dtype``: computed in fp32, rounded once."""
        q = unpack_int32(self.qweight.t()).t().float()  # [in, out] in packed row order
        z = self.zeros.float().repeat_interleave(self.group_size, dim=0)
        s = self.scales.float().repeat_interleave(self.group_size, dim=0)
        rows = (q - z) * s  # [in, out]
        if self.perm is not None:
            rows = torch.empty_like(rows).index_copy_(0, self.perm, rows)
        return rows.t().to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ W.T (+ bias)`` in ``x.dtype``: the Triton kernel on CUDA, the torch
        reference elsewhere."""
        if x.device.type != "cuda":
            return linear_reference(x, self, bias)
        return self.kernel_linear(x, bias)

    def kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``linear`` through the Triton kernel (on CPU tensors under ``TRITON_INTERPRET``)."""
        from engine.kernels.triton_int4_gemm import int4_gemm

        x2d = x.reshape(-1, x.shape[-1])
        if self.perm is not None:
            x2d = x2d.index_select(1, self.perm)
        out = int4_gemm(x2d, self.qweight, self.zeros, self.scales, self.group_size, bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def to(self, device: torch.device | str) -> Int4Weight:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Int4Weight(self.qweight.to(device), self.zeros.to(device),
                          self.scales.to(device), self.group_size, move(self.perm))


def linear_reference(x: torch.Tensor, weight: Int4Weight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product the kernel computes: the weight dequantized in fp32, rounded to ``x.dtype``."""
    return torch.nn.functional.linear(x, weight.dequantize(x.dtype), bias)


def check_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group_size: int) -> None:
    """AWQ's tensors fit each other: ``ValueError`` naming the one that does not."""
    _check_int32(qweight=qweight, qzeros=qzeros)
    in_features, out_features = qweight.shape[0], qweight.shape[1] * PACK
    groups = _num_groups(in_features, group_size, "qweight")
    _check_shape("qzeros", qzeros, (groups, out_features // PACK))
    _check_scales(scales, (groups, out_features))


def check_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None, group_size: int | None) -> None:
    """GPTQ's tensors fit each other (``group_size`` None: one group a row): ``ValueError``
    naming the one that does not."""
    _check_int32(qweight=qweight, qzeros=qzeros)
    in_features, out_features = qweight.shape[0] * PACK, qweight.shape[1]
    if out_features % PACK:
        raise ValueError(f"qweight has {out_features} outputs, not a multiple of {PACK}")
    groups = _num_groups(in_features, group_size or in_features, "qweight")
    _check_shape("qzeros", qzeros, (groups, out_features // PACK))
    _check_scales(scales, (groups, out_features))
    if g_idx is None:
        return
    _check_shape("g_idx", g_idx, (in_features,))
    if g_idx.is_floating_point() or (g_idx.numel() and (g_idx.min() < 0
                                                        or g_idx.max() >= groups)):
        raise ValueError(f"g_idx must hold group numbers 0..{groups - 1}")


def _num_groups(in_features: int, group_size: int, name: str) -> int:
    if in_features % group_size:
        raise ValueError(f"{name} has {in_features} inputs, not a multiple of the group size "
                         f"{group_size}")
    return in_features // group_size


def _check_int32(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.dtype != torch.int32 or tensor.dim() != 2:
            raise ValueError(f"{name} must be a 2-D int32 tensor, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")


def _check_scales(scales: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not scales.is_floating_point():
        raise ValueError(f"scales must be floating point, got {scales.dtype}")
    _check_shape("scales", scales, shape)


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the qweight needs {shape}")
