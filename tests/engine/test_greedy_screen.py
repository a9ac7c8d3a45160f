"""GreedyScreen: the argmax of fp32 logits from a bf16 screen, exactly."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.device import bf16_is_native
from engine.runner.greedy_screen import GreedyScreen


def dot_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fp32 argmax computed the way the screen computes its candidates' logits."""
    return (hidden[:, None, :] * weight[None]).sum(-1).argmax(dim=1)


@pytest.mark.parametrize("scale", [0.02, 1.0, 30.0])
def test_matches_the_fp32_argmax_on_random_logits(scale):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(3000, 96, generator=g) * scale
    hidden = torch.randn(40, 96, generator=g) * 5
    screen = GreedyScreen(weight)
    assert torch.equal(screen.argmax(hidden), dot_argmax(hidden, weight))
    assert torch.equal(screen.argmax(hidden), (hidden @ weight.T).argmax(dim=1))


def test_near_ties_below_bf16_resolution_are_settled_in_fp32():
    """Rivals 1e-4 apart (bf16 resolves ~4e-3): a bf16 argmax alone gets these wrong."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 128, generator=g)
    weight = torch.randn(500, 128, generator=g) * 0.05
    for r in range(64):  # plant, per row, a winner and a rival just below it
        direction = hidden[r] / hidden[r].norm() ** 2
        weight[2 * r] = direction * (10.0 - 1e-4 * (r % 2))
        weight[2 * r + 1] = direction * (10.0 - 1e-4 * ((r + 1) % 2))
    screen = GreedyScreen(weight)
    want = dot_argmax(hidden, weight)
    assert torch.equal(screen.argmax(hidden), want)
    bf16_only = (hidden.bfloat16() @ weight.bfloat16().T).float().argmax(dim=1)
    assert not torch.equal(bf16_only, want)  # the case is hard for bf16 alone


def test_exact_ties_go_to_the_lowest_token_id_like_argmax():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(200, 32, generator=g)
    for row in (150, 7, 90):  # three identical best rows
        weight[row] = 3.0
    hidden = torch.ones(3, 32)
    assert GreedyScreen(weight).argmax(hidden).tolist() == [7, 7, 7]


def test_the_error_bound_holds():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(2000, 576, generator=g) * 0.1
    hidden = torch.randn(32, 576, generator=g) * 4
    screen = GreedyScreen(weight)
    approx = screen._screen_bf16(hidden.bfloat16()).float()
    exact = hidden.double() @ weight.double().T
    bound = hidden.norm(dim=1, keepdim=True) * screen.relative * screen.row_norms
    bound = bound + approx.abs() * screen.output_rounding
    assert ((approx.double() - exact).abs() <= bound.double()).all()


def test_empty_and_wrong_inputs():
    screen = GreedyScreen(torch.randn(10, 8))
    assert screen.argmax(torch.empty(0, 8)).shape == (0,)
    with pytest.raises(ValueError, match="float32"):
        GreedyScreen(torch.randn(10, 8, dtype=torch.float64))


@pytest.mark.skipif(not bf16_is_native(), reason="no bf16 units: the engine keeps the fp32 head")
def test_engine_uses_the_screen_for_greedy_rows_only(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu")
    runner = llm.engine.model_runner
    assert runner.greedy_screen is not None
    calls = {"screen": 0, "full": 0}
    screen_argmax, full_logits = runner.greedy_screen.argmax, runner.model.compute_logits

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += args[0].shape[0]
            return fn(*args)
        return wrapper

    runner.greedy_screen.argmax = counted("screen", screen_argmax)
    runner.model.compute_logits = counted("full", full_logits)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=4),
                           SamplingParams(temperature=0.8, seed=1, max_tokens=4)])
    assert calls == {"screen": 4, "full": 4}
    # logprobs need the full distribution: that greedy row is not screened
    calls.update(screen=0, full=0)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    assert calls == {"screen": 0, "full": 3}


@pytest.mark.parametrize("scale", [0.02, 0.3, 30.0])
def test_bf16_weights_give_the_fp32_argmax_of_their_values(scale):
    """A bf16 model's screen (the C++ candidate pass where it is built): the argmax of the fp32
    products of its bf16 values."""
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(3001, 96, generator=g) * scale).bfloat16()
    hidden = (torch.randn(40, 96, generator=g) * 4).bfloat16()
    got = GreedyScreen(weight).argmax(hidden)
    assert torch.equal(got, dot_argmax(hidden.float(), weight.float()))

