"""Sampler and stopping behaviour through the real engine on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.outputs import RequestMetrics
from engine.runner.sampler import Sampler
from engine.runner.sampling_columns import SamplingColumns


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir))


def prompt_ids(llm, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, llm.engine.model_runner.vocab_size, (n,), generator=g).tolist()


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt_ids(llm)], params)[0].token_ids
    others = [prompt_ids(llm, 20, seed=s) for s in range(1, 6)]
    noisy = SamplingParams(temperature=1.3, max_tokens=16, ignore_eos=True)
    batch = llm.generate(others[:3] + [prompt_ids(llm)] + others[3:], [noisy] * 3 + [params]
                         + [noisy] * 2)
    assert batch[3].token_ids == alone
    # A different seed gives a different sample (16 tokens from a ~400-token vocabulary).
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([prompt_ids(llm)], other)[0].token_ids != alone


def test_n_samples_share_prompt_blocks_and_differ(llm):
    prompt = prompt_ids(llm, 70)
    engine = llm.engine
    before = engine.get_stats().prefix_cache_hits
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10,
                                                ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Siblings 1..3 reuse sibling 0's full prompt blocks (70 tokens -> 4 blocks of 16).
    assert engine.get_stats().prefix_cache_hits - before >= 3 * 64
    assert out.metrics.num_generated_tokens == 40


def test_stop_strings_are_cut_and_stop_tokens_end(llm):
    prompt = prompt_ids(llm)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                 ignore_eos=True))[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert free.token_ids[: len(out.token_ids)] == out.token_ids
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                 include_stop_str_in_output=True,
                                                 ignore_eos=True))[0]
    assert kept.text == text[: text.index(stop) + len(stop)]

    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_max_tokens_min_tokens_and_eos(llm):
    prompt = prompt_ids(llm)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    # Make EOS the greedy choice: whatever greedy picks first becomes the "eos".
    first = out.token_ids[0]
    eng = llm.engine
    saved = eng.eos_token_ids
    eng.eos_token_ids = (first,)
    try:
        stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5))[0]
        assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
        held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5,
                                                     min_tokens=3))[0]
        assert first not in held.token_ids[:3] and len(held.token_ids) >= 3
    finally:
        eng.eos_token_ids = saved


def test_logprobs_are_normalized_and_ranked(llm):
    out = llm.generate([prompt_ids(llm)], SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                         ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 4
    for lp, tok in zip(lps, out.token_ids, strict=True):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))
        assert lp.logprob <= 0


def test_abort_returns_partial_output_and_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("long", prompt_ids(llm), SamplingParams(temperature=0, max_tokens=200,
                                                               ignore_eos=True))
    for _ in range(3):
        engine.step()
    (out,) = engine.abort_request("long")
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 200
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_bad_prompts_are_refused_clearly(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        engine.add_request("b", [5] * engine.max_model_len, SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("c", [10**9], SamplingParams())
    engine.add_request("d", [5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("d", [5, 6], SamplingParams(max_tokens=1))
    engine.abort_request("d")


def test_invalid_sampling_values_name_the_field():
    for kwargs, field in [
        ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"min_p": 2}, "min_p"),
        ({"presence_penalty": float("inf")}, "presence_penalty"), ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"), ({"stop": [""]}, "stop"),
        ({"temperature": float("nan")}, "temperature"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def make_request(output: list[int], prompt: list[int], **params) -> Request:
    req = Request("r", prompt, SamplingParams(**params), 10, (), RequestMetrics(0.0))
    for t in output:
        req.append_token(t)
    return req


def test_penalties_match_the_textbook_formulas():
    sampler = Sampler(vocab_size=6, seed=0)
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    req = make_request([3, 3, 2], [1], temperature=0, repetition_penalty=2.0,
                       presence_penalty=0.5, frequency_penalty=0.25)
    out = sampler._apply_penalties(logits, [req], SamplingColumns.of([req]))[0][0]
    # token 1 (prompt, negative): *2; token 2 (output once, positive): /2 - 0.25 - 0.5;
    # token 3 (output twice): /2 - 0.5 - 0.5; others untouched.
    expected = torch.tensor([2.0, -2.0, 0.25 - 0.75, 1.5 - 1.0, -2.0, 1.0])
    torch.testing.assert_close(out, expected)


def test_top_k_top_p_min_p_restrict_the_support():
    sampler = Sampler(vocab_size=5, seed=0)
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]])).repeat(200, 1)
    for params, allowed in [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.7}, {0, 1}),
        ({"min_p": 0.25}, {0, 1, 2}),
    ]:
        reqs = [make_request([], [1], temperature=1.0, **params) for _ in range(200)]
        ids, _ = sampler(logits, reqs)
        assert set(ids) <= allowed and len(set(ids)) > 1
