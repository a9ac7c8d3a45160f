"""Tensor parallel on the CPU (gloo, two processes): TP=2's greedy output equals TP=1's token for
token (fp32) with chunked prefill, prefix hits and preemption in one run, for a Llama (KV heads
split), a Qwen3 (one KV head: replicated) and a windowed Mistral; a helper rank killed mid-step,
or stuck, makes ``step`` raise ``RankFailure`` and leaves no process behind; the shard slices and
the step messages as pure bookkeeping."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.distributed.group import RankFailure
from engine.distributed.runner import TPModelRunner
from engine.distributed.sharding import ShardPlan
from tests.conftest import make_checkpoint

# Chunks of 16 tokens over 8-token blocks, a cache small enough to preempt.
SCHEDULE = {"max_num_batched_tokens": 16, "block_size": 8, "num_kv_blocks": 14,
            "dtype": "float32", "num_threads": 1}
MAX_TOKENS = (12, 20, 9, 16, 14)


@pytest.fixture(autouse=True)
def never_hang():
    """A hung collective fails the run (with every thread's stack) instead of stalling CI."""
    faulthandler.dump_traceback_later(150, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, vocab, (24,), generator=g).tolist()  # three full blocks
    tails = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 11, 2, 30, 7)]
    return [shared + tail if i % 2 == 0 else tail + shared for i, tail in enumerate(tails)]


def run(path, tp: int, **options) -> tuple[list[list[int]], object, torch.Tensor]:
    llm = LLM(str(path), tensor_parallel_size=tp, **SCHEDULE, **options)
    runner = llm.engine.model_runner
    assert isinstance(runner, TPModelRunner) == (tp > 1)
    try:
        vocab = llm.engine.vocab_size
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in MAX_TOKENS]
        # n > 1 sampled from the gathered logits: its children share the prompt's blocks
        params[1] = SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True,
                                   max_tokens=MAX_TOKENS[1])
        outs = llm.generate(prompts(vocab), params)
        scores = runner.score_tokens(prompts(vocab)[3])  # teacher forcing: gathered logits
        tokens = [list(c.token_ids) for o in outs for c in o.outputs]
        return tokens, llm.engine.get_stats(), scores
    finally:
        if tp > 1:
            runner.close()
            assert not any(h.process.is_alive() for h in runner.helpers)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {"tie": False}),  # 4 heads, 2 KV heads: one each
    # one KV head on both ranks; an odd vocabulary pads the last rank's rows
    ("qwen3", {"tie": True, "num_key_value_heads": 1, "vocab_size": 387}),
    # every layer windowed: the windowed block tables travel too, blocks freed behind it
    ("mistral", {"tie": False, "sliding_window": 12}),
    # soft-caps (attention and final), sandwich norms, tied embeddings, windows on every other
    # layer (Gemma 2) or local layers with their own rotary base (Gemma 3)
    ("gemma2", {"tie": True, "sliding_window": 12, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0}),
    ("gemma3", {"tie": True, "sliding_window": 12,
                "layer_types": ["sliding_attention", "full_attention"]}),
])
def test_tp2_equals_tp1(tmp_path, arch, overrides):
    overrides = dict(overrides)
    path = make_checkpoint(tmp_path / arch, arch, tie=overrides.pop("tie"), **overrides)
    expected, stats1, scores1 = run(path, 1)
    got, stats2, scores2 = run(path, 2)
    assert got == expected
    torch.testing.assert_close(scores2, scores1, rtol=1e-5, atol=1e-5)
    for stats in (stats1, stats2):
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_hits > 0
        assert stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"])
def test_tp2_equals_tp1_for_mixtures_of_experts(tmp_path, family):
    # Each expert's gate/up split by rows and down by columns, the router whole on each rank,
    # one all-reduce a block (the shared expert's partial sum joins the experts'); Qwen3-MoE
    # with a dense layer, Qwen2-MoE with a gated shared expert, Mixtral's w1/w2/w3 names,
    # OLMoE's q/k norms over all heads (their sum of squares all-reduced), gpt-oss's sinks per
    # head, biases (row-parallel ones on rank 0 only), stacked interleaved experts and
    # alternating windows.
    from tests.engine.moe_checkpoints import make_moe_checkpoint

    path = make_moe_checkpoint(tmp_path / family, family)
    expected, stats1, scores1 = run(path, 1)
    got, stats2, scores2 = run(path, 2)
    assert got == expected
    torch.testing.assert_close(scores2, scores1, rtol=1e-5, atol=1e-5)
    assert stats2.num_preemptions > 0 and stats2.prefix_cache_hits > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"])
def test_expert_parallel_equals_one_rank(tmp_path, family):
    # Each rank holds half the experts whole (per-expert and stacked tensors read by index) and
    # computes only the pairs routed to them; the router is whole on both, so the routing, and
    # the greedy tokens, are one rank's.
    from tests.engine.moe_checkpoints import make_moe_checkpoint

    path = make_moe_checkpoint(tmp_path / family, family)
    expected, _, scores1 = run(path, 1)
    got, stats, scores2 = run(path, 2, expert_parallel=True)
    assert got == expected
    torch.testing.assert_close(scores2, scores1, rtol=1e-5, atol=1e-5)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_expert_parallel_is_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="expert_parallel spreads the experts over "
                                         "tensor_parallel_size ranks"):
        EngineConfig(model="x", expert_parallel=True)
    dense = make_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM is dense: leave expert_parallel off"):
        LLM(str(dense), tensor_parallel_size=2, expert_parallel=True, **SCHEDULE)
    moe = type("C", (), {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
                         "intermediate_size": 96, "vocab_size": 99, "num_experts": 6,
                         "moe_intermediate_size": 30})
    with pytest.raises(ValueError, match="must divide the model's num_experts \\(6\\)"):
        ShardPlan.of(moe, 0, 4, expert_parallel=True)
    assert ShardPlan.of(moe, 1, 2, expert_parallel=True).held_experts == (3, 3)


def test_tp2_splits_mxfp4_experts_by_whole_groups(tmp_path):
    # gpt-oss as released: MXFP4 experts, split without dequantising a whole expert per rank
    # (gate/up rows, down's 32-value groups); 64 intermediate columns: 32 a rank, one group.
    from tests.engine.test_moe_mxfp4 import write_mxfp4_gpt_oss

    _, quantized = write_mxfp4_gpt_oss(tmp_path, intermediate_size=64)
    expected, _, scores1 = run(quantized, 1)
    got, _, scores2 = run(quantized, 2)
    assert got == expected
    torch.testing.assert_close(scores2, scores1, rtol=1e-5, atol=1e-5)
    config = type("C", (), {"num_attention_heads": 4, "num_key_value_heads": 2,
                            "hidden_size": 64, "intermediate_size": 64, "vocab_size": 99,
                            "num_local_experts": 4,
                            "quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ValueError, match="not a whole number of 32-value groups"):
        ShardPlan.of(config, 0, 4)


def test_a_killed_rank_fails_the_step_loudly(tmp_path):
    path = make_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(str(path), tensor_parallel_size=2, **SCHEDULE)
    engine = llm.engine
    runner = engine.model_runner
    helper = runner.helpers[0].process
    engine.add_request("a", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=50,
                                                               ignore_eos=True))
    for _ in range(3):
        engine.step()
    killed = []

    def kill_in_the_middle(module, args):  # the driver is between its layers' collectives
        if not killed:
            os.kill(helper.pid, signal.SIGKILL)
            helper.join(timeout=10)
            killed.append(True)

    runner.model.model.layers[1].register_forward_pre_hook(kill_in_the_middle)
    with pytest.raises(RankFailure, match="rank 1 .* killed by signal 9"):
        engine.step()
    assert killed and not helper.is_alive()
    with pytest.raises(RankFailure):
        engine.step()  # the engine stays failed: no half-dead steps


def test_a_rank_that_stops_answering_fails_the_step_at_the_timeout(tmp_path, monkeypatch):
    """A helper alive but stuck (SIGSTOP) is not waited on forever: the driver's collective
    times out, the step raises, the stuck helper is killed."""
    monkeypatch.setattr("engine.distributed.group.COLLECTIVE_TIMEOUT", timedelta(seconds=3))
    path = make_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(str(path), tensor_parallel_size=2, **SCHEDULE)
    helper = llm.engine.model_runner.helpers[0].process
    llm.engine.add_request("a", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=9))
    llm.engine.step()
    os.kill(helper.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(RankFailure):
        llm.engine.step()
    assert time.monotonic() - started < 30
    helper.join(timeout=10)
    assert not helper.is_alive()


def test_sizes_that_do_not_split_are_refused(tmp_path):
    config = type("C", (), {"num_attention_heads": 4, "num_key_value_heads": 2,
                            "hidden_size": 64, "intermediate_size": 128, "vocab_size": 99})
    with pytest.raises(ValueError, match="num_attention_heads"):
        ShardPlan.of(config, 0, 3)
    plan = ShardPlan.of(config, 1, 2)
    assert plan.vocab_shard == 50 and plan.row_slices("lm_head.weight") == [(50, 49)]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="x", tensor_parallel_size=0)
    moe = type("C", (), {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
                         "intermediate_size": 96, "vocab_size": 99, "num_experts": 8,
                         "moe_intermediate_size": 30})
    with pytest.raises(ValueError, match="divide the model's moe_intermediate_size \\(30\\)"):
        ShardPlan.of(moe, 0, 4)


def test_a_rank_reads_only_its_slices(tmp_path):
    """Each rank's tensors have the local shapes; the ranks' split tensors add up to the
    checkpoint's, so a rank holds ~1/N of the model (the norms are replicated)."""
    from engine.checkpoint.loader import load_checkpoint
    from engine.distributed.weights import iter_shard_weights

    path = make_checkpoint(tmp_path / "phi3", "phi3")  # q/k/v and gate/up stored fused
    checkpoint = load_checkpoint(str(path))
    full = dict(checkpoint.iter_weights(torch.float32))
    plans = [ShardPlan.of(checkpoint.config, rank, 2) for rank in range(2)]
    shards = [dict(iter_shard_weights(checkpoint, plan, torch.float32)) for plan in plans]
    for name, tensor in full.items():
        parts = [shard[name] for shard in shards]
        if parts[0].shape == tensor.shape:  # replicated
            assert all(torch.equal(p, tensor) for p in parts), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), tensor), name
        elif name.endswith("qkv_proj.weight"):  # each rank: its q heads, its k head, its v head
            q, kv = 4 * 16, 2 * 16
            for rank, part in enumerate(parts):
                rows = torch.cat([tensor[rank * q // 2:(rank + 1) * q // 2],
                                  tensor[q + rank * kv // 2:q + (rank + 1) * kv // 2],
                                  tensor[q + kv + rank * kv // 2:q + kv + (rank + 1) * kv // 2]])
                assert torch.equal(part, rows), name
        elif name.endswith("gate_up_proj.weight"):
            gate, up = tensor.chunk(2)
            assert torch.equal(torch.cat([p.chunk(2)[0] for p in parts]), gate)
            assert torch.equal(torch.cat([p.chunk(2)[1] for p in parts]), up)
        else:
            assert torch.equal(torch.cat(parts), tensor), name
    whole = sum(t.numel() for t in full.values())
    assert sum(t.numel() for t in shards[0].values()) < 0.55 * whole


def test_step_messages_rebuild_the_drivers_rows():
    """Pure bookkeeping: the helpers' rows, built from deltas, are the driver's rows through
    chunks, decodes, a new block, a preemption (new table, recompute from 0) and a finish."""
    from types import SimpleNamespace

    from engine.distributed.step_message import HeldRequests, StepMessages
    from engine.outputs import ScheduledRequest

    a = SimpleNamespace(token_ids=list(range(10)), block_ids=[1, 2], window_block_ids=[],
                        lora_name=None)
    b = SimpleNamespace(token_ids=list(range(50, 53)), block_ids=[3], window_block_ids=[4],
                        lora_name="adapter")
    requests = {"a": a, "b": b}
    driver, helper = StepMessages(), HeldRequests()

    def step(*scheduled: tuple[str, int, int, bool]):
        message = driver.step([ScheduledRequest(*s) for s in scheduled],
                              requests)  # type: ignore[arg-type]
        rows = helper.apply(message)
        for s, row, delta in zip(scheduled, rows, message.rows, strict=True):
            request = requests[s[0]]
            assert delta.lora_name == request.lora_name
            end = s[1] + s[2]
            assert row.token_ids[s[1]:end] == request.token_ids[s[1]:end]
            assert row.block_ids == request.block_ids
            assert row.window_block_ids == request.window_block_ids
        return message

    step(("a", 0, 8, False), ("b", 0, 3, True))
    b.token_ids.append(60)
    step(("b", 3, 1, True), ("a", 8, 2, True))
    a.token_ids.append(11)
    a.block_ids.append(5)
    b.token_ids.append(61)
    b.window_block_ids[0] = 0  # a windowed block behind the window freed
    message = step(("a", 10, 1, True), ("b", 4, 1, True))
    assert message.rows[0].new_token_ids == [11] and message.rows[0].new_block_ids == [5]
    a.block_ids = [7, 8]  # preempted, then recomputed from the start in new blocks
    message = step(("a", 0, 11, True))
    assert message.rows[0].new_token_ids == [] and message.rows[0].num_blocks_kept == 0
    del requests["b"]
    a.token_ids.append(12)
    message = step(("a", 11, 1, True))
    assert message.rows[0].new_token_ids == [12]
    assert message.dropped_ids == ["b"] and "b" not in helper.token_ids


SCRIPT = """
from engine import LLM, SamplingParams
{body}
"""


def _run_script(tmp_path, body: str):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(body=body))
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_runs_tensor_parallel_with_or_without_the_main_guard(tmp_path, guarded):
    # Without the guard, spawned helpers used to import the script again and die at start.
    path = make_checkpoint(tmp_path / "llama", "llama")
    lines = [f"llm = LLM({str(path)!r}, tensor_parallel_size=2, device='cpu', dtype='float32')",
             "out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))",
             "print('tokens', len(out[0].outputs[0].token_ids), flush=True)"]
    if guarded:
        lines = ["if __name__ == '__main__':", *(f"    {line}" for line in lines)]
    done = _run_script(tmp_path, "\n".join(lines) + "\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("tokens 3") == 1  # the script ran once, in the driver only
