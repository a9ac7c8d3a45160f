"""Greedy outputs equal Hugging Face transformers' token for token, in every scheduling mode."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from tests.conftest import make_checkpoint

PROMPT_LENS = (5, 17, 33, 64, 3, 100, 41, 9)
MAX_TOKENS = (20, 7, 30, 12, 40, 25, 16, 33)

MODES = {
    "default": {},
    "chunked-tiny-budget": {"max_num_batched_tokens": 16},
    "no-chunking": {"enable_chunked_prefill": False, "max_num_batched_tokens": 128},
    "preempt-tiny-kv": {"num_kv_blocks": 20, "block_size": 8, "max_num_batched_tokens": 32},
    "preempt-no-prefix-cache": {
        "num_kv_blocks": 17, "block_size": 8, "enable_prefix_caching": False,
    },
    "one-seq-at-a-time": {"max_num_seqs": 1},
    "block-size-32": {"block_size": 32},
    # stock torch everywhere: F.linear, gather + SDPA attention, full fp32 output projection
    "plain-torch": {"attention_backend": "torch"},
}

ARCHS = {
    "llama-gqa-untied": ("llama", {"tie": False}),
    "llama-mha-tied": ("llama", {"tie": True, "num_key_value_heads": 4}),
    "qwen2-bias-tied": ("qwen2", {"tie": True}),
    "qwen3-qknorm": ("qwen3", {"tie": False}),
    "mistral": ("mistral", {"tie": False}),
    "llama3-rope": (
        "llama",
        {
            "tie": False,
            "rope_scaling": {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
            },
        },
    ),
}


def hf_greedy(path, prompts, max_tokens) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # ignore_eos: EOS may be chosen but never stops (min_new_tokens would instead forbid it).
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
            )
            outs.append(ids[0, len(prompt):].tolist())
    return outs


def make_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=list(ARCHS))
def reference(request, tmp_path_factory):
    arch, kw = ARCHS[request.param]
    kw = dict(kw)
    tie = kw.pop("tie")
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), arch, tie=tie, **kw)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = make_prompts(vocab)
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(reference, mode):
    path, prompts, expected = reference
    llm = LLM(str(path), dtype="float32", **MODES[mode])
    outs = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    for out, ref in zip(outs, expected, strict=True):
        assert out.token_ids == ref
    stats = llm.engine.get_stats()
    if mode.startswith("preempt"):
        assert stats.num_preemptions > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks  # nothing leaked
    assert stats.num_running == stats.num_waiting == 0


def test_prefix_cache_hits_and_requests_added_while_others_decode(tiny_model_dir):
    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, vocab, (48,), generator=g).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 9, 20)]
    prompts.append(list(prompts[0]))  # an exact repeat
    max_tokens = [12, 18, 9, 12]
    expected = hf_greedy(tiny_model_dir, prompts, max_tokens)

    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=8, max_num_batched_tokens=24)
    engine = llm.engine
    engine.add_request("r0", prompts[0], greedy(max_tokens[0]))
    results = {}
    pending = list(range(1, 4))
    steps = 0
    while engine.has_unfinished_requests() or pending:
        # One new request every few steps, joining requests already decoding.
        if pending and steps % 3 == 2:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], greedy(max_tokens[i]))
        for out in engine.step():
            results[out.request_id] = out
        steps += 1
    for i, ref in enumerate(expected):
        assert results[f"r{i}"].token_ids == ref
    stats = engine.get_stats()
    assert stats.prefix_cache_hits >= 3 * 48  # the shared 48-token prefix, at least
    assert results["r3"].metrics.num_cached_tokens >= 48
    assert max(stats.batch_size_hist) >= 2
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_bf16_runs_and_mostly_agrees(tiny_model_dir):
    llm32 = LLM(str(tiny_model_dir), dtype="float32")
    llm16 = LLM(str(tiny_model_dir), dtype="bfloat16")
    prompts = make_prompts(llm32.engine.model_runner.vocab_size)[:4]
    a = llm32.generate(prompts, greedy(8))
    b = llm16.generate(prompts, greedy(8))
    assert all(len(o.token_ids) == 8 for o in b)
    # bf16 rounds differently; the first greedy token should still agree on most prompts.
    assert sum(x.token_ids[0] == y.token_ids[0] for x, y in zip(a, b, strict=True)) >= 3


SHARED_PREFIX_MODES = {
    "default": {},
    "chunked-tiny-budget": {"max_num_batched_tokens": 16},
    "preempt-tiny-kv": {"num_kv_blocks": 12, "max_num_batched_tokens": 32},
}


@pytest.fixture(scope="module")
def shared_prefix_reference(tiny_model_dir):
    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, vocab, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=g).tolist()
               for n in (2, 7, 1, 12, 5)]
    prompts.append(shared[:24] + torch.randint(3, vocab, (6,), generator=g).tolist())
    prompts.append(list(prompts[3]))  # an exact repeat: waits for its sixth block too
    max_tokens = [10, 14, 6, 9, 12, 8, 14]
    return prompts, max_tokens, hf_greedy(tiny_model_dir, prompts, max_tokens)


@pytest.mark.parametrize("mode", list(SHARED_PREFIX_MODES))
def test_same_step_shared_prefix_is_computed_once_and_exact(
    tiny_model_dir, shared_prefix_reference, mode
):
    prompts, max_tokens, expected = shared_prefix_reference
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=8,
              **SHARED_PREFIX_MODES[mode])
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens])  # all added before step 1
    for out, ref in zip(outs, expected, strict=True):
        assert out.token_ids == ref
    stats = llm.engine.get_stats()
    assert llm.engine.scheduler.num_prefix_holds > 0
    if mode.startswith("preempt"):
        assert stats.num_preemptions > 0
    else:
        # Every sharer waits for the first one's 5 full shared blocks, then hits them.
        assert [o.metrics.num_cached_tokens for o in outs] == [0, 40, 40, 40, 40, 24, 48]
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert llm.engine.scheduler.kv.in_flight == {}


@pytest.mark.parametrize("urgent_bulk_tokens", [None, 5])
def test_urgent_request_preempts_bulk_and_all_stay_exact(tiny_model_dir, shared_prefix_reference,
                                                         urgent_bulk_tokens):
    # A cap of 5 cuts the bulk prompts into chunks that straddle the 8-token blocks.
    prompts, max_tokens, expected = shared_prefix_reference
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=8, max_num_seqs=3,
              max_num_batched_tokens=24,
              urgent_bulk_tokens=urgent_bulk_tokens)
    engine = llm.engine
    for bad in ("high", 1.5, True):
        with pytest.raises(ValueError, match="priority"):
            engine.add_request("bad", prompts[0], greedy(1), priority=bad)  # type: ignore[arg-type]
    for i in range(len(prompts) - 1):
        engine.add_request(f"bulk{i}", prompts[i], greedy(max_tokens[i]), priority=1)
    results = {}
    for _ in range(4):
        for out in engine.step():
            results[out.request_id] = out
    last = len(prompts) - 1
    engine.add_request("job", prompts[last], greedy(max_tokens[last]), priority=0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
    assert results["job"].token_ids == expected[last]
    for i in range(last):
        assert results[f"bulk{i}"].token_ids == expected[i]
    assert engine.get_stats().num_preemptions > 0
    assert sum(r.metrics.num_preemptions for r in results.values()) > 0
    assert engine.get_stats().num_free_kv_blocks == engine.get_stats().num_kv_blocks
