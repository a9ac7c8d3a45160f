"""Sampler on hand-made logits: the draw follows the truncated distribution, whatever path a row
takes (candidates, wider candidates, a sort, the whole vocabulary), and a seeded row's tokens do
not depend on the rest of the batch."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import engine.runner.draw as draw_module
from engine import SamplingParams
from engine.core.request import Request
from engine.outputs import RequestMetrics
from engine.runner.sampler import Sampler, row_argmax, seeded_uniforms
from engine.runner.sampling_columns import SamplingColumns

NUM_DRAWS = 20_000


def request(seed: int | None = None, prompt: list[int] | None = None,
            output: list[int] | None = None, **params: Any) -> Request:
    req = Request("r", prompt or [1], SamplingParams(**params), 10, (), RequestMetrics(0.0),
                  seed=seed)
    for t in output or []:
        req.append_token(t)
    return req


def expected_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The definition, in float64 on the whole row: top-k keeps the tokens at or above the k-th
    value; top-p the smallest prefix (descending) whose mass reaches top_p, and the tokens tied
    with its last; min-p the tokens at or above min_p times the top probability."""
    scaled = logits.double() / temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if top_k is not None:
        keep &= scaled >= scaled.sort(descending=True).values[top_k - 1]
    probs = torch.where(keep, scaled, float("-inf")).softmax(-1)
    if top_p < 1.0:
        desc = probs.sort(descending=True).values
        num_nucleus = int(((desc.cumsum(0) - desc) < top_p).sum())
        keep &= probs >= desc[num_nucleus - 1]
    probs = torch.where(keep, probs, 0.0)
    keep &= probs >= probs.max() * min_p
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def within(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Counts of draws agree with ``probs``: no draw of a dropped token, and every token expected
    20+ times (the rest pooled in one bin) within 5 binomial standard deviations, which a right
    sampler misses with probability under 1e-5 for these few dozen bins."""
    if counts[probs == 0].sum() > 0:
        return False
    num_draws = counts.sum()
    big = probs * num_draws >= 20
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    bins = torch.cat([probs[big], probs[~big].sum()[None]])
    sd = (num_draws * bins * (1 - bins)).sqrt()
    return bool(((observed - num_draws * bins).abs() <= 5 * sd + 1).all())


def draw(logits: torch.Tensor, num_draws: int = NUM_DRAWS, **params: Any) -> torch.Tensor:
    """Counts of ``num_draws`` draws from one row of logits (a batch of identical rows)."""
    vocab = logits.shape[-1]
    ids, _ = Sampler(vocab, seed=0)(logits.expand(num_draws, vocab),
                                    [request(**params) for _ in range(num_draws)])
    return torch.bincount(torch.tensor(ids), minlength=vocab).double()


def eight_heavy(vocab: int = 1024, seed: int = 0) -> torch.Tensor:
    """Eight tokens at known probabilities (0.9 of the mass) at scattered ids; the rest share
    0.1 with slowly falling, distinct logits."""
    heavy = torch.tensor([0.28, 0.2, 0.14, 0.1, 0.08, 0.05, 0.03, 0.02])
    tail = torch.linspace(0.0, -1.0, vocab - 8).exp()
    probs = torch.cat([heavy, 0.1 * tail / tail.sum()])
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    return probs[order].log()


@pytest.mark.parametrize("params", [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.0, "min_p": 0.3},
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 1.3, "top_k": 600},  # past a quarter of the vocabulary: a sort
    {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 1.0, "top_p": 0.95},  # the nucleus is 394 tokens: a sort
    {"temperature": 0.8, "top_k": 5, "top_p": 0.7},
    {"temperature": 1.0, "top_k": 5, "top_p": 0.8, "min_p": 0.4},
    {"temperature": 1.0, "top_p": 0.83, "min_p": 0.05},
], ids=str)
def test_draws_follow_the_truncated_distribution(params):
    logits = eight_heavy()
    probs = expected_probs(logits, **params)
    assert within(draw(logits, **params), probs)


def test_rows_with_different_min_p_share_a_batch():
    logits = eight_heavy()
    min_ps = [0.3, 0.0, 0.12] * (NUM_DRAWS // 3)
    ids, _ = Sampler(1024, seed=0)(logits.expand(len(min_ps), 1024),
                                   [request(min_p=m) for m in min_ps])
    for min_p in (0.3, 0.0, 0.12):
        mine = torch.tensor([t for t, m in zip(ids, min_ps, strict=True) if m == min_p])
        counts = torch.bincount(mine, minlength=1024).double()
        assert within(counts, expected_probs(logits, min_p=min_p))


@pytest.mark.parametrize("params", [
    {"temperature": 1.0}, {"temperature": 1.0, "top_k": 4}, {"temperature": 1.0, "top_p": 0.7},
    {"temperature": 0.5, "min_p": 0.1},
], ids=str)
def test_masked_tokens_are_never_drawn(params):
    # As a grammar or min_tokens leaves them: the top token and most of the tail ruled out.
    logits = eight_heavy()
    logits[logits.argmax()] = float("-inf")
    logits[torch.randperm(1024, generator=torch.Generator().manual_seed(8))[:900]] = float("-inf")
    probs = expected_probs(logits, **params)
    assert within(draw(logits, **params), probs)


def test_the_check_rejects_a_wrong_truncation():
    logits = eight_heavy()
    counts = draw(logits, top_p=0.6)
    assert within(counts, expected_probs(logits, top_p=0.6))
    # Stopping one token short of top_p, or not truncating at all, is caught.
    assert not within(counts, expected_probs(logits, top_p=0.45))
    assert not within(counts, expected_probs(logits))
    # So is a missing temperature.
    assert not within(draw(logits, temperature=0.7), expected_probs(logits))


def test_top_k_and_top_p_keep_ties():
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 0.0, -1.0]])
    counts = draw(logits[0], top_k=3)
    assert set(counts.nonzero().squeeze(1).tolist()) == {0, 1, 2, 3, 4}
    assert within(counts, expected_probs(logits[0], top_k=3))
    # The nucleus reaches 0.5 on the first of three equal tokens: all three stay.
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])
    counts = draw(probs.log(), top_p=0.5)
    assert within(counts, probs)


def record_widths(monkeypatch) -> list[int]:
    widths: list[int] = []
    candidates = draw_module._candidates

    def spy(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        widths.append(width)
        return candidates(logits, width)

    monkeypatch.setattr(draw_module, "_candidates", spy)
    return widths


def test_ties_past_the_candidates_fall_back_to_a_sort(monkeypatch):
    # top_k=60 is cut from 64 candidates, but the 60th value is shared by 20 tokens (56th..75th).
    values = torch.cat([torch.linspace(9.0, 6.0, 55), torch.full((20,), 5.0),
                        torch.linspace(4.0, -4.0, 1024 - 75)])
    logits = values[torch.randperm(1024, generator=torch.Generator().manual_seed(1))]
    widths = record_widths(monkeypatch)
    counts = draw(logits, top_k=60)
    assert widths == [64, 1024]
    assert int((counts > 0).sum()) == 75
    assert within(counts, expected_probs(logits, top_k=60))


@pytest.mark.parametrize(("top_p", "path"), [
    (0.6, [256]),  # the nucleus is 117 tokens
    (0.8, [256, 1024]),  # 692
    (0.9, [256, 1024, 4096]),  # 1,683: a sort
])
def test_a_wide_nucleus_moves_to_wider_candidates(monkeypatch, top_p, path):
    vocab = 4096
    monkeypatch.setattr(draw_module, "RETRY_WIDTH", 1024)
    probs = 1 / torch.arange(1, vocab + 1, dtype=torch.float64)  # Zipf
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))
    logits = (probs[order] / probs.sum()).log().float()
    widths = record_widths(monkeypatch)
    counts = draw(logits, num_draws=5000, top_p=top_p)
    assert widths == path
    assert within(counts, expected_probs(logits, top_p=top_p))


def seeded_tokens(rows: list[tuple[torch.Tensor, Request]], at: int, steps: int = 25) -> list[int]:
    """The tokens row ``at`` gets over ``steps`` calls on the batch ``rows``."""
    logits = torch.stack([x for x, _ in rows])
    reqs = [r for _, r in rows]
    sampler = Sampler(logits.shape[-1], seed=123)
    return [sampler(logits, reqs)[0][at] for _ in range(steps)]


@pytest.mark.parametrize("params", [
    {"temperature": 1.0},
    {"temperature": 0.9, "min_p": 0.1},
    {"temperature": 1.0, "top_k": 20},
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 1.0, "top_p": 0.99},  # falls back to a sort
    {"temperature": 1.2, "top_k": 50, "top_p": 0.9, "min_p": 0.02},
], ids=str)
def test_a_seeded_row_does_not_depend_on_the_batch(params):
    vocab = 2048
    g = torch.Generator().manual_seed(5)
    mine = torch.randn(vocab, generator=g) * 2
    others = torch.randn(6, vocab, generator=g) * 3

    def seeded() -> Request:
        return request(2024, **params)

    alone = seeded_tokens([(mine, seeded())], at=0)
    assert len(set(alone)) > 1
    neighbours = [
        request(temperature=0),
        request(temperature=0.7, logprobs=2),
        request(temperature=1.0, top_k=1500),  # a sort
        request(temperature=1.0, top_p=0.999),  # falls back
        request(7, **params),
        request(temperature=1.0, top_k=3, repetition_penalty=1.3, output=[5, 6]),
    ]
    for at in (0, 3, 6):
        rows = list(zip(others, neighbours, strict=True))
        rows.insert(at, (mine, seeded()))
        assert seeded_tokens(rows, at) == alone
    # Another seed draws something else.
    other = seeded_tokens([(mine, request(9, **params))], at=0)
    assert other != alone


def thirty_tied(vocab: int = 2048) -> torch.Tensor:
    """Thirty tokens tied on top (topk and sort list them in different orders), the rest below."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(vocab, generator=g).clamp(max=1.0)
    logits[torch.randperm(vocab, generator=g)[:30]] = 2.0
    return logits


@pytest.mark.parametrize(("logits", "params"), [
    (eight_heavy(2048, seed=3), {"top_p": 0.75}),
    (eight_heavy(2048, seed=3), {"top_k": 40, "top_p": 0.97}),
    (thirty_tied(), {"top_k": 20}),  # keeps the 30 tied
    (thirty_tied(), {"top_p": 0.2}),
], ids=["top_p", "top_k top_p", "top_k ties", "top_p ties"])
def test_the_draw_does_not_depend_on_the_candidate_width(monkeypatch, logits, params):
    logits = logits[None].expand(200, 2048)

    def tokens() -> list[int]:
        reqs = [request(i, **params) for i in range(200)]
        return Sampler(2048, seed=0)(logits, reqs)[0]

    narrow = tokens()
    assert len(set(narrow)) >= 5
    monkeypatch.setattr(draw_module, "TOP_P_WIDTH", 2048)
    monkeypatch.setattr(draw_module, "MIN_WIDTH", 2048)
    assert tokens() == narrow  # every row cut from a sort of the whole row


def test_mixed_batch_greedy_sampled_and_logprobs():
    vocab = 300
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, vocab, generator=g) * 2
    logits[1, 7] = 50.0  # a sampled row with one overwhelming token
    logits[4, :] = float("-inf")
    logits[4, [3, 9]] = torch.tensor([1.0, 0.5])
    reqs = [
        request(temperature=0, logprobs=3),
        request(temperature=1.0, top_k=10, logprobs=0),
        request(temperature=0),
        request(1, temperature=0.8, top_p=0.9, logprobs=400),
        request(temperature=1.0, logprobs=5),
    ]
    ids, logprobs = Sampler(vocab, 0)(logits.clone(), reqs)
    assert ids[0] == int(logits[0].argmax()) and ids[2] == int(logits[2].argmax())
    assert ids[1] == 7 and ids[4] in (3, 9)
    assert logprobs[2] is None
    reference = torch.log_softmax(logits, dim=-1)
    for row, num_top in ((0, 3), (1, 0), (3, vocab), (4, 2)):
        lp = logprobs[row]
        assert lp is not None and lp.token_id == ids[row]
        assert lp.logprob == pytest.approx(float(reference[row, ids[row]]))
        assert len(lp.top) == num_top  # -inf tokens are never listed
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for token, value in lp.top:
            assert value == pytest.approx(float(reference[row, token]))
    assert {t for t, _ in logprobs[4].top} == {3, 9}


def test_penalties_apply_per_row():
    sampler = Sampler(vocab_size=6, seed=0)
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]).repeat(4, 1)
    reqs = [
        request(prompt=[1, 40], output=[3, 3, 2, 99], temperature=0, repetition_penalty=2.0,
                presence_penalty=0.5, frequency_penalty=0.25),
        request(output=[0], temperature=0),  # no penalty: untouched
        request(prompt=[5, 5], output=[], temperature=0, repetition_penalty=0.5),
        request(prompt=[4], output=[0, 0, 0], temperature=0, frequency_penalty=1.0),
    ]
    out, _ = sampler._apply_penalties(logits, reqs, SamplingColumns.of(reqs))
    expected = torch.tensor([
        [2.0, -2.0, 0.25 - 0.75, 1.5 - 1.0, -2.0, 1.0],
        [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
        [2.0, -1.0, 0.5, 3.0, -2.0, 2.0],
        [2.0 - 3.0, -1.0, 0.5, 3.0, -2.0, 1.0],
    ])
    torch.testing.assert_close(out, expected)


def test_min_tokens_bans_stop_and_eos_per_row():
    sampler = Sampler(vocab_size=6, seed=0)
    logits = torch.zeros(3, 6)
    reqs = [
        Request("a", [1], SamplingParams(min_tokens=2, stop_token_ids=[4, 9]), 10, (5,),
                RequestMetrics(0.0)),
        Request("b", [1], SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[2]), 10,
                (5,), RequestMetrics(0.0)),
        Request("c", [1], SamplingParams(min_tokens=0, stop_token_ids=[3]), 10, (5,),
                RequestMetrics(0.0)),
    ]
    out = sampler._apply_min_tokens(logits, reqs, SamplingColumns.of(reqs))
    assert (out == float("-inf")).nonzero().tolist() == [[0, 4], [0, 5], [1, 2]]
    assert math.isfinite(float(logits.sum()))  # the caller's logits are left alone


def test_row_argmax_is_torchs_on_ties_nans_infinities_and_strided_rows():
    """numpy's argmax on host fp32 logits picks what torch's does: the first of equal maxima,
    a NaN over any number."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        num_rows, vocab = torch.randint(0, 40, (2,), generator=g).tolist()
        logits = torch.randint(-3, 3, (num_rows, vocab + 4), generator=g).float()
        u = torch.rand(logits.shape, generator=g)
        logits[u < 0.05] = float("nan")
        logits[(u > 0.05) & (u < 0.1)] = float("-inf")
        logits[u > 0.97] = float("inf")
        rows = logits[:, : vocab + 1]  # a padded vocabulary's view: not contiguous
        with torch.inference_mode():
            assert torch.equal(row_argmax(rows), rows.argmax(-1))
    bf16 = torch.randn(8, 50).bfloat16()
    assert torch.equal(row_argmax(bf16), bf16.argmax(-1))


def test_seeded_uniforms_are_splitmix64_streams_uniform_and_independent():
    # SplitMix64's reference: seeded with mix(seed + golden), output k is mix(state + k*golden)
    # (its first outputs from seed 0, by the published C code, start 0xE220A8397B1DCDAF).
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        return z ^ (z >> 31)

    golden = 0x9E3779B97F4A7C15
    assert mix(golden) == 0xE220A8397B1DCDAF
    for seed in (0, 1, 2**63 + 5):
        state = mix((seed + golden) & (2**64 - 1))
        expected = [(mix((state + (k + 1) * golden) & (2**64 - 1)) >> 11) * 2.0**-53
                    for k in range(4)]
        got = seeded_uniforms(np.full(4, seed, dtype=np.uint64), np.arange(4, dtype=np.uint64))
        assert got.tolist() == expected
    # 1,000 seeds x 200 draws: uniform on [0, 1) (a 20-bin chi-square far under its 0.1%
    # point, 43.8), and neighbouring seeds' streams uncorrelated.
    seeds = np.repeat(np.arange(1000, dtype=np.uint64), 200)
    draws = seeded_uniforms(seeds, np.tile(np.arange(200, dtype=np.uint64), 1000))
    assert draws.min() >= 0.0 and draws.max() < 1.0
    counts = np.histogram(draws, bins=20, range=(0.0, 1.0))[0]
    expected_count = draws.size / 20
    assert ((counts - expected_count) ** 2 / expected_count).sum() < 43.8
    streams = draws.reshape(1000, 200)
    assert abs(np.corrcoef(streams[:-1].ravel(), streams[1:].ravel())[0, 1]) < 0.01


def test_a_seeded_request_takes_the_next_draw_of_its_stream_each_token():
    sampler = Sampler(vocab_size=8, seed=0)
    reqs = [request(41, temperature=1.0), request(temperature=1.0), request(42, temperature=1.0)]
    for step in range(3):
        uniforms = sampler._uniforms(reqs, SamplingColumns.of(reqs))
        assert uniforms[[0, 2]].tolist() == seeded_uniforms(
            np.array([41, 42], dtype=np.uint64), np.array([step, step], dtype=np.uint64)).tolist()
        sampler(torch.zeros(3, 8), reqs)  # a draw: the seeded rows' streams move on
    assert [r.num_drawn for r in reqs] == [3, 0, 3]
    # A negative seed is its low 64 bits.
    negative = request(-1, temperature=1.0)
    got = sampler._uniforms([negative], SamplingColumns.of([negative]))
    assert got.tolist() == seeded_uniforms(np.array([2**64 - 1], dtype=np.uint64),
                                           np.zeros(1, dtype=np.uint64)).tolist()
