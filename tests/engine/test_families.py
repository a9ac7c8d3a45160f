"""Every family's greedy output equals transformers' (fp32, eager attention) token for token, with
prompts and generations longer than the sliding window, in every scheduling mode."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from tests.conftest import make_checkpoint

WINDOW = 12
PROMPT_LENS = (5, 30, 61, 3, 17)  # two cross the window in the prompt, all while generating
MAX_TOKENS = (25, 9, 14, 30, 20)

MODES = {
    "default": {},
    # 16-token chunks over 8-token blocks: chunks start inside a window and cross its edge
    "chunked-tiny-budget": {"max_num_batched_tokens": 16, "block_size": 8},
    "no-chunking": {"enable_chunked_prefill": False, "max_num_batched_tokens": 128},
    "preempt-tiny-kv": {"num_kv_blocks": 16, "block_size": 8, "max_num_batched_tokens": 32},
    "one-seq-at-a-time": {"max_num_seqs": 1},
    "plain-torch": {"attention_backend": "torch"},
    "triton": {"attention_backend": "triton", "max_num_batched_tokens": 32},
}
# The Triton kernels run interpreted here (~20 s a family): the family with every option on.
TRITON_FAMILIES = ("gemma2",)

_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
    "original_max_position_embeddings": 256,
}
FAMILIES = {
    "gemma2": ("gemma2", {
        "sliding_window": WINDOW, "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0, "tie": False,
    }),
    "gemma3": ("gemma3", {
        "sliding_window": WINDOW, "num_hidden_layers": 3, "tie": True,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
        },
    }),
    "phi3-longrope-window": ("phi3", {
        "sliding_window": WINDOW, "rope_scaling": _LONGROPE, "tie": False,
    }),
    "phi4-partial-rotary": ("phi3", {
        "partial_rotary_factor": 0.5, "tie": True,
        "rope_scaling": {**_LONGROPE, "short_factor": [1.0, 1.1, 1.2, 1.3],
                         "long_factor": [2.0, 2.5, 3.0, 3.5]},
    }),
    # Mistral-Nemo: head_dim 32 with hidden 64 and 4 heads (not hidden / heads), a window
    "mistral-nemo-heads-window": ("mistral", {
        "head_dim": 32, "sliding_window": WINDOW, "tie": False,
    }),
    "qwen2-yarn": ("qwen2", {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 128},
        "tie": True,
    }),
    "llama3.2-tied-llama3-rope": ("llama", {
        "tie": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
}


def hf_greedy(path, prompts, max_tokens) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            outs.append(ids[0, len(prompt):].tolist())
    return outs


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory):
    arch, kw = FAMILIES[request.param]
    kw = dict(kw)
    tie = kw.pop("tie")
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), arch, tie=tie, **kw)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return request.param, path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(reference, mode):
    name, path, prompts, expected = reference
    if mode == "triton" and name not in TRITON_FAMILIES:
        pytest.skip("interpreted Triton: one family covers the kernels' options")
    llm = LLM(str(path), dtype="float32", **MODES[mode])
    outs = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.get_stats()
    if mode.startswith("preempt"):
        assert stats.num_preemptions > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks  # nothing leaked


def test_prefix_hits_priorities_and_n_over_the_window(reference):
    """Shared prompts hit the prefix cache past the window; an urgent request preempts bulk ones
    by recompute; n=2 greedy samples both equal the reference."""
    _, path, prompts, expected = reference
    llm = LLM(str(path), dtype="float32", block_size=8, max_num_seqs=3,
              max_num_batched_tokens=24, num_kv_blocks=24)
    engine = llm.engine
    for i in (1, 2, 4):
        engine.add_request(f"bulk{i}", prompts[i], greedy(MAX_TOKENS[i]), priority=1)
    results = {}
    for _ in range(3):
        for out in engine.step():
            results[out.request_id] = out
    engine.add_request("repeat", prompts[2], greedy(MAX_TOKENS[2], n=2), priority=0)
    engine.add_request("job", prompts[0], greedy(MAX_TOKENS[0]), priority=0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
    for i in (1, 2, 4):
        assert results[f"bulk{i}"].token_ids == expected[i]
    assert results["job"].token_ids == expected[0]
    assert [o.token_ids for o in results["repeat"].outputs] == [expected[2]] * 2
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    assert results["repeat"].metrics.num_cached_tokens >= 48  # prompt 2's full blocks, cached
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_score_tokens_applies_the_final_soft_cap(tmp_path):
    """Gemma 2's full logits (sampling, logprobs, scoring) are the soft-capped ones."""
    arch, kw = FAMILIES["gemma2"]
    kw = dict(kw)
    tie = kw.pop("tie")
    path = make_checkpoint(tmp_path, arch, tie=tie, **kw)
    ids = list(range(3, 43))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], dim=-1)
    for backend in ("cpu", "torch"):
        llm = LLM(str(path), dtype="float32", attention_backend=backend)
        got = llm.engine.model_runner.score_tokens(ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert want.max() - want.min() < 2 * 3.0 + 1e-3  # capped logits span at most 2 * cap


@pytest.mark.parametrize("family", ["gemma3", "mistral-nemo-heads-window"])
def test_windowed_layers_hold_o_window_blocks(tmp_path, family):
    """Windowed layers keep only the blocks their window still reads (Gemma 3's local layers;
    every layer of a windowed Mistral): one long request never holds more than
    (window - 1 + chunk) / block_size + 1 of them, the full group's table covers the whole
    context (Gemma 3's global layers; bookkeeping only for Mistral), and everything returns to
    both pools."""
    arch, kw = FAMILIES[family]
    kw = dict(kw)
    tie = kw.pop("tie")
    path = make_checkpoint(tmp_path, arch, tie=tie, **kw)
    prompt = list(range(3, 80))
    want = hf_greedy(path, [prompt], [60])[0]
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=8)
    engine = llm.engine
    window = engine.scheduler.kv.window
    assert window is not None and window.window == WINDOW
    engine.add_request("long", prompt, greedy(60))
    bound = -(-(WINDOW - 1 + 8) // 4) + 1
    peak_window = peak_full = 0
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        request = engine.scheduler.requests.get("long")
        if request is not None:
            held = [b for b in request.window_block_ids if b != 0]
            peak_window = max(peak_window, len(held))
            peak_full = max(peak_full, len(request.block_ids))
            assert len(request.window_block_ids) == len(request.block_ids)
    assert out is not None and out.token_ids == want
    assert peak_window <= bound < peak_full == -(-(len(prompt) + 59) // 4)
    assert window.num_free_blocks == window.num_blocks
    stats = engine.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_sharded_safetensors_folder(reference, tmp_path):
    """The same weights re-saved as shards listed in model.safetensors.index.json."""
    name, path, prompts, expected = reference
    if name not in ("gemma3", "phi3-longrope-window"):
        pytest.skip("one Gemma and one fused-checkpoint family cover sharding")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    transformers.AutoTokenizer.from_pretrained(path).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    llm = LLM(str(sharded), dtype="float32")
    outs = llm.generate(prompts[:2], [greedy(n) for n in MAX_TOKENS[:2]])
    assert [o.token_ids for o in outs] == expected[:2]


def test_sinks_on_self_attention_match_the_reference_softmax():
    """``SelfAttention(use_sinks=True)``: the parameter is ``sinks`` (gpt-oss's HF name) and the
    torch and CPU-kernel paths give ``softmax([scores, sink])`` without the sink's column."""
    from engine.layers.attention import SelfAttention
    from engine.layers.rotary import RotaryEmbedding
    from engine.layers.torch_attention import TorchAttentionBackend, attend_ref
    from engine.runner.input_batch import StepRow, build_input_batch

    torch.manual_seed(0)
    rotary = RotaryEmbedding(16, 64, {"rope_theta": 10000.0})
    layer = SelfAttention(32, 4, 2, 16, rotary, use_sinks=True).eval()
    assert "sinks" in dict(layer.named_parameters())
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([-1.0, 0.5, 2.0, 4.0]))
    hidden = torch.randn(9, 32)
    positions = torch.arange(9)
    want = None
    for use_kernel in (False, True):
        k_cache = torch.zeros(4, 4, 2, 16)
        v_cache = torch.zeros(4, 4, 2, 16)
        backend = TorchAttentionBackend(4, use_cpu_kernel=use_kernel)
        # a 9-token prefill, then the same tokens decoded one at a time after an 8-token prefill
        rows = [StepRow(list(range(9)), [0, 1, 2], None, 0, 9, True)]
        batch = build_input_batch(rows, 4, torch.device("cpu"))
        with torch.no_grad():
            out = layer(positions, hidden, (k_cache, v_cache), backend, batch.metadata)
            decode = build_input_batch([StepRow(list(range(9)), [0, 1, 2], None, 8, 1, True)],
                                       4, torch.device("cpu"))
            last = layer(positions[8:], hidden[8:], (k_cache, v_cache), backend,
                         decode.metadata)
            qkv = layer.qkv_proj(hidden)
            q, k, v = qkv.split([64, 32, 32], dim=-1)
            q = rotary.rotate(positions, q.reshape(9, 4, 16))
            k = rotary.rotate(positions, k.reshape(9, 2, 16))
            mask = torch.ones(9, 9, dtype=torch.bool).tril()
            ref = attend_ref(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                             v.reshape(9, 2, 16).transpose(0, 1)[None], mask, 16**-0.5,
                             None, layer.sinks)
            want = layer.o_proj(ref[0].transpose(0, 1).reshape(9, 64))
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last, want[8:], atol=1e-5, rtol=1e-5)
