"""Build a model without random initialisation: its weights are about to be loaded anyway.

``nn.Linear`` and ``nn.Embedding`` fill their fresh parameters with ``torch.nn.init`` functions
(kaiming/uniform/normal: ~0.3 s of random numbers for the default model, seconds for a larger
one), which ``load_weights`` overwrites at once. transformers has the same helper
(``transformers.initialization.no_init_weights``), but it imports ``transformers.modeling_utils``
and through it torch._dynamo: ~1 s of imports a start-up otherwise never pays.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn.init

# Every in-place initialiser of torch.nn.init that module constructors call.
_INIT_FUNCTIONS = (
    "uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_",
    "sparse_",
)


def _leave_as_is(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextmanager
def no_init_weights() -> Iterator[None]:
    """Inside, ``torch.nn.init``'s initialisers leave tensors as they are (uninitialised memory).

    Not thread-safe: it patches the module for every thread while it is open, so use it only
    around building a model whose every parameter is loaded next (``load_weights`` checks that).
    """
    originals = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS
                 if hasattr(torch.nn.init, name)}
    try:
        for name in originals:
            setattr(torch.nn.init, name, _leave_as_is)
        yield
    finally:
        for name, function in originals.items():
            setattr(torch.nn.init, name, function)


def cast_unloaded(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for a model built under ``no_init_weights`` whose parameters are all
    loaded next: each floating parameter becomes fresh ``torch.empty`` memory of ``dtype`` (a
    tied one stays shared) instead of a converted copy of uninitialised memory. The copy writes
    every page, so a bf16 engine committed its whole dense model before loading; with weights
    kept quantized (``engine/layers/quantized.py``) most of that is dropped unused. Buffers
    (the rotary tables, computed at build) are converted as ``to`` converts them."""
    fresh: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in fresh:
                fresh[id(param)] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=dtype, device=param.device),
                    requires_grad=param.requires_grad)
            module._parameters[name] = fresh[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)
