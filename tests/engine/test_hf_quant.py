"""AWQ, GPTQ and FP8 Hugging Face checkpoints: their configs checked at start, a module's tensors
gathered into one weight (kept packed or dequantized), errors naming the module and the tensor,
and tiny Llama / Qwen2 checkpoints of every scheme loaded through the engine's own loader with
greedy tokens equal to the same model built from the dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.checkpoint import hf_quant
from engine.checkpoint.hf_quant import (
    HFQuantization,
    choose_mode,
    load_quantized,
    parse_quantization,
)
from engine.checkpoint.loader import load_checkpoint
from engine.config import EngineConfig
from engine.kernels.fp8_weights import Fp8Weight
from engine.kernels.int4_weights import Int4Weight
from engine.layers.quantized import QuantizedLinear, swap_packed
from engine.startup import weight_summary
from tests.conftest import make_checkpoint
from tests.engine.quant_checkpoints import SCHEMES, Scheme, write_quantized
from tests.engine.test_correctness import greedy, hf_greedy, make_prompts

# --- the config ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "described"), [
    ("awq-g64", "AWQ int4 (group 64)"),
    ("gptq-g64-act-order-v1", "GPTQ int4 (group 64)"),
    ("gptq-row-asym-v2", "GPTQ int4 (one group a row)"),
    ("fp8-block", "FP8 e4m3 (fp8, 48x32 blocks)"),
    ("ct-fp8-channel", "FP8 e4m3 (compressed-tensors, per-tensor or per-channel scales)"),
])
def test_the_writers_configs_are_read(name, described):
    assert parse_quantization(SCHEMES[name].config()).describe() == described


def test_gptq_v1_zeros_are_offset_and_v2_are_not():
    assert parse_quantization(SCHEMES["gptq-g32-v1"].config()).zero_offset == 1
    assert parse_quantization(SCHEMES["gptq-row-asym-v2"].config()).zero_offset == 0
    old = {k: v for k, v in SCHEMES["gptq-g32-v1"].config().items() if k != "checkpoint_format"}
    assert parse_quantization(old).zero_offset == 1  # AutoGPTQ wrote no format: v1


def _ct(weights: dict | None = None, **group) -> dict:
    config = SCHEMES["ct-fp8-tensor"].config()
    config["config_groups"]["group_0"]["weights"].update(weights or {})
    config["config_groups"]["group_0"].update(group)
    return config


@pytest.mark.parametrize(("config", "named"), [
    ({**SCHEMES["awq-g32"].config(), "bits": 8}, "awq with bits=8"),
    ({**SCHEMES["awq-g32"].config(), "version": "gemv"}, "awq version 'gemv'"),
    ({**SCHEMES["awq-g32"].config(), "zero_point": False}, "awq with zero_point false"),
    ({**SCHEMES["awq-g32"].config(), "group_size": 96}, "awq group_size 96"),
    ({**SCHEMES["gptq-g32-v1"].config(), "bits": 3}, "gptq with bits=3"),
    ({**SCHEMES["gptq-g32-v1"].config(), "bits": 8}, "gptq with bits=8"),
    ({**SCHEMES["gptq-g32-v1"].config(), "checkpoint_format": "marlin"},
     "gptq checkpoint_format 'marlin'"),
    ({**SCHEMES["fp8-block"].config(), "activation_scheme": "static"},
     "fp8 activation_scheme 'static'"),
    ({**SCHEMES["fp8-block"].config(), "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     "quant_method 'bitsandbytes' is not supported"),
    ({**SCHEMES["ct-fp8-tensor"].config(), "format": "pack-quantized"},
     "compressed-tensors format 'pack-quantized'"),
    (_ct({"type": "int"}), r"weights 8-bit int"),
    (_ct({"num_bits": 4}), r"weights 4-bit float"),
    (_ct({"strategy": "group"}), "strategy 'group'"),
    (_ct(input_activations={"num_bits": 8, "type": "float", "dynamic": False}),
     "input_activations with static scales"),
    ({**SCHEMES["ct-fp8-tensor"].config(), "kv_cache_scheme": {"num_bits": 8}},
     "kv_cache_scheme"),
])
def test_unsupported_schemes_are_named_with_what_is_supported(config, named):
    with pytest.raises(ValueError, match=named) as error:
        parse_quantization(config)
    assert "supported: awq (bits 4, version gemm" in str(error.value)


# --- the weight stream -----------------------------------------------------------------------

AWQ = HFQuantization("awq", group_size=32)
CT_FP8 = parse_quantization(SCHEMES["ct-fp8-channel"].config())


def awq_module(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed)) * 0.1
    return SCHEMES["awq-g32"].quantize(w, seed)


def test_a_modules_tensors_become_its_weight_in_any_order():
    tensors, dense = awq_module()
    bias = torch.randn(16)
    stream = [("m.proj.scales", tensors["scales"]), ("m.norm.weight", torch.ones(64)),
              ("m.proj.bias", bias), ("m.proj.qweight", tensors["qweight"]),
              ("m.proj.qzeros", tensors["qzeros"])]
    out = list(load_quantized(stream, AWQ, torch.float32, keep=False))
    assert [name for name, _ in out] == ["m.norm.weight", "m.proj.bias", "m.proj.weight"]
    assert torch.equal(out[2][1], dense) and out[1][1] is bias
    kept = dict(load_quantized(stream, AWQ, torch.bfloat16, keep=True))["m.proj.weight"]
    assert isinstance(kept, Int4Weight) and torch.equal(kept.dequantize(), dense)
    as_bf16 = dict(load_quantized(stream, AWQ, torch.bfloat16, keep=False))["m.proj.weight"]
    assert torch.equal(as_bf16, dense.bfloat16())  # dequantized in fp32, rounded once


def test_fp8_weights_and_dense_ones_are_told_apart():
    w = torch.randn(16, 64) * 0.1
    tensors, dense = SCHEMES["ct-fp8-channel"].quantize(w, 0)
    stream = [("a.weight_scale", tensors["weight_scale"]), ("a.weight", tensors["weight"]),
              ("lm_head.weight", w)]  # left unquantized: dense, passes
    out = dict(load_quantized(stream, CT_FP8, torch.float32, keep=True))
    assert isinstance(out["a.weight"], Fp8Weight) and out["lm_head.weight"] is w
    assert torch.equal(out["a.weight"].dequantize(), dense)


def test_missing_and_misfit_tensors_name_the_module_and_the_tensor():
    tensors, _ = awq_module()
    with pytest.raises(ValueError, match=r"layers\.0\.q_proj: AWQ int4 \(group 32\) "
                                         r"tensor\(s\) \['scales'\] missing"):
        list(load_quantized([("layers.0.q_proj.qweight", tensors["qweight"]),
                             ("layers.0.q_proj.qzeros", tensors["qzeros"])], AWQ,
                            torch.float32, keep=False))
    for keep in (False, True):
        with pytest.raises(ValueError, match=r"layers\.0\.q_proj: qzeros has shape \(2, 1\)"):
            list(load_quantized([("layers.0.q_proj.qweight", tensors["qweight"]),
                                 ("layers.0.q_proj.qzeros", tensors["qzeros"][:, :1]),
                                 ("layers.0.q_proj.scales", tensors["scales"])], AWQ,
                                torch.float32, keep=keep))
    fp8, _ = SCHEMES["ct-fp8-channel"].quantize(torch.randn(16, 64), 0)
    with pytest.raises(ValueError, match=r"^o_proj: weight_scale: the scale has shape \(8, 1\)"):
        list(load_quantized([("o_proj.weight", fp8["weight"]),
                             ("o_proj.weight_scale", fp8["weight_scale"][:8])], CT_FP8,
                            torch.float32, keep=False))
    with pytest.raises(ValueError, match=r"o_proj: weight is torch.float32 beside a "
                                         "weight_scale"):
        list(load_quantized([("o_proj.weight_scale", fp8["weight_scale"]),
                             ("o_proj.weight", torch.randn(16, 64))], CT_FP8, torch.float32,
                            keep=False))
    with pytest.raises(ValueError, match=r"o_proj.input_scale: static activation scales"):
        list(load_quantized([("o_proj.input_scale", torch.ones(1))], CT_FP8, torch.float32,
                            keep=False))


# --- whole checkpoints -----------------------------------------------------------------------


def test_transformers_reads_the_writers_fp8_checkpoint_as_the_reference(tmp_path):
    """An independent reader of Hugging Face's fine-grained FP8: transformers dequantizes it on
    the CPU (its reader needs whole blocks) to exactly the writer's reference weights."""
    dense = make_checkpoint(tmp_path / "dense", "llama")
    reference, quantized = write_quantized(dense, tmp_path, Scheme("fp8", block=(32, 32)))
    model = transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32)
    loaded = model.state_dict()
    for name, tensor in load_file(reference / "model.safetensors").items():
        assert torch.equal(loaded[name], tensor), name


def _quantized_folders(tmp_path_factory, family: str, scheme: str) -> tuple[Path, Path]:
    dense = make_checkpoint(tmp_path_factory.mktemp(f"{family}-dense"), family,
                            tie=family == "qwen2")
    return write_quantized(dense, tmp_path_factory.mktemp(f"{family}-{scheme}"), SCHEMES[scheme])


def test_quantized_config_in_the_folder(tmp_path_factory):
    reference, quantized = _quantized_folders(tmp_path_factory, "llama", "gptq-g32-v1")
    assert "quantization_config" not in json.loads((reference / "config.json").read_text())
    names = load_file(quantized / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.g_idx" in names and "lm_head.weight" in names


def test_the_mode_keeps_on_a_gpu_and_dequantizes_on_the_cpu(capsys):
    awq = parse_quantization(SCHEMES["awq-g64"].config())
    assert choose_mode(awq, None, "cuda") == "keep"
    assert choose_mode(awq, "dequantize", "cuda") == "dequantize"
    assert choose_mode(awq, None, "cpu") == "dequantize"
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "dequantizing the AWQ int4 (group 64) weights" in line
    assert "no CPU kernel" in line
    with pytest.raises(ValueError, match=r"quantization='keep': there is no CPU kernel for AWQ "
                                         r"int4 .* use --quantization dequantize"):
        choose_mode(awq, "keep", "cpu")
    with pytest.raises(ValueError, match="keep': tensor parallelism"):
        choose_mode(awq, "keep", "cuda", dense_only="tensor parallelism loads dense weights")
    assert choose_mode(awq, None, "cuda", dense_only="an embedding model") == "dequantize"


# --- through the engine ----------------------------------------------------------------------

# every scheme on Llama; Qwen2 (q/k/v biases beside the packed weights, a tied head) in one of
# each kind
E2E = [("llama", name) for name in SCHEMES] + [
    ("qwen2", "awq-g64"), ("qwen2", "gptq-g64-act-order-v1"), ("qwen2", "fp8-block")]
# chunked prefill (16-token budget over 8-token blocks)
SCHEDULE = dict(dtype="float32", block_size=8, max_num_batched_tokens=16)
MAX_TOKENS = [12, 9, 15, 6]


def _prompts(folder: Path) -> list[list[int]]:
    return make_prompts(transformers.AutoConfig.from_pretrained(folder).vocab_size)[:4]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])]


@pytest.mark.parametrize(("family", "scheme"), E2E)
def test_dequantized_checkpoint_generates_as_its_reference(tmp_path_factory, family, scheme):
    """Loaded through the engine's loader, dequantized (fp32): the greedy tokens of
    transformers on the reference folder, which holds the same weights dequantized."""
    reference, quantized = _quantized_folders(tmp_path_factory, family, scheme)
    prompts = _prompts(reference)
    expected = hf_greedy(reference, prompts, MAX_TOKENS)
    llm = LLM(str(quantized), quantization="dequantize", **SCHEDULE)
    assert _tokens(llm, prompts) == expected


def test_auto_dequantizes_on_the_cpu_saying_so_and_keep_is_refused(tmp_path_factory, capfd):
    reference, quantized = _quantized_folders(tmp_path_factory, "llama", "awq-g32")
    prompts = _prompts(reference)
    llm = LLM(str(quantized), **SCHEDULE)
    assert "dequantizing the AWQ int4 (group 32) weights at load: there is no CPU kernel" in (
        capfd.readouterr().err)
    assert _tokens(llm, prompts) == hf_greedy(reference, prompts, MAX_TOKENS)
    with pytest.raises(ValueError, match="quantization='keep': there is no CPU kernel for AWQ"):
        LLM(str(quantized), quantization="keep", **SCHEDULE)


@pytest.mark.parametrize(("family", "scheme"), [
    ("llama", "awq-g32"), ("llama", "gptq-g64-act-order-v1"), ("qwen2", "fp8-block"),
    ("llama", "ct-fp8-channel")])
def test_kept_weights_swap_in_and_generate_as_dequantized(tmp_path_factory, monkeypatch, family,
                                                          scheme):
    """Keep mode, let through on the CPU (where the weights multiply on their torch
    references): the linears become QuantizedLinear over the packed weights (fused q/k/v and
    gate/up from their pieces), and the tokens are those of the dequantized load."""
    monkeypatch.setattr(hf_quant, "KERNEL_DEVICES", ("cuda", "cpu"))
    reference, quantized = _quantized_folders(tmp_path_factory, family, scheme)
    prompts = _prompts(reference)
    kept = LLM(str(quantized), quantization="keep", **SCHEDULE)
    layer = kept.engine.model_runner.model.model.layers[0]
    kind = Fp8Weight if "fp8" in scheme else Int4Weight
    for module in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(module, QuantizedLinear)
        assert all(isinstance(piece, kind) for piece in module.pieces)
    assert len(layer.self_attn.qkv_proj.pieces) == 3
    dense = load_file(reference / "model.safetensors")
    q, k, v = (dense[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(layer.self_attn.qkv_proj.dequantize(), torch.cat((q, k, v)))
    assert _tokens(kept, prompts) == hf_greedy(reference, prompts, MAX_TOKENS)


def test_an_unsupported_scheme_is_refused_before_any_weight(tmp_path_factory):
    _, quantized = _quantized_folders(tmp_path_factory, "llama", "awq-g32")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (quantized / "config.json").write_text(json.dumps(config))
    (quantized / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"config.json: quantization_config: awq with bits=8 "
                                         r"is not supported; supported: awq \(bits 4"):
        load_checkpoint(str(quantized))
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported.*awq"):
        load_checkpoint(str(quantized))


def test_a_module_missing_its_scales_is_named_at_load(tmp_path_factory):
    _, quantized = _quantized_folders(tmp_path_factory, "llama", "gptq-g32-v1")
    weights = load_file(quantized / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.scales"]
    save_file(weights, quantized / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj: GPTQ int4 "
                                         r"\(group 32\) tensor\(s\) \['scales'\] missing"):
        LLM(str(quantized), quantization="dequantize", **SCHEDULE)


@pytest.mark.parametrize("scheme", ["gptq-g64-act-order-v1", "awq-g32", "fp8-block"])
def test_weight_bytes_count_what_each_mode_holds(tmp_path_factory, monkeypatch, scheme):
    """The KV sizing's count, from the headers: dequantized, the dense model's bytes; kept,
    the bytes the kept model holds (packed weights and dense parameters); act-order's
    permutation is counted whole even where a single group leaves the inputs in order."""
    reference, quantized = _quantized_folders(tmp_path_factory, "llama", scheme)
    dense = load_checkpoint(str(reference)).weight_bytes(torch.float32, quantized=False)
    checkpoint = load_checkpoint(str(quantized))
    assert checkpoint.weight_bytes(torch.float32, quantized=False) == dense
    monkeypatch.setattr(hf_quant, "KERNEL_DEVICES", ("cuda", "cpu"))
    model = LLM(str(quantized), quantization="keep", **SCHEDULE).engine.model_runner.model
    held = sum(p.nbytes for p in model.parameters()) + sum(
        m.nbytes for m in model.modules() if isinstance(m, QuantizedLinear))
    counted = checkpoint.weight_bytes(torch.float32, quantized=True)
    assert held <= counted <= held * (1.03 if "act-order" in scheme else 1) and counted < dense


def test_kept_weights_follow_their_modules_device():
    """A model built on a GPU gets its kept weights moved to the GPU once each (here the meta
    device stands in: no GPU on the test machine); a weight two modules share stays shared."""
    tensors, _ = awq_module()
    kept = Int4Weight.from_awq(**tensors, group_size=32)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(64, 16, device="meta"),
                                 "b": torch.nn.Linear(64, 16, bias=False, device="meta")})
    swap_packed(model, {"a": [kept], "b": [kept]})
    a, b = model["a"], model["b"]
    assert isinstance(a, QuantizedLinear) and isinstance(b, QuantizedLinear)
    assert a.pieces[0] is b.pieces[0] and a.pieces[0].device.type == "meta"
    assert kept.device.type == "cpu"


def test_the_pull_summary_counts_the_mode_start_up_will_choose(tmp_path_factory):
    """``boxcar model pull``'s line: on the CPU the weights are dequantized (why, and what they
    would take kept); on a GPU kept."""
    _, quantized = _quantized_folders(tmp_path_factory, "llama", "awq-g32")
    checkpoint = load_checkpoint(str(quantized))
    dense = checkpoint.weight_bytes(torch.float32, quantized=False) / 2**20
    kept = checkpoint.weight_bytes(torch.float32, quantized=True) / 2**20
    line = weight_summary(EngineConfig(model=str(quantized), dtype="float32"), checkpoint)
    assert line == (f"weights in memory: {dense:.1f} MiB, dequantized to float32 (there is no "
                    "CPU kernel for AWQ int4 (group 32) weights (their kernels run on cuda); "
                    f"kept quantized they would take {kept:.1f} MiB)")
