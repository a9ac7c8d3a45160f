"""Multi-LoRA: greedy output of every request equals transformers + peft with its adapter (fp32),
in one engine batch mixing the base model and adapters of different ranks, scalings and target
modules, in every scheduling mode."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from tests.conftest import make_checkpoint
from tests.engine.test_correctness import MODES

peft = pytest.importorskip("peft")

# name -> LoraConfig arguments: different ranks, alphas, rsLoRA, per-module rank and alpha
ADAPTERS = {
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8-rs": dict(r=8, lora_alpha=16, use_rslora=True,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"]),
    "out-r16": dict(r=16, lora_alpha=32, target_modules=["o_proj", "down_proj"]),
    "mlp-k-r2": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "k_proj"],
                     rank_pattern={"k_proj": 6}, alpha_pattern={"up_proj": 10}),
}
NAMES: list[str | None] = [None, *ADAPTERS]
PROMPT_LENS = (5, 33, 17, 64)
MAX_TOKENS = (12, 9, 16, 7)


def save_adapter(base_path, folder, seed: int, **kwargs) -> str:
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    torch.manual_seed(seed)
    # init_lora_weights=False: random A and B (PEFT's default B = 0 would change nothing)
    config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs)
    model = peft.get_peft_model(base, config)
    model.save_pretrained(folder)
    return str(folder)


def reference_greedy(base_path, adapter_path, prompts, max_tokens) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        base_path, dtype=torch.float32, attn_implementation="eager")
    if adapter_path is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_path)
    model.eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
            outs.append(ids[0, len(prompt):].tolist())
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lora_reference(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    path = make_checkpoint(root / "base", request.param, tie=request.param == "qwen2")
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    adapters = {name: save_adapter(path, root / name, seed, **kwargs)
                for seed, (name, kwargs) in enumerate(ADAPTERS.items())}
    # every prompt under the base and under every adapter, interleaved; then one repeat
    lines = [(p, n, name) for name in NAMES for p, n in zip(prompts, MAX_TOKENS, strict=True)]
    lines.sort(key=lambda line: PROMPT_LENS.index(len(line[0])))
    lines.append(lines[-4])  # the 64-token prompt under qv-r4 again
    expected = {name: reference_greedy(path, adapters.get(name) if name else None, prompts,
                                       MAX_TOKENS) for name in NAMES}
    for name in ADAPTERS:  # an adapter that changes nothing would prove nothing
        assert expected[name] != expected[None]
    return path, adapters, prompts, lines, expected


def lora_modules(adapters: dict[str, str]) -> list[str]:
    return [f"{name}={folder}" for name, folder in adapters.items()]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


LORA_MODES = {
    **MODES,
    "two-adapters-a-step": {"max_loras": 2, "max_num_batched_tokens": 64},
    "lru-of-two": {"max_loras": 2, "max_cpu_loras": 2},
}


@pytest.mark.parametrize("mode", list(LORA_MODES))
def test_mixed_adapters_match_peft(lora_reference, mode):
    path, adapters, prompts, lines, expected = lora_reference
    llm = LLM(str(path), dtype="float32", lora_modules=lora_modules(adapters),
              **LORA_MODES[mode])
    outs = llm.generate([p for p, _, _ in lines], [greedy(n) for _, n, _ in lines],
                        lora_name=[name for _, _, name in lines])
    for out, (prompt, _, name) in zip(outs, lines, strict=True):
        assert out.token_ids == expected[name][prompts.index(prompt)], (mode, name)
    engine = llm.engine
    stats = engine.get_stats()
    if mode.startswith("preempt"):
        assert stats.num_preemptions > 0
    if LORA_MODES[mode].get("max_loras") == 2:
        assert engine.scheduler.num_lora_holds > 0
    if mode == "lru-of-two":
        assert engine.model_runner.lora is not None
        assert len(engine.model_runner.lora.loaded) <= 2
        assert engine.model_runner.lora.num_loads > len(adapters)  # dropped and read again
    if mode == "default":
        # the repeated line hit its own adapter's blocks; the same prompt under the base or
        # another adapter shares nothing (the block hash carries the adapter)
        assert outs[-1].metrics.num_cached_tokens >= 48
        assert [o.metrics.num_cached_tokens for o in outs[-6:-1]] == [0] * 5
    if LORA_MODES[mode].get("max_num_seqs", 128) >= len(NAMES):
        assert max(stats.batch_size_hist) >= len(NAMES)  # base and adapters shared steps
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.num_running == stats.num_waiting == 0


def test_stacked_kernels_path_matches_peft(lora_reference):
    """The GPU path's slot stacks and Triton shrink/expand (interpreted on the CPU here)."""
    path, adapters, prompts, lines, expected = lora_reference
    subset = [line for line in lines if len(line[0]) <= 17][:6]
    llm = LLM(str(path), dtype="float32", lora_modules=lora_modules(adapters),
              attention_backend="triton", max_loras=3)
    runner = llm.engine.model_runner
    assert runner.lora is not None and runner.lora.stacked
    outs = llm.generate([p for p, _, _ in subset], [greedy(4) for _ in subset],
                        lora_name=[name for _, _, name in subset])
    for out, (prompt, _, name) in zip(outs, subset, strict=True):
        assert out.token_ids == expected[name][prompts.index(prompt)][:4], name
    assert runner.lora.num_slot_writes >= 3


# Every family gets LoRA from the shared layers: Gemma 2 / 3 (windows, soft-caps) and Phi-3,
# whose checkpoint (and so PEFT) has q/k/v and gate/up fused: an adapter on a whole packed module.
FAMILY_ADAPTERS = {
    "gemma2": {"attn-mlp": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                  "up_proj"]),
               "rest": dict(r=8, lora_alpha=4, use_rslora=True,
                            target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"])},
    "gemma3": {"attn-mlp": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                  "up_proj"]),
               "rest": dict(r=8, lora_alpha=64, target_modules=["k_proj", "o_proj",
                                                                "down_proj"])},
    "phi3-longrope-window": {
        "packed": dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"]),
        "out": dict(r=6, lora_alpha=12, target_modules=["o_proj", "down_proj"])},
}


@pytest.fixture(scope="module", params=list(FAMILY_ADAPTERS))
def family_reference(request, tmp_path_factory):
    from tests.engine.test_families import FAMILIES

    arch, kw = FAMILIES[request.param]
    kw = dict(kw)
    tie = kw.pop("tie")
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    path = make_checkpoint(root / "base", arch, tie=tie, **kw)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 30, 19)]
    max_tokens = [16, 9, 20]
    adapters = {name: save_adapter(path, root / name, seed, **kwargs) for seed, (name, kwargs)
                in enumerate(FAMILY_ADAPTERS[request.param].items())}
    expected = {name: reference_greedy(path, adapters.get(name) if name else None, prompts,
                                       max_tokens) for name in [None, *adapters]}
    for name in adapters:
        assert expected[name] != expected[None]
    return path, adapters, prompts, max_tokens, expected


@pytest.mark.parametrize("mode", ["default", "chunked-tiny-budget"])
def test_every_family_gets_lora(family_reference, mode):
    path, adapters, prompts, max_tokens, expected = family_reference
    llm = LLM(str(path), dtype="float32", lora_modules=lora_modules(adapters),
              **({"max_num_batched_tokens": 16, "block_size": 8} if mode != "default" else {}))
    names = [None, *adapters]
    lines = [(i, name) for name in names for i in range(len(prompts))]
    outs = llm.generate([prompts[i] for i, _ in lines],
                        [greedy(max_tokens[i]) for i, _ in lines],
                        lora_name=[name for _, name in lines])
    for out, (i, name) in zip(outs, lines, strict=True):
        assert out.token_ids == expected[name][i], (mode, name, i)


def test_decode_graphs_with_adapters_match_peft(lora_reference):
    """The GPU path's decode graphs: adapter rows read the step's segments from a table written
    before each replay, over a bucket's padded rows (capture stood in for on the CPU)."""
    from tests.engine.test_cuda_graphs import EagerReplayRunner

    path, adapters, prompts, lines, expected = lora_reference
    subset = [line for line in lines if len(line[0]) <= 17][:6]
    llm = LLM(str(path), dtype="float32", lora_modules=lora_modules(adapters),
              attention_backend="triton", max_loras=3, max_num_seqs=8)
    runner = llm.engine.model_runner
    runner.capture_decode_graphs(EagerReplayRunner)
    assert runner.lora is not None and runner.lora_graphs is not None
    written = []
    write = runner.lora.write_graph_segments
    runner.lora.write_graph_segments = lambda batch: written.append(batch) or write(batch)
    outs = llm.generate([p for p, _, _ in subset], [greedy(4) for _ in subset],
                        lora_name=[name for _, _, name in subset])
    for out, (prompt, _, name) in zip(outs, subset, strict=True):
        assert out.token_ids == expected[name][prompts.index(prompt)][:4], name
    assert written and all(len(b.segments) <= 3 for b in written)  # decode steps replayed


@pytest.mark.parametrize("mode", ["default", "two-adapters-a-step", "lru-of-two"])
def test_tensor_parallel_adapters_match_peft(lora_reference, mode):
    # Each rank holds its share of every adapter (B's rows on q/k/v/gate/up, A's columns on
    # o/down, whose delta joins the all-reduce): the same tokens as PEFT on one device.
    from engine.distributed.runner import TPModelRunner
    from engine.errors import LoRAError

    path, adapters, prompts, lines, expected = lora_reference
    llm = LLM(str(path), dtype="float32", lora_modules=lora_modules(adapters),
              tensor_parallel_size=2, **LORA_MODES[mode])
    runner = llm.engine.model_runner
    assert isinstance(runner, TPModelRunner)
    try:
        outs = llm.generate([p for p, _, _ in lines], [greedy(n) for _, n, _ in lines],
                            lora_name=[name for _, _, name in lines])
        for out, (prompt, _, name) in zip(outs, lines, strict=True):
            assert out.token_ids == expected[name][prompts.index(prompt)], (mode, name)
        with pytest.raises(LoRAError, match="registered at start"):
            llm.engine.add_lora("late", adapters["qv-r4"])
    finally:
        runner.close()
