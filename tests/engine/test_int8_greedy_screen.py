"""The int8 greedy screen of an output layer kept in Q8_0 (``Int8GreedyScreen``): its kernel
(``quant_gemm.q8_0_screen``) against a torch reference of the same int8 formula, its argmax
against the exact fp32 argmax on random and near-tie inputs, its error bound, and the engine's
greedy tokens with it and without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels.ggml_quants import random_rows
from engine.kernels.quant_gemm import (
    QuantWeight,
    amx_int8_screen_available,
    int8_screen_available,
    pack,
    q8_0_screen,
    q8_0_screen_reference,
)
from engine.runner.greedy_screen import Int8GreedyScreen, quantize_rows
from tests.engine.test_quantized_loading import CASES, SCHEDULE, prompts, write_mixed_gguf

pytestmark = pytest.mark.skipif(not int8_screen_available(),
                                reason="the int8 screen needs AVX512-VNNI and VBMI")


def q8_0_weight(d: torch.Tensor, q: torch.Tensor) -> QuantWeight:
    """A Q8_0 weight of scales ``d`` [out, blocks] and values ``q`` int8 [out, blocks, 32]."""
    out, blocks = d.shape
    raw = torch.empty(out, blocks, 34, dtype=torch.uint8)
    raw[:, :, :2] = d.to(torch.float16).view(torch.uint8).view(out, blocks, 2)
    raw[:, :, 2:] = q.view(torch.uint8)
    return pack("Q8_0", raw.view(out, blocks * 34), blocks * 32)


def dot_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fp32 argmax computed the way the screen computes its candidates' logits."""
    return (hidden[:, None, :] * weight[None]).sum(-1).argmax(dim=1)


@pytest.mark.parametrize("path", ["vnni", "amx"])
@pytest.mark.parametrize("rows", [1, 4, 10, 11, 23, 70])
@pytest.mark.parametrize("out_features,in_features", [(16, 256), (37, 96), (203, 544),
                                                      (1000, 640)])
def test_kernel_equals_the_int8_reference(rows: int, out_features: int, in_features: int,
                                          path: str):
    if path == "amx" and not amx_int8_screen_available():
        pytest.skip("no AMX tiles on this CPU (or the process may not use them)")
    g = torch.Generator().manual_seed(rows + out_features)
    weight = pack("Q8_0", random_rows("Q8_0", out_features, in_features, g), in_features)
    hidden = torch.randn(rows, in_features, generator=g)
    hidden[0, :32] = 0  # a zero block: scale 0
    xq, scales, _ = quantize_rows(hidden)
    got = q8_0_screen(weight, xq, scales, path=path).float()
    want = q8_0_screen_reference(weight, xq, scales).float()
    # the int32 sums are exact; the blocks' fp32 sums differ in order, then each rounds to bf16
    # once: at most a bf16 step apart (2^-7 of the value), plus the fp32 order's own error
    x_hat = (xq.float().view(rows, -1, 32) * scales[..., None]).view(rows, in_features)
    magnitude = x_hat.abs() @ weight.dequantize(torch.float32).abs().T  # >= sum of |terms|
    allowed = 2.0**-7 * torch.maximum(got.abs(), want.abs()) + 1e-5 * magnitude
    assert ((got - want).abs() <= allowed).all()


def test_quantized_rows_rebuild_x_within_their_error():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 96, generator=g) * torch.logspace(-3, 3, 96)
    hidden[2, 32:64] = 0
    xq, scales, error_norms = quantize_rows(hidden)
    assert xq.abs().max() <= 127 and (scales[2, 1] == 0) and (xq[2, 32:64] == 0).all()
    rebuilt = xq.double().view(5, 3, 32) * scales.double()[..., None]
    error = (hidden.double() - rebuilt.view(5, 96)).norm(dim=1)
    assert torch.equal(error, error_norms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.02, 1.0, 30.0])
def test_matches_the_exact_argmax_on_random_logits(dtype: torch.dtype, scale: float):
    g = torch.Generator().manual_seed(0)
    weight = pack("Q8_0", random_rows("Q8_0", 3001, 96, g, scale=scale), 96)
    dense = weight.dequantize(torch.float32)
    hidden = (torch.randn(40, 96, generator=g) * 5).to(dtype)
    got = Int8GreedyScreen(weight, 3001).argmax(hidden)
    assert torch.equal(got, dot_argmax(hidden.float(), dense))
    assert torch.equal(got, (hidden.float() @ dense.T).argmax(dim=1))


def _aligned_rows(hidden: torch.Tensor) -> torch.Tensor:
    """int8 [rows, blocks, 32] values along each hidden row: large logits, near one another."""
    rows, depth = hidden.shape
    blocks = hidden.view(rows, depth // 32, 32)
    return (blocks / blocks.abs().amax(dim=2, keepdim=True) * 127).round().to(torch.int8)


def test_near_ties_far_below_the_screen_s_resolution_are_settled_in_fp32():
    """Per row, a winner and a rival one weight step apart where x is smallest (a logit gap
    ~1e-7 of the logits): the screen alone cannot tell them apart."""
    g = torch.Generator().manual_seed(1)
    rows, depth, vocab = 24, 128, 700
    hidden = torch.randn(rows, depth, generator=g)
    d = torch.rand(vocab, depth // 32, generator=g) * 0.01 + 0.001
    q = torch.randint(-40, 41, (vocab, depth // 32, 32), dtype=torch.int8, generator=g)
    planted = _aligned_rows(hidden)
    smallest = hidden.abs().argmin(dim=1)
    for r in range(rows):
        winner, rival = planted[r].clone(), planted[r].clone()
        block, i = divmod(int(smallest[r]), 32)
        step = 1 if hidden[r, smallest[r]] > 0 else -1
        if abs(int(winner[block, i]) + step) > 127:
            winner[block, i] -= step  # the winner is the rival's step up, either way
        else:
            rival[block, i] += step
        rival, winner = (rival, winner) if r % 2 else (winner, rival)
        q[2 * r], q[2 * r + 1] = winner, rival
        d[2 * r] = d[2 * r + 1] = 0.01
    weight = q8_0_weight(d, q)
    dense = weight.dequantize(torch.float32)
    want = dot_argmax(hidden, dense)
    assert set(want.tolist()) <= set(range(2 * rows))
    assert torch.equal(Int8GreedyScreen(weight, vocab).argmax(hidden), want)


def test_exact_ties_go_to_the_lowest_token_id_like_argmax():
    g = torch.Generator().manual_seed(2)
    d = torch.full((200, 1), 0.01)
    q = torch.randint(-50, 51, (200, 1, 32), dtype=torch.int8, generator=g)
    for row in (150, 7, 90):  # three identical best rows
        q[row] = 100
    hidden = torch.ones(3, 32)
    assert Int8GreedyScreen(q8_0_weight(d, q), 200).argmax(hidden).tolist() == [7, 7, 7]


def test_the_error_bound_holds_and_padded_rows_are_never_tokens():
    g = torch.Generator().manual_seed(3)
    weight = pack("Q8_0", random_rows("Q8_0", 2005, 640, g, scale=0.1), 640)
    hidden = torch.randn(32, 640, generator=g) * 4
    screen = Int8GreedyScreen(weight, 2000)  # the last 5 rows: padding past the vocabulary
    approx, row_bounds = screen._screen(hidden)
    assert approx.shape == (32, 2000)
    exact = hidden.double() @ weight.dequantize(torch.float32)[:2000].double().T
    bound = row_bounds[:, None].double() * screen.row_norms.double()
    bound = bound + approx.double().abs() * screen.output_rounding
    assert ((approx.double() - exact).abs() <= bound).all()
    assert int(screen.argmax(hidden).max()) < 2000
    torch.testing.assert_close(screen.logits(hidden), exact.float(), rtol=1e-5, atol=1e-4)


def test_empty_and_wrong_inputs():
    g = torch.Generator().manual_seed(4)
    weight = pack("Q8_0", random_rows("Q8_0", 10, 32, g), 32)
    assert Int8GreedyScreen(weight, 10).argmax(torch.empty(0, 32)).shape == (0,)
    with pytest.raises(ValueError, match="Q8_0"):
        Int8GreedyScreen(pack("Q4_0", random_rows("Q4_0", 10, 32, g), 32), 10)
    with pytest.raises(ValueError, match="vocab_size"):
        Int8GreedyScreen(weight, 11)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_screens_a_kept_q8_0_head_with_the_same_tokens(tmp_path: Path, dtype: str):
    arch, make, type_of = CASES["llama-q8_0"]
    model, extra = make()
    path = write_mixed_gguf(tmp_path / "q8.gguf", model, arch, type_of, extra)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tokens = []
    for screen in (True, False):  # a fresh engine each: a prefix-cache hit changes bf16 sums
        llm = LLM(str(path), quantization="keep", **{**SCHEDULE, "dtype": dtype})
        runner = llm.engine.model_runner
        assert isinstance(runner.greedy_screen, Int8GreedyScreen)
        batch = prompts(llm.engine.vocab_size)
        if screen:
            scores = runner.score_tokens(batch[1])
            assert scores.shape == (len(batch[1]) - 1, llm.engine.vocab_size)
        else:
            runner.greedy_screen = None  # the full logits' argmax
        tokens.append([list(o.token_ids) for o in llm.generate(batch, params)])
    # 4 rows a step: the kept head's fused path, the exact weight in bf16 too (above 4 rows a
    # bf16 x takes the bf16 panel, the weight rounded to bf16: a near tie may differ there)
    assert tokens[0] == tokens[1]


def test_screen_path_errors():
    weight = pack("Q8_0", random_rows("Q8_0", 16, 64, torch.Generator().manual_seed(0)), 64)
    xq, scales, _ = quantize_rows(torch.randn(2, 64))
    with pytest.raises(ValueError, match="path must be one of"):
        q8_0_screen(weight, xq, scales, path="fast")
    if not amx_int8_screen_available():
        with pytest.raises(ValueError, match="path='amx' needs a CPU with AMX tiles"):
            q8_0_screen(weight, xq, scales, path="amx")
    # auto takes the tiles where they run, and gives what that path gives
    want = "amx" if amx_int8_screen_available() else "vnni"
    assert torch.equal(q8_0_screen(weight, xq, scales),
                       q8_0_screen(weight, xq, scales, path=want))
