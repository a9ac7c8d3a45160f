"""FP8 (e4m3) weights with their scales: the torch reference and the weight the engine keeps.

Checkpoints store ``W [out, in]`` as float8_e4m3fn codes (3 mantissa bits, at most 448) times a
scale: one for the tensor or one per output row (compressed-tensors' ``weight_scale``, strategy
"tensor" or "channel"), or one per block of 128 x 128 (Hugging Face's fine-grained FP8, the
DeepSeek-V3 layout, ``weight_scale_inv [ceil(out / 128), ceil(in / 128)]``: despite its name the
factor that multiplies, like ``weight_scale``). ``Fp8Weight`` keeps all three as one grid of
blocks (``scale [ceil(out / bn), ceil(in / bk)]``, ``block = (bn, bk)``: ``(out, in)`` per
tensor, ``(1, in)`` per channel), the layout the Triton kernel reads.

On a GPU with FP8 tensor cores (capability 8.9 and up) a per-tensor or per-channel weight runs
through ``torch._scaled_mm``: the activations are quantized to e4m3 on the fly (per row on
capability 9.0+, where row-wise scaling exists; per tensor on 8.9, the weight's channel scales
then applied to the fp32 product), which is what the dynamic-activation checkpoints were
calibrated for and what doubles the tensor cores' rate over bf16. Block-scaled weights, and every
FP8 weight on older GPUs, go through the Triton kernel that dequantizes tiles of the weight and
keeps the activations in their dtype. On the CPU ``linear`` is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """An e4m3 weight kept in 1 byte a value (``engine.layers.quantized.PackedWeight``).

    ``weight [out, in]`` float8_e4m3fn; ``scale [ceil(out / bn), ceil(in / bk)]`` fp32 with
    ``block = (bn, bk)``."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @classmethod
    def from_checkpoint(cls, weight: torch.Tensor, scale: torch.Tensor,
                        block_size: tuple[int, int] | None = None) -> Fp8Weight:
        """A checkpoint's weight and scale, the layout told by the scale's shape: one value (per
        tensor), ``[out]`` or ``[out, 1]`` (per channel), or the block grid of ``block_size``.
        ``ValueError`` naming the tensor that does not fit."""
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if not scale.is_floating_point():
            raise ValueError(f"the weight's scale must be floating point, got {scale.dtype}")
        out_features, in_features = weight.shape
        scale = scale.float()
        if block_size is not None:
            bn, bk = block_size
            grid = (-(-out_features // bn), -(-in_features // bk))
            if tuple(scale.shape) != grid:
                raise ValueError(f"the scale has shape {tuple(scale.shape)}; blocks of "
                                 f"{bn} x {bk} over a weight {tuple(weight.shape)} need {grid}")
            return cls(weight.contiguous(), scale.contiguous(), (bn, bk))
        if scale.numel() == 1:
            return cls(weight.contiguous(), scale.reshape(1, 1), (out_features, in_features))
        if tuple(scale.shape) in ((out_features,), (out_features, 1)):
            return cls(weight.contiguous(), scale.reshape(out_features, 1).contiguous(),
                       (1, in_features))
        raise ValueError(f"the scale has shape {tuple(scale.shape)}; a weight "
                         f"{tuple(weight.shape)} takes one value (per tensor) or "
                         f"[{out_features}, 1] (per channel)")

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def per_channel(self) -> bool:
        """One scale per output row (or one for all): what ``torch._scaled_mm`` can apply."""
        return self.block[1] == self.in_features and self.block[0] in (1, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W [out, in]`` in ``dtype``: codes times their block's scale in fp32, rounded once."""
        return dequantize_fp8(self.weight, self.scale, self.block).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ W.T (+ bias)`` in ``x.dtype``: FP8 tensor cores or the Triton kernel
        on CUDA (the module docstring says which), the torch reference elsewhere."""
        if x.device.type != "cuda":
            return linear_reference(x, self, bias)
        x2d = x.reshape(-1, self.in_features)
        capability = torch.cuda.get_device_capability(x.device)
        fits = self.in_features % 16 == 0 and self.out_features % 16 == 0
        if capability >= (8, 9) and self.per_channel and fits:
            out = scaled_mm_linear(x2d, self.weight, self.channel_scales(),
                                   rowwise=capability >= (9, 0), bias=bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        return self.kernel_linear(x, bias)

    def kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``linear`` through the Triton kernel (on CPU tensors under ``TRITON_INTERPRET``)."""
        from engine.kernels.triton_fp8_gemm import fp8_gemm

        out = fp8_gemm(x.reshape(-1, self.in_features), self.weight, self.scale, self.block, bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def channel_scales(self) -> torch.Tensor:
        """``[1, out]`` fp32: each output row's scale (a per-tensor scale repeated)."""
        return self.scale.reshape(1, -1).expand(1, self.out_features).contiguous()

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device), self.scale.to(device), self.block)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int]) -> torch.Tensor:
    """``weight [out, in]`` e4m3 times ``scale``'s block grid -> fp32 ``[out, in]`` (the
    reference; a partial last block takes its block's scale)."""
    out_features, in_features = weight.shape
    full = scale.float().repeat_interleave(block[0], 0)[:out_features]
    full = full.repeat_interleave(block[1], 1)[:, :in_features]
    return weight.float() * full


def linear_reference(x: torch.Tensor, weight: Fp8Weight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product the Triton kernel computes: the weight dequantized in fp32, rounded to
    ``x.dtype``."""
    return torch.nn.functional.linear(x, weight.dequantize(x.dtype), bias)


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, channel_scales: torch.Tensor, *,
                     rowwise: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ (weight [N, K] * channel_scales [1, N].T).T`` on FP8 tensor cores: ``x``
    quantized to e4m3 with a scale per row (``rowwise``) or one for all of it, the product in
    ``torch._scaled_mm``, the output in ``x.dtype``."""
    amax = x.abs().amax(-1, keepdim=True) if rowwise else x.abs().amax().reshape(1, 1)
    x_scale = amax.float().clamp(min=1e-12) / E4M3_MAX  # [M, 1] or [1, 1]
    x_fp8 = (x.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    if rowwise:  # the row-wise kernels write bf16
        out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=channel_scales,
                               out_dtype=torch.bfloat16)
    else:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale.reshape(()), scale_b=one,
                               out_dtype=torch.float32) * channel_scales
    out = out.to(x.dtype)
    return out if bias is None else out + bias
