"""The bf16 layer's fused C++ ops (engine/kernels/cpu_fused_ops.py) against torch references."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_decode_attention, cpu_fused_ops
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_decode_attention.load() is None, reason="no C++ toolchain")

BF16 = torch.bfloat16
# One bf16 rounding step apart at most: fp32 arithmetic in another order may round the other way.
ULP = {"rtol": 2**-7, "atol": 1e-6}


def rows(num_rows: int, width: int, *, stride: int | None = None, seed: int = 0) -> torch.Tensor:
    """[num_rows, width] bf16, as a slice of a wider tensor when ``stride`` is given."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(num_rows, stride or width, generator=g) * 3).to(BF16)
    return full[:, :width]


@pytest.mark.parametrize("num_rows,hidden,stride", [
    (1, 576, None), (7, 576, None), (64, 576, None), (5, 67, None), (3, 64, 100),
    (0, 576, None), (200, 576, None),  # 200 x 576: past the grain, split over threads
])
def test_fused_add_rms_norm_matches_reference(num_rows, hidden, stride):
    x = rows(num_rows, hidden, stride=stride)
    residual = torch.randn(num_rows, hidden, generator=torch.Generator().manual_seed(1)) * 3
    weight = rows(1, hidden, seed=2)[0].contiguous()
    want_x, want_residual = cpu_fused_ops.fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    got_x, got_residual = cpu_fused_ops.fused_add_rms_norm(x.clone(), residual.clone(), weight,
                                                            1e-5)
    assert got_residual.dtype == torch.float32
    assert torch.equal(got_residual, want_residual)  # one fp32 add: the same rounding
    torch.testing.assert_close(got_x, want_x, **ULP)


def test_fused_add_rms_norm_is_in_place_and_the_norm_module_uses_it():
    x, residual = rows(4, 576), torch.randn(4, 576)
    norm = RMSNorm(576, 1e-6).to(BF16)
    norm.weight.data = rows(1, 576, seed=2)[0].contiguous()
    want_x, want_residual = cpu_fused_ops.fused_add_rms_norm_ref(x, residual, norm.weight, 1e-6)
    x_in, residual_in = x.clone(), residual.clone()
    got_x, got_residual = norm.add_and_norm(x_in, residual_in)
    assert got_x.data_ptr() == x_in.data_ptr()
    assert got_residual.data_ptr() == residual_in.data_ptr()
    assert torch.equal(got_residual, want_residual)
    torch.testing.assert_close(got_x, want_x, **ULP)
    torch.testing.assert_close(got_x, norm(want_residual), **ULP)


def test_add_and_norm_in_fp32_is_the_torch_ops_bit_for_bit():
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64)
    got_x, got_residual = norm.add_and_norm(x.clone(), residual.clone())
    assert torch.equal(got_residual, residual + x)
    assert torch.equal(got_x, norm(residual + x))


@pytest.mark.parametrize("num_rows,width,stride", [
    (1, 2 * 1536, None), (13, 2 * 1536, None), (4, 2 * 17, None), (3, 2 * 24, 70), (0, 8, None),
    (30, 2 * 1536, None),  # past the grain
])
def test_silu_and_mul_matches_reference(num_rows, width, stride):
    gate_up = rows(num_rows, width, stride=stride)
    got = cpu_fused_ops.silu_and_mul(gate_up)
    assert got.shape == (num_rows, width // 2) and got.dtype == BF16
    torch.testing.assert_close(got, cpu_fused_ops.silu_and_mul_ref(gate_up), **ULP)
    # and near the torch ops it replaces, which round twice
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=2**-6, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 6), (5, 1, 128)])
def test_rotary_in_place_matches_reference_on_a_qkv_view(num_heads, num_kv_heads, head_dim):
    rotary = RotaryEmbedding(head_dim, 300, {"rope_theta": 10000.0})
    positions = torch.tensor([0, 1, 17, 255, 299, 3])
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = rows(len(positions), width)
    # q and k side by side inside the fused projection's output, as the model rotates them
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].unflatten(-1, (-1, head_dim))
    want = cpu_fused_ops.rotary_neox_ref(qk, positions, rotary.cos_cache, rotary.sin_cache)
    stock = rotary.rotate(positions, qk)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    got = rotary.rotate_(positions, qk)
    assert got.data_ptr() == qk.data_ptr()  # in place
    torch.testing.assert_close(got, want, **ULP)
    # the torch ops round each product first: with cancellation, an ulp of the inputs (~10)
    torch.testing.assert_close(got, stock, rtol=2**-6, atol=2**-4)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)


def test_fp32_rotary_stays_on_the_torch_ops():
    rotary = RotaryEmbedding(16, 32, {"rope_theta": 10000.0})
    positions = torch.tensor([0, 5, 31])
    x = torch.randn(3, 2, 16)
    got = rotary.rotate_(positions, x)
    assert got.data_ptr() != x.data_ptr()
    assert torch.equal(got, rotary.rotate(positions, x))


def test_bad_inputs_are_rejected():
    x = rows(2, 8)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_fused_ops.fused_add_rms_norm(x.float(), x.float(), x[0].float(), 1e-5)
    with pytest.raises(ValueError, match="residual must be a 2-D CPU float32"):
        cpu_fused_ops.fused_add_rms_norm(x, x.clone(), x[0].contiguous(), 1e-5)
    with pytest.raises(ValueError, match="differ"):
        cpu_fused_ops.fused_add_rms_norm(x, rows(3, 8).float(), x[0].contiguous(), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        cpu_fused_ops.fused_add_rms_norm(x, x.float(), rows(1, 4)[0], 1e-5)
    with pytest.raises(ValueError, match="contiguous last dim"):
        cpu_fused_ops.silu_and_mul(rows(2, 16).t())
    with pytest.raises(ValueError, match="even"):
        cpu_fused_ops.silu_and_mul(rows(2, 7))
    rotary = RotaryEmbedding(8, 16, {"rope_theta": 10000.0})
    qk = rows(2, 16).view(2, 2, 8)
    with pytest.raises(ValueError, match="int64"):
        cpu_fused_ops.rotary_neox(qk, torch.tensor([0, 1], dtype=torch.int32), rotary.cos_cache,
                                  rotary.sin_cache)
    with pytest.raises(RuntimeError, match="outside"):
        cpu_fused_ops.rotary_neox(qk, torch.tensor([0, 16]), rotary.cos_cache, rotary.sin_cache)


@pytest.mark.parametrize("num_rows,vocab,scale", [(1, 49152, 1.0), (5, 3001, 0.05), (33, 500, 8.0)])
def test_screen_candidates_match_the_torch_ops(num_rows, vocab, scale):
    g = torch.Generator().manual_seed(7)
    approx = (torch.randn(num_rows, vocab, generator=g) * scale).to(BF16)
    weight_norms = torch.rand(vocab, generator=g) + 0.5
    row_bounds = torch.rand(num_rows, generator=g) * 0.02
    args = (approx, row_bounds, weight_norms, 2**-8)
    got_rows, got_tokens = cpu_fused_ops.screen_candidates(*args)
    want_rows, want_tokens = cpu_fused_ops.screen_candidates_ref(*args)
    got = set(zip(got_rows.tolist(), got_tokens.tolist(), strict=True))
    want = set(zip(want_rows.tolist(), want_tokens.tolist(), strict=True))
    # fp32 rounding in another order may move a token sitting exactly on the line; none here
    assert got == want
    assert got_rows.tolist() == sorted(got_rows.tolist())  # by row, as nonzero returns them
    for r in range(num_rows):  # each row's best screened token is a candidate
        assert (r, int(approx[r].float().argmax())) in got


def test_screen_candidates_reject_bad_inputs():
    approx = rows(2, 10)
    with pytest.raises(ValueError, match="row_bounds"):
        cpu_fused_ops.screen_candidates(approx, torch.zeros(3), torch.ones(10), 0.01)
    with pytest.raises(ValueError, match="weight_norms"):
        cpu_fused_ops.screen_candidates(approx, torch.zeros(2), torch.ones(10).double(), 0.01)


def test_store_kvcache_writes_the_slots_like_index_copy():
    from engine.layers.torch_attention import store_kvcache as store_ref

    num_kv_heads, head_dim, block_size = 3, 64, 16
    qkv = rows(5, (9 + 2 * num_kv_heads) * head_dim)
    k = qkv[:, 9 * 64: 12 * 64].view(5, num_kv_heads, head_dim)  # views of qkv, as the model has
    v = qkv[:, 12 * 64:].view(5, num_kv_heads, head_dim)
    slots = torch.tensor([0, 17, 18, 63, 40])
    caches = [torch.zeros(4, block_size, num_kv_heads, head_dim, dtype=BF16) for _ in range(4)]
    cpu_fused_ops.store_kvcache(k, v, caches[0], caches[1], slots)
    store_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="outside"):
        cpu_fused_ops.store_kvcache(k, v, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 64]))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_fused_ops.store_kvcache(k.transpose(1, 2), v, caches[0], caches[1], slots)
    with pytest.raises(ValueError, match="int64"):
        cpu_fused_ops.store_kvcache(k, v, caches[0], caches[1], slots.int())
