"""GGUF weights kept quantized (``quantization="keep"``) against the same files dequantized at load:
tiny files of every family the GGUF loader reads, in mixtures of block formats like the ones
llama.cpp writes (Gemma 3 270M's Q4_K_M mixes Q8_0, Q5_0, Q4_K and Q6_K); the bits of every kept
weight, the logits, the greedy tokens through the engine with chunked prefill and prefix hits; the
choice ``auto`` makes and the line it prints; the refusals; truncated and corrupt files; the
converted cache's packed form; LoRA on a quantized base; tensor parallel dequantizing from the
cache. Then the real models, where they are pulled.

Keep mode needs a kernel for every type (``quant_gemm.kernel_formats``); where the C++ kernels
are not built the tests let every known format through (``all_kernels``), so a kept weight
multiplies on its torch reference: what is under test here is the loading, not the kernels
(``test_quant_gemm.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from torch import nn

import engine.startup
from engine import LLM, EngineConfig, SamplingParams
from engine.checkpoint import gguf_cache
from engine.checkpoint.loader import load_checkpoint, prepare_model, safetensors_metadata
from engine.kernels.ggml_quants import FORMATS, random_rows
from engine.kernels.quant_gemm import QuantWeight, kernel_formats
from engine.layers.quantized import DenseWeight, QuantizedEmbedding, QuantizedLinear
from engine.models.no_init import no_init_weights
from engine.models.registry import get_model_class
from tests.engine.test_gguf import write_gguf
from tests.engine.test_gguf_families import CASES as FAMILY_CASES
from tests.engine.test_gguf_families import SHAPE
from tests.engine.test_loader import random_model, tiny_config, tiny_tokenizer

K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # gguf cannot quantize these (nor Q3_K): random blocks
# chunked prefill (16-token budget over 8-token blocks) and a shared prefix (prefix-cache hits)
SCHEDULE = dict(dtype="float32", block_size=8, max_num_batched_tokens=16, num_kv_blocks=64)


@pytest.fixture
def all_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every known format counts as having a kernel (see the module docstring)."""
    monkeypatch.setattr(engine.startup, "kernel_formats", lambda device="cpu": frozenset(FORMATS))


def write_mixed_gguf(path: Path, model: nn.Module, arch: str,
                     type_of: Callable[[str], Q | None], extra=None) -> Path:
    """``model`` as llama.cpp writes it (``write_gguf``), each 2-D tensor then stored in
    ``type_of(gguf_name)`` (None: F32). The K-quants get random valid blocks of about the
    tensor's magnitude (gguf has no quantizer for them); keep and dequantize read the same
    bytes either way."""
    dense = path.with_name(path.stem + ".f32.gguf")
    write_gguf(dense, model, arch, Q.F32, extra=extra)
    reader = gguf.GGUFReader(dense)
    writer = gguf.GGUFWriter(str(path), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    generator = torch.Generator().manual_seed(1)
    for tensor in reader.tensors:
        data = np.array(tensor.data)  # float32, torch's order
        qtype = type_of(tensor.name) if data.ndim == 2 else None
        if qtype is None:
            writer.add_tensor(tensor.name, data)
        elif qtype == Q.F16:
            writer.add_tensor(tensor.name, data.astype(np.float16))
        elif qtype in K_QUANTS:
            rows = random_rows(qtype.name, data.shape[0], data.shape[1], generator,
                               scale=float(np.abs(data).max()))
            writer.add_tensor(tensor.name, rows.numpy(), raw_dtype=qtype)
        elif qtype == Q.Q3_K:  # random bits, a small finite scale (its fp16 d: the last 2 bytes)
            blocks = torch.randint(0, 256, (data.size // 256, 110), dtype=torch.uint8,
                                   generator=generator)
            blocks[:, 108:110] = torch.full((len(blocks), 1), 1e-3,
                                            dtype=torch.float16).view(torch.uint8)
            writer.add_tensor(tensor.name, blocks.reshape(data.shape[0], -1).numpy(),
                              raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dense.unlink()
    return path


def by_part(default: Q | None, **parts: Q | None) -> Callable[[str], Q | None]:
    """A GGUF name's type by its part (``attn_q``, ``token_embd``, ...), else ``default``."""
    def type_of(name: str) -> Q | None:
        part = name.removesuffix(".weight").rsplit(".", 1)[-1]
        return parts.get(part, default)
    return type_of


def _family_model(arch: str, **shape: int) -> tuple[nn.Module, Callable | None]:
    config_cls, model_cls, fields, keys = FAMILY_CASES[arch]
    tokenizer = tiny_tokenizer()
    config = config_cls(**{**SHAPE, **fields, **shape}, vocab_size=len(tokenizer),
                        bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0, 0.1)
    return model, keys(config)


def _llama_family(kind: str, **shape: int) -> tuple[nn.Module, None]:
    config = tiny_config(kind, vocab_size=len(tiny_tokenizer()))
    for name, value in shape.items():
        setattr(config, name, value)
    return random_model(config), None


WIDE = dict(hidden_size=256, intermediate_size=256)  # K-quant rows: multiples of 256 values
# case -> (architecture, model maker, the types its tensors get)
CASES: dict[str, tuple[str, Callable[[], tuple[nn.Module, Callable | None]],
                       Callable[[str], Q | None]]] = {
    "llama-q8_0": ("llama", lambda: _llama_family("llama"), by_part(Q.Q8_0)),
    "llama-tied-q4_0": ("llama", lambda: _llama_family("llama-tied"), by_part(Q.Q4_0)),
    # q/k/v biases (dense), a tied Q4_1 embedding
    "qwen2-q4_1": ("qwen2", lambda: _llama_family("qwen2"), by_part(Q.Q4_1)),
    "qwen3-q5_0-q8_0": ("qwen3", lambda: _llama_family("qwen3"),
                        by_part(Q.Q5_0, attn_v=Q.Q8_0, token_embd=Q.Q8_0)),
    # Gemma 3 270M's Q4_K_M mixture: q/k Q5_0 beside a Q8_0 v, Q4_K o, Q6_K down
    "gemma3-q4_k_m": ("gemma3", lambda: _family_model("gemma3", **WIDE, head_dim=64,
                                                      query_pre_attn_scalar=64),
                      by_part(Q.Q5_0, token_embd=Q.Q8_0, attn_v=Q.Q8_0, attn_output=Q.Q4_K,
                              ffn_down=Q.Q6_K)),
    # fused q/k/v and gate/up in the file, an untied Q6_K output layer
    "phi3-k-quants": ("phi3", lambda: _family_model("phi3", **WIDE, num_attention_heads=16,
                                                    num_key_value_heads=8),  # LongRoPE's 16
                      by_part(Q.Q5_K, ffn_down=Q.Q4_K, output=Q.Q6_K, token_embd=Q.Q8_0)),
    # one shard of q/k/v stored F16 among quantized ones (kept as dense rows), Q5_1 elsewhere
    "gemma2-f16-v": ("gemma2", lambda: _family_model("gemma2"),
                     by_part(Q.Q5_1, attn_q=Q.Q8_0, attn_k=Q.Q8_0, attn_v=Q.F16)),
}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, vocab, (16,), generator=g).tolist()  # two full blocks
    tails = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 21, 2)]
    return [shared + tail for tail in tails] + [tails[1]]


def weight_bytes(model: nn.Module) -> int:
    """The bytes of the model's weights: its parameters and its packed weights, each once."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
    packed = {id(piece): piece.nbytes for m in model.modules()
              for piece in (m.pieces if isinstance(m, QuantizedLinear) else
                            [m.weight_packed] if isinstance(m, QuantizedEmbedding) else [])}
    return sum(storages.values()) + sum(packed.values())


def dense_weights(path: Path) -> dict[str, torch.Tensor]:
    """The fp32 parameters of the model the file dequantizes to (before any CPU packing)."""
    checkpoint = load_checkpoint(str(path))
    with no_init_weights():
        model = get_model_class(checkpoint.config)(checkpoint.config, 64)
    model.load_weights(checkpoint.iter_weights(torch.float32))
    return dict(model.named_parameters(remove_duplicate=False))  # a tied head too


def gguf_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def _run(llm: LLM, vocab: int) -> tuple[list[list[int]], torch.Tensor]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts(vocab), params)
    scores = llm.engine.model_runner.score_tokens(prompts(vocab)[1])
    return [list(o.token_ids) for o in outs], scores


@pytest.mark.parametrize("case", list(CASES))
def test_keep_equals_dequantize(tmp_path: Path, case: str, all_kernels: None) -> None:
    arch, make, type_of = CASES[case]
    model, extra = make()
    path = write_mixed_gguf(tmp_path / f"{case}.gguf", model, arch, type_of, extra)
    kept = LLM(str(path), quantization="keep", **SCHEDULE)
    dense = LLM(str(path), quantization="dequantize", **SCHEDULE)
    kept_model = kept.engine.model_runner.model
    dense_params = dense_weights(path)

    swapped = {name: m for name, m in kept_model.named_modules()
               if isinstance(m, QuantizedLinear | QuantizedEmbedding)}
    assert isinstance(swapped.get("model.embed_tokens"), QuantizedEmbedding)
    num_layers = len(kept_model.attention_layers())
    assert "lm_head" in swapped and sum(n.endswith("qkv_proj") for n in swapped) == num_layers
    if kept_model.tie_word_embeddings:  # the head multiplies the embedding's own blocks
        assert swapped["lm_head"].pieces == [swapped["model.embed_tokens"].weight_packed]
    for name, module in swapped.items():
        # the bits: ggml rows un-permuted as bytes (llama), shards joined, the head shared
        if isinstance(module, QuantizedEmbedding):
            got = module.weight_packed.dequantize(torch.float32)
        else:
            got = module.dequantize(torch.float32)
            if module.bias is not None:
                assert torch.equal(module.bias, dense_params[f"{name}.bias"])
        assert torch.equal(got, dense_params[f"{name}.weight"]), name
    if case == "gemma3-q4_k_m":  # q and k (Q5_0) joined into one product beside v (Q8_0)
        qkv = swapped["model.layers.0.self_attn.qkv_proj"]
        assert [p.fmt for p in qkv.pieces] == ["Q5_0", "Q8_0"]
    if case == "gemma2-f16-v":
        qkv = swapped["model.layers.0.self_attn.qkv_proj"]
        assert [type(p) for p in qkv.pieces] == [QuantWeight, DenseWeight]
    # no dense copy left behind: the weights take about the file's bytes
    assert weight_bytes(kept_model) <= 1.15 * gguf_tensor_bytes(path)

    vocab = kept.engine.vocab_size
    kept_tokens, kept_scores = _run(kept, vocab)
    dense_tokens, dense_scores = _run(dense, vocab)
    torch.testing.assert_close(kept_scores, dense_scores, rtol=1e-4, atol=1e-4)
    assert kept_tokens == dense_tokens
    stats = kept.engine.get_stats()
    assert stats.prefix_cache_hits > 0


def test_a_bf16_model_s_kept_head_gives_fp32_logits(tmp_path: Path, all_kernels: None) -> None:
    # in bf16 the kept output layer returns its fp32 sums (the argmax the dense path's greedy
    # screen takes is of fp32 sums too); the layers before it stay bf16
    arch, make, type_of = CASES["qwen3-q5_0-q8_0"]
    model, extra = make()
    path = write_mixed_gguf(tmp_path / "head.gguf", model, arch, type_of, extra)
    llm = LLM(str(path), quantization="keep", **{**SCHEDULE, "dtype": "bfloat16"})
    runner = llm.engine.model_runner
    head = runner.model.lm_head
    assert isinstance(head, QuantizedLinear) and head.out_dtype is torch.float32
    assert runner.model.model.layers[0].mlp.down_proj.out_dtype is None
    hidden = torch.randn(6, head.in_features).bfloat16()
    logits = runner.model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    expected = torch.cat([piece.linear(hidden, out_dtype=torch.float32) for piece in head.pieces],
                         dim=-1)
    assert torch.equal(logits, runner.model.cap_logits(expected))
    outs = llm.generate(prompts(llm.engine.vocab_size),
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in outs)
    fp32 = LLM(str(path), quantization="keep", **SCHEDULE)
    assert fp32.engine.model_runner.model.lm_head.out_dtype is None  # fp32 sums already


def test_auto_keeps_where_every_type_has_a_kernel_and_says_which(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    arch, make, _ = CASES["qwen3-q5_0-q8_0"]
    model, _ = make()
    path = write_mixed_gguf(tmp_path / "mixed.gguf", model, arch,
                            by_part(Q.Q5_0, attn_v=Q.Q8_0, token_embd=Q.Q8_0))
    monkeypatch.setattr(engine.startup, "kernel_formats", lambda device="cpu": frozenset({"Q8_0"}))
    llm = LLM(str(path), dtype="float32")
    err = capsys.readouterr().err
    assert ("[boxcar] dequantizing: no kernel for Q5_0 (13 tensors, e.g. blk.0.attn_q.weight)"
            in err)
    assert isinstance(llm.engine.model_runner.model.lm_head, nn.Linear)
    with pytest.raises(ValueError, match=r"quantization='keep': no kernel for Q5_0 .*"
                                         r"quantization='dequantize'"):
        LLM(str(path), quantization="keep")

    monkeypatch.setattr(engine.startup, "kernel_formats",
                        lambda device="cpu": frozenset({"Q8_0", "Q5_0"}))
    llm = LLM(str(path), dtype="float32")
    assert "[boxcar] keeping the weights quantized (Q5_0 (13 tensors" in capsys.readouterr().err
    assert isinstance(llm.engine.model_runner.model.lm_head, QuantizedLinear)


def test_a_type_the_engine_has_no_kernel_for_is_dequantized(
        tmp_path: Path, all_kernels: None, capsys: pytest.CaptureFixture[str]) -> None:
    # Q3_K: gguf reads it, the engine keeps no Q3_K (no format, no kernel)
    model, _ = _llama_family("llama", **WIDE)
    path = write_mixed_gguf(tmp_path / "q3_k.gguf", model, "llama",
                            by_part(Q.Q8_0, ffn_down=Q.Q3_K))
    llm = LLM(str(path), dtype="float32")
    err = capsys.readouterr().err
    assert ("[boxcar] dequantizing: no kernel for Q3_K (2 tensors, e.g. blk.0.ffn_down.weight)"
            in err)
    assert isinstance(llm.engine.model_runner.model.lm_head, nn.Linear)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"no kernel for Q3_K \(2 tensors, e\.g\. "
                                         r"blk\.0\.ffn_down\.weight\)"):
        LLM(str(path), quantization="keep")


def test_keep_is_refused_where_it_cannot_run(tmp_path: Path, all_kernels: None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    arch, make, type_of = CASES["llama-q8_0"]
    path = write_mixed_gguf(tmp_path / "m.gguf", make()[0], arch, type_of)
    with pytest.raises(ValueError, match=r"keep': tensor parallelism \(tensor_parallel_size=2\)"):
        LLM(str(path), quantization="keep", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="keep': an embedding model loads dense weights"):
        LLM(str(path), quantization="keep", task="embed")
    monkeypatch.setattr(engine.startup, "resolve_device", lambda name: torch.device("mps"))
    with pytest.raises(ValueError, match="run on a CPU or CUDA, and this engine runs on mps"):
        LLM(str(path), quantization="keep")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(path), quantization="fp8")


def test_a_cuda_engine_keeps_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA every format has the Triton kernel (``triton_ggml_gemm``), so ``keep`` is taken;
    left unset, the engine dequantizes and says why: no GPU has run that kernel yet."""
    monkeypatch.setattr(engine.startup, "resolve_device", lambda name: torch.device("cuda"))
    types = {"Q4_K": ["blk.0.ffn_up.weight"], "Q6_K": ["output.weight"]}
    assert engine.startup.cannot_keep(EngineConfig(model="m", quantization="keep"), types) is None
    assert (engine.startup.cannot_keep(EngineConfig(model="m"), types)
            == engine.startup.GPU_UNMEASURED)
    assert kernel_formats("cuda") == frozenset(FORMATS)
    assert kernel_formats("mps") == frozenset()


def test_tensor_parallel_dequantizes_from_the_packed_cache(tmp_path: Path) -> None:
    arch, make, type_of = CASES["llama-q8_0"]
    path = write_mixed_gguf(tmp_path / "m.gguf", make()[0], arch, type_of)
    one = LLM(str(path), quantization="dequantize", num_threads=1, **SCHEDULE)
    vocab = one.engine.vocab_size
    expected = [list(o.token_ids) for o in one.generate(
        prompts(vocab), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    two = LLM(str(path), tensor_parallel_size=2, num_threads=1, **SCHEDULE)  # auto: dequantize
    try:
        got = [list(o.token_ids) for o in two.generate(
            prompts(vocab), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    finally:
        two.engine.model_runner.close()  # type: ignore[attr-defined]
    assert got == expected


def test_the_cache_keeps_the_blocks(tmp_path: Path, all_kernels: None) -> None:
    arch, make, type_of = CASES["gemma3-q4_k_m"]
    path = write_mixed_gguf(tmp_path / "g.gguf", make()[0], arch, type_of)
    direct = load_checkpoint(str(path))  # nothing converted yet: the GGUF itself
    assert direct.is_gguf
    folder = prepare_model(str(path))
    assert folder.name.endswith(f"boxcar-v{gguf_cache.FORMAT_VERSION}") and \
        gguf_cache.FORMAT_VERSION == 3
    weights = folder / gguf_cache.WEIGHTS_FILE
    # about the GGUF's size (the dense copies it held before were 4-7x that)
    assert weights.stat().st_size < 1.1 * path.stat().st_size
    entries = gguf_cache.quantized_entries(safetensors_metadata(weights))
    assert entries["model.layers.0.mlp.down_proj.weight"] == gguf_cache.QuantizedEntry(
        "Q6_K", 256, 256, "blk.0.ffn_down.weight")
    cached = load_checkpoint(str(path))
    assert cached.path == folder and cached.quantized_types() == direct.quantized_types()
    assert sorted(cached.quantized_types()) == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    for dtype in (torch.float32, torch.bfloat16):
        assert (cached.weight_bytes(dtype, quantized=True)
                == direct.weight_bytes(dtype, quantized=True))
        assert (cached.weight_bytes(dtype, quantized=False)
                == direct.weight_bytes(dtype, quantized=False))
    assert direct.weight_bytes(torch.float32, quantized=True) == gguf_tensor_bytes(path)

    packed = dict(cached.iter_weights(torch.float32, quantized=True))
    from_file = dict(direct.iter_weights(torch.float32, quantized=True))
    assert packed.keys() == from_file.keys()
    for name, weight in packed.items():
        other = from_file[name]
        if isinstance(weight, QuantWeight):
            assert isinstance(other, QuantWeight) and weight.fmt == other.fmt
            assert torch.equal(weight.raw(), other.raw()), name
        else:
            assert isinstance(weight, torch.Tensor) and isinstance(other, torch.Tensor)
            assert torch.equal(weight, other), name
    # dequantized from the cache: the GGUF path's bits
    for name, tensor in cached.iter_weights(torch.float32):
        assert torch.equal(tensor, dict(direct.iter_weights(torch.float32))[name]), name


# ---- bad files ----------------------------------------------------------------------------


def _q8_model_file(tmp_path: Path) -> Path:
    arch, make, type_of = CASES["llama-q8_0"]
    return write_mixed_gguf(tmp_path / "bad.gguf", make()[0], arch, type_of)


def test_a_truncated_file_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = _q8_model_file(tmp_path)
    last = max(gguf.GGUFReader(path).tensors, key=lambda t: t.data_offset)
    data = path.read_bytes()
    path.write_bytes(data[:last.data_offset + last.n_bytes - 100])
    with pytest.raises(ValueError, match=rf"tensor {last.name!r} \(Q8_0, .*\) needs "
                                         rf"{last.n_bytes} bytes, but only "
                                         rf"{last.n_bytes - 100} lie before the end of the "
                                         "file: the file is truncated"):
        LLM(str(path))
    assert gguf_cache.find(path) is None  # nothing converted, nothing half-loaded


@pytest.mark.parametrize("error", ["short", "long"])
def test_a_tensor_whose_shape_does_not_fit_its_bytes_is_refused(tmp_path: Path,
                                                                 error: str) -> None:
    # a header claiming one row more (its bytes run into the next tensor) or fewer (bytes left
    # over) than the tensor's data holds
    path = tmp_path / f"{error}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rows = gguf.quants.quantize(np.ones((8, 64), dtype=np.float32), Q.Q8_0)  # 8 x 68 bytes
    claimed = 9 if error == "short" else 7
    writer.add_tensor("blk.0.attn_q.weight", rows, raw_shape=(claimed, 68), raw_dtype=Q.Q8_0)
    writer.add_tensor("blk.0.attn_k.weight", rows, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    need = claimed * 68
    if error == "short":
        message = (rf"'blk.0.attn_q.weight' \(Q8_0, 9 x 64\) needs {need} bytes, but only "
                   r"\d+ lie before the next tensor, 'blk.0.attn_k.weight': the file is "
                   "truncated")
    else:
        message = (rf"'blk.0.attn_q.weight' \(Q8_0, 7 x 64\) needs {need} bytes, but \d+ lie "
                   "before the next tensor: its shape or type is corrupt")
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(path))


def test_a_non_finite_block_scale_is_refused_naming_the_tensor(tmp_path: Path,
                                                                all_kernels: None) -> None:
    path = _q8_model_file(tmp_path)
    target = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray(path.read_bytes())
    row_bytes = target.data.shape[1]
    offset = target.data_offset + 3 * row_bytes + 34  # row 3, block 1: its fp16 scale
    data[offset:offset + 2] = np.array([np.inf], dtype=np.float16).tobytes()
    path.write_bytes(bytes(data))
    for quantization in ("keep", "dequantize"):
        with pytest.raises(ValueError, match=r"tensor 'blk.1.ffn_up.weight' \(Q8_0\) has 1 "
                                             r"blocks whose fp16 scale is not finite, the "
                                             r"first in row 3 \(inf\)"):
            LLM(str(path), quantization=quantization)
        assert gguf_cache.find(path) is None


def test_a_corrupt_cache_entry_is_refused(tmp_path: Path, all_kernels: None) -> None:
    path = _q8_model_file(tmp_path)
    folder = prepare_model(str(path))
    weights = folder / gguf_cache.WEIGHTS_FILE
    raw = weights.read_bytes()
    header_size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_size])
    listed = json.loads(header["__metadata__"][gguf_cache.QUANTIZED_KEY])
    listed["model.layers.0.mlp.down_proj.weight"][2] = 96  # in_features: 128 -> 96
    header["__metadata__"][gguf_cache.QUANTIZED_KEY] = json.dumps(listed)
    text = json.dumps(header).encode()  # the data's offsets count from the header's end
    weights.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + header_size:])
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_down.weight' \(Q8_0, 64 x 96\) "
                                         r"needs 6528 bytes \(64 rows of 102\), got 8704"):
        LLM(str(path), quantization="keep")


# ---- LoRA on a quantized base -------------------------------------------------------------


def test_lora_adapters_run_on_quantized_linears(tmp_path: Path, all_kernels: None) -> None:
    peft = pytest.importorskip("peft")
    model, _ = _llama_family("llama")
    base = tmp_path / "hf"
    model.save_pretrained(base)
    path = write_mixed_gguf(tmp_path / "base.gguf", model, "llama", by_part(Q.Q8_0))
    torch.manual_seed(5)
    adapter = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,
                        target_modules=["q_proj", "v_proj", "down_proj"]))
    adapter.save_pretrained(tmp_path / "adapter")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = str(path)  # trained on the GGUF's model
    config_file.write_text(json.dumps(config))
    modules = [f"a={tmp_path / 'adapter'}"]
    outs = {}
    for quantization in ("keep", "dequantize"):
        llm = LLM(str(path), quantization=quantization, lora_modules=modules, **SCHEDULE)
        vocab = llm.engine.vocab_size
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outs[quantization] = [list(o.token_ids) for o in llm.generate(
            prompts(vocab), params, lora_name=["a", None, "a", "a"])]
        if quantization == "keep":  # the adapter changes what the base model says
            base = [list(o.token_ids) for o in llm.generate(prompts(vocab), params)]
            assert base[1] == outs["keep"][1] and base != outs["keep"]
    assert outs["keep"] == outs["dequantize"]


def test_the_weight_summary_counts_what_a_start_keeps(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    arch, make, type_of = CASES["qwen3-q5_0-q8_0"]
    path = write_mixed_gguf(tmp_path / "m.gguf", make()[0], arch, type_of)
    checkpoint = load_checkpoint(str(prepare_model(str(path))))
    config = EngineConfig(model=str(path), dtype="float32", device="cpu")
    kept = checkpoint.weight_bytes(torch.float32, quantized=True)
    dense = checkpoint.weight_bytes(torch.float32, quantized=False)
    assert kept == gguf_tensor_bytes(path) and dense > 3 * kept
    monkeypatch.setattr(engine.startup, "kernel_formats", lambda device="cpu": frozenset({"Q8_0"}))
    assert engine.startup.weight_summary(config, checkpoint) == (
        f"weights in memory: {dense / 2**20:.1f} MiB, dequantized to float32 (no kernel for "
        f"Q5_0 (13 tensors, e.g. blk.0.attn_q.weight); kept quantized they would take "
        f"{kept / 2**20:.1f} MiB)")
    monkeypatch.setattr(engine.startup, "kernel_formats", lambda device="cpu": frozenset(FORMATS))
    assert engine.startup.weight_summary(config, checkpoint) == (
        f"weights in memory: {kept / 2**20:.1f} MiB, kept quantized (Q5_0, Q8_0; dequantized "
        f"to float32 they would take {dense / 2**20:.1f} MiB)")


# ---- the real models (where they are pulled) ----------------------------------------------

REAL_MODELS = {
    "default": ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                "<|im_start|>assistant\n",
                "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n"],
    "gemma-3-270m": ["The capital of France is", "def fibonacci(n):"],
}


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_real_models_keep_their_blocks(name: str, all_kernels: None) -> None:
    """Module weight bytes 1.00x the GGUF's tensor bytes for both (SmolLM2-135M Q4_1:
    92.1 MiB; Gemma 3 270M: 235.5 MiB; docs/quantization.md has the dequantized engine's and
    the RSS beside them); greedy tokens as the dequantized engine's (here 12 on 2 prompts; 24
    on 3 prompts each were identical too, fp32 activations)."""
    from engine.checkpoint.model_cache import resolve

    path = resolve(name)
    if path is None:
        pytest.skip(f"{name} is not pulled (boxcar model pull {name})")
    kept = LLM(name, quantization="keep", dtype="float32", max_num_batched_tokens=64)
    model = kept.engine.model_runner.model
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert weight_bytes(model) <= 1.15 * gguf_tensor_bytes(path)
    tokenizer = kept.engine.tokenizer
    prompts = [tokenizer(text).input_ids for text in REAL_MODELS[name]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [list(o.token_ids) for o in kept.generate(prompts, params)]
    del kept, model
    dense = LLM(name, quantization="dequantize", dtype="float32", max_num_batched_tokens=64)
    expected = [list(o.token_ids) for o in dense.generate(prompts, params)]
    # fp32 products of the same values in another order: equal here; a near tie may flip late
    assert [g[:8] for g in got] == [e[:8] for e in expected]


def test_cast_unloaded_is_to_without_the_copy() -> None:
    # what a bf16 engine does to its freshly built model before loading (no page written)
    from engine.models.llama import LlamaForCausalLM
    from engine.models.no_init import cast_unloaded

    config = tiny_config("llama-tied")
    with no_init_weights():
        model, reference = LlamaForCausalLM(config, 64), LlamaForCausalLM(config, 64)
    reference.to(torch.bfloat16)
    cast_unloaded(model, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, param in reference.named_parameters(remove_duplicate=False):
        assert params[name].dtype == param.dtype and params[name].shape == param.shape, name
    buffers = dict(model.named_buffers())
    for name, buffer in reference.named_buffers():
        assert torch.equal(buffers[name], buffer), name  # the rotary tables, converted alike
