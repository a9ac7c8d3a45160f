"""Async scheduling (``EngineConfig.async_scheduling``) gives the synchronous engine's outputs
token for token, on a tiny random model, in every scheduling mode: greedy and seeded sampling,
n > 1, logprobs, stop tokens, stop strings and length limits ending requests at different steps,
requests arriving while others decode, shared prefixes, preemption, aborts, rows that force the
synchronous path, sliding-window layers and LoRA adapters."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
import torch
import transformers

from engine import LLM, EngineConfig, SamplingParams
from engine.core.request import PLACEHOLDER_TOKEN_ID
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.runner.input_batch import StepRow, build_input_batch
from engine.sampling_params import StructuredOutputParams
from tests.conftest import make_checkpoint

MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked-tiny-budget": {"max_num_batched_tokens": 16, "block_size": 8},
    "no-chunking": {"enable_chunked_prefill": False, "max_num_batched_tokens": 128},
    "preempt-tiny-kv": {"num_kv_blocks": 9, "block_size": 8, "max_num_batched_tokens": 32},
    "one-seq-at-a-time": {"max_num_seqs": 1},
    "short-context": {"max_model_len": 48, "block_size": 8},
}


def llm_pair(path, **kw) -> tuple[LLM, LLM]:
    sync = LLM(str(path), dtype="float32", async_scheduling=False, **kw)
    overlapped = LLM(str(path), dtype="float32", async_scheduling=True, **kw)
    assert not sync.engine.async_scheduling and overlapped.engine.async_scheduling
    return sync, overlapped


def engine_pair(path, **kw) -> tuple[LLMEngine, LLMEngine]:
    sync, overlapped = llm_pair(path, **kw)
    return sync.engine, overlapped.engine


def count_overlaps(engine: LLMEngine) -> list[bool]:
    """For each step the engine launches from now on: whether another was still in flight."""
    pipeline = engine._pipeline
    assert pipeline is not None
    overlaps: list[bool] = []
    launch = pipeline.launch

    def launch_and_count(*args, **kwargs):
        overlaps.append(engine._in_flight is not None)
        return launch(*args, **kwargs)

    pipeline.launch = launch_and_count  # type: ignore[method-assign]
    return overlaps


def run(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
        aborts: dict[int, list[str]] | None = None,
        lora: dict[str, str | None] | None = None) -> dict[str, RequestOutput]:
    """Step the engine to the end, adding requests at the steps ``arrivals`` says."""
    arrivals = dict(arrivals)
    aborts = dict(aborts or {})
    results: dict[str, RequestOutput] = {}
    for step in range(2000):
        for request_id, prompt, params in arrivals.pop(step, []):
            engine.add_request(request_id, prompt, params,
                               lora_name=(lora or {}).get(request_id))
        for out in engine.abort_request(aborts.pop(step, [])):
            results[out.request_id] = out
        for out in engine.step():
            results[out.request_id] = out
        if not (engine.has_unfinished_requests() or arrivals):
            break
    stats = engine.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks  # nothing leaked
    assert engine.scheduler.kv.in_flight == {}
    assert stats.num_running == stats.num_waiting == 0
    return results


def summary(results: dict[str, RequestOutput]) -> dict[str, list[tuple]]:
    """Everything a caller sees of each request but the timings."""
    out = {}
    for request_id, result in results.items():
        rows = []
        for c in result.outputs:
            assert PLACEHOLDER_TOKEN_ID not in c.token_ids
            logprobs = None if c.logprobs is None else [
                (lp.token_id, round(lp.logprob, 4), [t for t, _ in lp.top]) for lp in c.logprobs]
            rows.append((c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, logprobs))
        out[request_id] = rows
    return out


def prompts(vocab: int, lens: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (20,), generator=g).tolist()
    # every other prompt shares a 20-token prefix (2 blocks of 8, more than one of 16)
    return [(shared if i % 2 else []) + torch.randint(3, vocab, (n,), generator=g).tolist()
            for i, n in enumerate(lens)]


LENS = (5, 17, 9, 3, 12, 7, 1, 14)


@pytest.fixture(scope="module")
def stop_tokens(tiny_model_dir) -> list[list[int]]:
    """Each prompt's free greedy tokens: a stop token picked from them ends it at that step."""
    llm = LLM(str(tiny_model_dir), dtype="float32")
    ps = prompts(llm.engine.vocab_size, LENS)
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    return [out.token_ids for out in llm.generate(ps, free)]


def greedy_workload(vocab: int, free: list[list[int]]):
    ps = prompts(vocab, LENS)
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for i, prompt in enumerate(ps):
        kw: dict[str, Any] = {"temperature": 0, "max_tokens": (20, 1, 2, 13, 7, 20, 4, 9)[i],
                              "ignore_eos": True}
        if i % 3 == 0:  # a stop token from its free output: it ends at that token's step
            kw["stop_token_ids"] = [free[i][(i * 5) % 7 + 1]]
        if i == 4:
            kw["ignore_eos"] = False
        arrivals.setdefault((0, 0, 0, 2, 3, 3, 5, 9)[i], []).append((f"r{i}", prompt,
                                                                     SamplingParams(**kw)))
    return arrivals


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_outputs_equal_the_synchronous_engine(tiny_model_dir, stop_tokens, mode):
    sync, overlapped = engine_pair(tiny_model_dir, **MODES[mode])
    workload = greedy_workload(sync.vocab_size, stop_tokens)
    want = summary(run(sync, workload))
    overlaps = count_overlaps(overlapped)
    got = summary(run(overlapped, workload))
    assert got == want
    reasons = {row[3] for rows in want.values() for row in rows}
    assert reasons == {"stop", "length"}
    if mode.startswith("preempt"):
        assert overlapped.get_stats().num_preemptions > 0
    if mode == "default":  # the shared prefix was hit, as in the synchronous engine
        assert overlapped.get_stats().prefix_cache_hits > 0
    # the steps overlapped: all but the first of each busy stretch launched while one ran
    assert sum(overlaps) > 0.8 * len(overlaps)


SAMPLED = [
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True),
    SamplingParams(n=3, temperature=1.0, top_k=40, seed=5, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=0.7, min_p=0.05, seed=2, max_tokens=16, logprobs=1,
                   ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=10, logit_bias={5: 3.0, 9: -100.0},
                   ignore_eos=True),
]


@pytest.mark.parametrize("mode", ["default", "preempt-tiny-kv", "chunked-tiny-budget"])
def test_seeded_sampling_n_and_logprobs_equal_the_synchronous_engine(tiny_model_dir, mode):
    sync, overlapped = engine_pair(tiny_model_dir, **MODES[mode])
    ps = prompts(sync.vocab_size, (6, 15, 30, 2, 11))
    workload = {i: [(f"s{i}", p, params)] for i, (p, params) in enumerate(zip(ps, SAMPLED,
                                                                              strict=True))}
    want = summary(run(sync, workload))
    assert summary(run(overlapped, workload)) == want
    assert len({tuple(row[1]) for row in want["s1"]}) > 1  # n = 3 samples that differ


PENALIZED = [
    SamplingParams(temperature=0, max_tokens=14, repetition_penalty=1.8, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=12, presence_penalty=1.5,
                   frequency_penalty=0.8, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),
    SamplingParams(n=2, temperature=1.0, top_k=30, seed=8, max_tokens=9, frequency_penalty=2.0,
                   ignore_eos=True),
]


@pytest.mark.parametrize("mode", ["default", "preempt-tiny-kv", "chunked-tiny-budget"])
def test_penalized_rows_overlap_and_equal_the_synchronous_engine(tiny_model_dir, mode):
    """Penalties no longer need the host each token: their counts advance on the device from
    the tokens drawn, so a penalized row's steps overlap like any other's."""
    sync, overlapped = engine_pair(tiny_model_dir, **MODES[mode])
    ps = prompts(sync.vocab_size, (7, 18, 4, 12))
    workload = {2 * i: [(f"p{i}", p, params)] for i, (p, params) in enumerate(zip(
        ps, PENALIZED, strict=True))}
    want = summary(run(sync, workload))
    # the greedy penalized row is transformers' greedy search with its repetition penalty
    # (over prompt and output, as the counts kept across steps hold them)
    device = sync.model_runner.device  # the engine's (gpu_check runs this file on CUDA)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).float().eval()
    with torch.no_grad():
        reference = model.to(device).generate(
            torch.tensor([ps[0]], device=device), do_sample=False, max_new_tokens=14,
            repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)
    assert want["p0"][0][1] == reference[0, len(ps[0]):].tolist()
    overlaps = count_overlaps(overlapped)
    assert summary(run(overlapped, workload)) == want
    if mode == "default":
        assert sum(overlaps) > 0.8 * len(overlaps)


@pytest.mark.parametrize("mode", ["default", "preempt-tiny-kv", "chunked-tiny-budget"])
def test_min_tokens_rows_overlap_and_equal_the_synchronous_engine(tiny_model_dir, mode):
    """min_tokens no longer needs the host each token: the sampler counts a row's draws."""
    sync, overlapped = engine_pair(tiny_model_dir, **MODES[mode])
    ps = prompts(sync.vocab_size, (9, 5))
    free = summary(run(sync, {0: [("free", ps[0], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))]}))["free"][0][1]
    # transformers' greedy search with a floor of 6 tokens (its min_new_tokens bans the stop id
    # until then): a stop id from the free text's first tokens that ends it after the floor
    device = sync.model_runner.device
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).float().eval()
    model.to(device)

    def reference(stop: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ps[0]], device=device), do_sample=False,
                                 max_new_tokens=12, min_new_tokens=6, eos_token_id=stop,
                                 pad_token_id=0)
        return out[0, len(ps[0]):].tolist()

    # one stop id the floor holds back (it comes early in the free text), one it releases (it
    # first comes past the floor)
    early = free[2]
    late = next(t for t in free[6:] if t not in free[:6])
    params = [
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[early],
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[late],
                       ignore_eos=True),
        SamplingParams(temperature=0.9, seed=6, max_tokens=10, min_tokens=8),
    ]
    workload = {2 * i: [(f"m{i}", p, q)] for i, (p, q) in enumerate(zip(
        [ps[0], ps[0], ps[1]], params, strict=True))}
    want = summary(run(sync, workload))
    assert want["m0"][0][1] == reference(early) and early not in want["m0"][0][1][:6]
    assert want["m1"][0][1] == reference(late) and want["m1"][0][3] == "stop"
    overlaps = count_overlaps(overlapped)
    assert summary(run(overlapped, workload)) == want
    if mode == "default":
        assert sum(overlaps) > 0.8 * len(overlaps)


def test_stop_strings_equal_the_synchronous_engine(tiny_model_dir):
    sync_llm, overlapped_llm = llm_pair(tiny_model_dir)
    sync, overlapped = sync_llm.engine, overlapped_llm.engine
    ps = prompts(sync.vocab_size, (4, 9, 13))
    free = [out.text for out in sync_llm.generate(ps, SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True))]
    workload = {0: [(f"t{i}", p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                stop=[text[2 + i:5 + i]],
                                                include_stop_str_in_output=i == 1))
                    for i, (p, text) in enumerate(zip(ps, free, strict=True))]}
    want = summary(run(sync, workload))
    assert summary(run(overlapped, workload)) == want
    assert all(rows[0][3] == "stop" for rows in want.values())


@pytest.mark.parametrize("mode", ["default", "preempt-tiny-kv", "chunked-tiny-budget"])
def test_structured_rows_overlap_and_equal_the_synchronous_engine(tiny_model_dir, mode):
    """A grammar advances where its token is drawn, so constrained rows overlap too; a request
    whose grammar completed (its EOS drawn) is still drawn for by the step in flight, and that
    step leaves its terminated matcher alone."""
    sync, overlapped = engine_pair(tiny_model_dir, **MODES[mode])
    ps = prompts(sync.vocab_size, (8, 3, 21, 5))
    integer = StructuredOutputParams(json_schema={"type": "integer", "minimum": -5,
                                                  "maximum": 120})
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10,
                       structured_output=StructuredOutputParams(json_object=True)),
        SamplingParams(temperature=0.8, seed=3, max_tokens=8, structured_output=integer),
        SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, structured_output=integer),
        SamplingParams(temperature=0, max_tokens=8, structured_output=integer),
    ]
    # the constrained requests arrive after the others started, which outlive them
    workload = {0: [("h0", ps[0], params[0]), ("h3", ps[3], params[3])],
                3: [("h1", ps[1], params[1]), ("h2", ps[2], params[2])],
                5: [("h4", ps[1], params[4]), ("h5", ps[2], params[5])]}
    want = summary(run(sync, workload))
    finished_by_grammar = 0
    for rid in ("h2", "h4", "h5"):
        for row in want[rid]:
            if row[3] == "stop":  # the grammar completed: an integer in range
                assert -5 <= int(row[2]) <= 120
                finished_by_grammar += 1
    assert finished_by_grammar >= 2
    overlaps = count_overlaps(overlapped)
    assert summary(run(overlapped, workload)) == want
    if mode == "default":
        assert sum(overlaps) > 0.8 * len(overlaps)


def test_abort_mid_flight_returns_a_prefix_and_frees_everything(tiny_model_dir):
    sync, overlapped = engine_pair(tiny_model_dir, block_size=8)
    ps = prompts(sync.vocab_size, (10, 4, 17))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    workload = {0: [(f"a{i}", p, params) for i, p in enumerate(ps)]}
    want = summary(run(sync, workload))
    got = summary(run(overlapped, workload, aborts={6: ["a1"], 7: ["a2", "a1"]}))
    assert got["a0"] == want["a0"]
    for request_id in ("a1", "a2"):
        (row,) = got[request_id]
        assert row[3] == "abort" and 0 < len(row[1]) < 30
        assert row[1] == want[request_id][0][1][:len(row[1])]
    # the engine keeps going: a new request reusing an aborted id is exact
    again = run(overlapped, {0: [("a1", ps[1], params)]})
    assert summary(again)["a1"] == want["a1"]


def test_progress_counts_the_tokens_whose_output_is_back(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), async_scheduling=True).engine
    prompt = list(range(3, 15))  # 12 tokens
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    # three steps launched (the prompt, two decodes); the first two's tokens are back
    assert engine.scheduler.requests["a"].num_computed_tokens == 14
    (a,) = engine.progress()
    assert (a.num_tokens, a.num_computed_tokens, a.num_output_tokens) == (14, 13, 2)


@pytest.mark.parametrize("mode", ["default", "preempt-tiny-kv", "chunked-tiny-budget"])
def test_sliding_window_layers_equal_the_synchronous_engine(tmp_path_factory, mode):
    path = make_checkpoint(tmp_path_factory.mktemp("gemma2-window"), "gemma2",
                           sliding_window=12, attn_logit_softcapping=2.0,
                           final_logit_softcapping=3.0)
    sync, overlapped = engine_pair(path, **MODES[mode])
    assert overlapped.model_runner.kv_window is not None  # the windowed layers' own blocks
    ps = prompts(sync.vocab_size, (5, 30, 3, 17))
    workload = {i: [(f"w{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]
                for i, (p, n) in enumerate(zip(ps, (25, 9, 30, 14), strict=True))}
    assert summary(run(overlapped, workload)) == summary(run(sync, workload))


def test_lora_rows_equal_the_synchronous_engine(tiny_model_dir, tmp_path):
    pytest.importorskip("peft")
    from tests.engine.test_lora import save_adapter

    adapters = {
        "qv": save_adapter(tiny_model_dir, tmp_path / "qv", 1, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"]),
        "mlp": save_adapter(tiny_model_dir, tmp_path / "mlp", 2, r=8, lora_alpha=16,
                            target_modules=["gate_proj", "down_proj"]),
    }
    modules = tuple(f"{name}={folder}" for name, folder in adapters.items())
    sync, overlapped = engine_pair(tiny_model_dir, lora_modules=modules, max_loras=2,
                                   block_size=8, max_num_batched_tokens=24)
    ps = prompts(sync.vocab_size, (7, 12, 3, 20))
    params = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
    workload = {i: [(f"l{i}", p, params)] for i, p in enumerate(ps)}
    lora = {"l0": "qv", "l1": None, "l2": "mlp", "l3": "qv"}
    assert summary(run(overlapped, workload, lora=lora)) == summary(run(sync, workload,
                                                                        lora=lora))


def test_a_batch_laid_out_on_the_host_moves_whole_to_the_device():
    """Async scheduling lays a step out on the host and the step thread copies it (a copy from
    the host's thread would wait for the step in flight on a GPU); "meta" stands in for it."""
    rows = [StepRow([5, 6, 7], [3], [2], 2, 1, True), StepRow([1, 2, 3, 4, 5], [4, 1], [0, 5],
                                                             0, 5, True)]
    batch = build_input_batch(rows, 4, torch.device("cpu"), with_window=True)
    moved = batch.to(torch.device("meta"))
    assert moved.to(torch.device("meta")) is moved and batch.to(torch.device("cpu")) is batch
    tensors = [moved.input_ids, moved.positions]
    for metadata in (moved.metadata, moved.metadata.window):
        assert metadata is not None
        tensors += [getattr(metadata, f.name) for f in fields(metadata)
                    if isinstance(getattr(metadata, f.name), torch.Tensor)]
        assert metadata.prefill_query_lens_list == [5]
    assert len(tensors) == 14 and all(t.device.type == "meta" for t in tensors)
    assert batch.input_ids.device.type == "cpu"  # the host's batch is left as it was
    assert moved.sample_indices == batch.sample_indices == [0, 5]


def test_the_option_resolves_by_device_and_refuses_tensor_parallel():
    assert not EngineConfig(model="m").overlaps_steps("cpu")
    assert EngineConfig(model="m").overlaps_steps("cuda")
    assert EngineConfig(model="m", async_scheduling=True).overlaps_steps("cpu")
    assert not EngineConfig(model="m", async_scheduling=False).overlaps_steps("cuda")
    with pytest.raises(ValueError, match="async_scheduling.*tensor_parallel_size"):
        EngineConfig(model="m", async_scheduling=True, tensor_parallel_size=2)
    assert not EngineConfig(model="m", tensor_parallel_size=2).overlaps_steps("cuda")
