"""lora_shrink / lora_expand: the Triton kernels against their torch references, and the stacked
(kernel) LoRALinear path against the CPU segmented path. Without a GPU the kernels run on CPU
tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels.lora_expand import lora_expand, lora_expand_ref  # noqa: E402
from engine.kernels.lora_shrink import lora_shrink, lora_shrink_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def segments_tensors(spec: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
    start, length, slot = zip(*spec, strict=True) if spec else ((), (), ())
    return tuple(torch.tensor(v, dtype=torch.int32, device=DEVICE)
                 for v in (start, length, slot))


# (start, len, slot): gaps are base rows; one segment longer than a row tile; slots out of order
SPEC = [(0, 3, 2), (5, 1, 0), (6, 37, 1), (50, 2, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(56, 72, generator=g).to(DEVICE, dtype)
    a = torch.randn(3, 40, 72, generator=g).to(DEVICE, dtype)
    start, length, slot = segments_tensors(SPEC)
    y = lora_shrink(x, a, start, length, slot, 37)
    ref = lora_shrink_ref(x, a, start, length, slot)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for s, n, _ in SPEC:
        torch.testing.assert_close(y[s: s + n], ref[s: s + n], atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_matches_reference_and_leaves_other_rows(dtype):
    g = torch.Generator().manual_seed(1)
    y = torch.randn(56, 24, generator=g).to(DEVICE)
    b = torch.randn(3, 50, 24, generator=g).to(DEVICE, dtype)
    full = torch.randn(56, 80, generator=g).to(DEVICE, dtype)
    out = full[:, 10:60]  # a strided column view, as a packed projection's slice is
    expected_full = full.clone()
    start, length, slot = segments_tensors(SPEC)
    lora_expand_ref(y, b, expected_full[:, 10:60], start, length, slot)
    before = full.clone()
    lora_expand(y, b, out, start, length, slot, 37)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(full, expected_full, atol=tol * 10, rtol=tol)
    base_rows = [r for r in range(56) if not any(s <= r < s + n for s, n, _ in SPEC)]
    assert torch.equal(full[base_rows], before[base_rows])  # base rows untouched
    assert torch.equal(full[:, :10], before[:, :10]) and torch.equal(full[:, 60:], before[:, 60:])


def test_launchers_check_shapes():
    start, length, slot = segments_tensors(SPEC)
    with pytest.raises(ValueError, match="a_stack"):
        lora_shrink(torch.zeros(4, 8), torch.zeros(2, 3, 9), start, length, slot, 1)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(torch.zeros(4, 8), torch.zeros(2, 3, 8), start.long(), length, slot, 1)
    with pytest.raises(ValueError, match="float32"):
        lora_expand(torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(2, 5, 3),
                    torch.zeros(4, 5), start, length, slot, 1)


def test_no_segments_is_a_no_op():
    start, length, slot = segments_tensors([])
    out = torch.ones(4, 5, device=DEVICE)
    lora_expand(torch.zeros(4, 3, device=DEVICE), torch.ones(2, 5, 3, device=DEVICE), out,
                start, length, slot, 0)
    assert torch.equal(out, torch.ones(4, 5, device=DEVICE))


def test_lora_linear_stacked_path_equals_segmented_path_and_base_rows_pay_nothing():
    from engine.layers.linear import Linear
    from engine.lora.layers import (
        LoRABatch,
        LoRALinear,
        LoRAPiece,
        LoRASegment,
        ModuleLoRA,
        lora_batch,
    )

    g = torch.Generator().manual_seed(2)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DEVICE)

    base = Linear(16, 24, bias=False).to(DEVICE)
    linear = LoRALinear(base, 0, ("q_proj", "k_proj", "v_proj"), (8, 8, 8))
    # adapter 0: q (rank 2) and v (rank 3); adapter 1: the whole packed module (rank 4)
    a0 = ModuleLoRA(rand(5, 16), [
        LoRAPiece(0, 8, 0, 2, 0.5, rand(8, 2), (0,)),
        LoRAPiece(16, 8, 2, 3, 2.0, rand(8, 3), (2,))])
    a1 = ModuleLoRA(rand(4, 16), [
        LoRAPiece(0, 24, 0, 4, 1.5, rand(24, 4), (0, 1, 2))])
    x = rand(10, 16)
    segments = [LoRASegment(1, 4, "a0", [a0], slot=1), LoRASegment(6, 9, "a1", [a1], slot=0)]
    expected = base(x)
    with lora_batch(None):
        assert torch.equal(linear(x), expected)  # a base-only step runs no LoRA code
    with lora_batch(LoRABatch(segments)):
        cpu = linear(x)
    base_rows = [0, 4, 5, 9]
    assert torch.equal(cpu[base_rows], expected[base_rows])
    # the segmented path against the plain formula
    want = expected.clone()
    want[1:4, 0:8] += 0.5 * (x[1:4] @ a0.lora_a[:2].T) @ a0.pieces[0].lora_b.T
    want[1:4, 16:24] += 2.0 * (x[1:4] @ a0.lora_a[2:].T) @ a0.pieces[1].lora_b.T
    want[6:9] += 1.5 * (x[6:9] @ a1.lora_a.T) @ a1.pieces[0].lora_b.T
    torch.testing.assert_close(cpu, want, atol=1e-5, rtol=1e-5)

    linear.allocate_stacks(2, 8, torch.float32, torch.device(DEVICE))
    linear.write_slot(1, a0)
    linear.write_slot(0, a1)
    start, length, slot = segments_tensors([(1, 3, 1), (6, 3, 0)])
    stacked = LoRABatch(segments, stacked=True, seg_table=torch.stack([start, length, slot]),
                        max_seg_len=3)
    with lora_batch(stacked):
        gpu = linear(x)
    torch.testing.assert_close(gpu, cpu, atol=1e-5, rtol=1e-5)
    assert torch.equal(gpu[base_rows], expected[base_rows])


def test_long_segments_on_onednn_equal_the_plain_formula():
    """Where oneDNN multiplies the base weight, a segment of ONEDNN_MIN_ROWS rows or more runs
    on oneDNN's packed A and B, a shorter one on matmul: both the plain formula."""
    from engine.layers.linear import Linear, onednn_packing_available
    from engine.lora.layers import (
        ONEDNN_MIN_ROWS,
        LoRABatch,
        LoRALinear,
        LoRAPiece,
        LoRASegment,
        ModuleLoRA,
        lora_batch,
    )

    if not onednn_packing_available(torch.float32):
        pytest.skip("oneDNN does not pack fp32 here")
    g = torch.Generator().manual_seed(3)
    base = Linear(16, 24, bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.randn(24, 16, generator=g))
    module = ModuleLoRA(torch.randn(5, 16, generator=g), [
        LoRAPiece(0, 8, 0, 2, 0.5, torch.randn(8, 2, generator=g), (0,)),
        LoRAPiece(16, 8, 2, 3, 2.0, torch.randn(8, 3, generator=g), (2,))])
    long = ONEDNN_MIN_ROWS + 5
    x = torch.randn(long + 7, 16, generator=g)
    want = base(x)
    for rows in (slice(0, long), slice(long + 1, long + 7)):
        want[rows, 0:8] += 0.5 * (x[rows] @ module.lora_a[:2].T) @ module.pieces[0].lora_b.T
        want[rows, 16:24] += 2.0 * (x[rows] @ module.lora_a[2:].T) @ module.pieces[1].lora_b.T
    base.pack(gemm="onednn")
    linear = LoRALinear(base, 0, ("q_proj", "k_proj", "v_proj"), (8, 8, 8))
    segments = [LoRASegment(0, long, "a", [module]), LoRASegment(long + 1, long + 7, "a",
                                                                  [module])]
    with lora_batch(LoRABatch(segments)):
        got = linear(x)
    assert module._onednn is not None  # the long segment took the packed copies
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
