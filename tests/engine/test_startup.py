"""Start-up pieces: the kernel build cache, the lazily zeroed KV cache, the safetensors reader."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.checkpoint.loader import read_safetensors
from engine.kernels import cpu_decode_attention as kernel
from engine.llm import LLM
from engine.runner.kv_cache import zeroed_kv_cache
from engine.sampling_params import SamplingParams


@pytest.fixture
def fresh_kernel_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "_modules", {})
    monkeypatch.delitem(sys.modules, kernel._NAME, raising=False)


def test_kernel_cache_key_and_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOXCAR_KERNEL_CACHE", str(tmp_path))
    key = kernel.build_key()
    assert kernel.library_path().parent == tmp_path / key
    assert kernel.build_key() == key  # deterministic
    monkeypatch.setattr(kernel, "_compiler_version", lambda: "c++ (another) 99.0")
    assert kernel.build_key() != key  # a new compiler means a new build
    # each variant has its own build (and Python module name)
    assert kernel.build_key("portable") != kernel.build_key("native")
    assert kernel.library_path("portable").name != kernel.library_path("native").name
    with pytest.raises(ValueError, match="variant"):
        kernel.build_key("fastest")


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
@pytest.mark.usefixtures("fresh_kernel_state")
def test_warm_kernel_load_runs_no_build_and_no_ninja(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = kernel.build(quiet=True)  # the user's cache, built once per machine
    monkeypatch.setenv("BOXCAR_KERNEL_CACHE", str(tmp_path))
    target = kernel.library_path()
    target.parent.mkdir(parents=True)
    shutil.copyfile(built, target)

    import torch.utils.cpp_extension as cpp_extension

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("a warm load must not call the compiler or ninja")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    # the compiler is part of the key, so it stays reachable; ninja does not
    compiler = shutil.which("c++")
    assert compiler is not None
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "c++").symlink_to(compiler)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert shutil.which("ninja") is None
    module = kernel.load()
    # (__spec__: a process that imported the library before keeps its first __file__)
    assert module is not None and Path(module.__spec__.origin) == target

    q = torch.randn(2, 4, 8)
    k_cache, v_cache = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)
    tables = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    lengths = torch.tensor([6, 3], dtype=torch.int32)
    torch.testing.assert_close(
        kernel.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 0.3),
        kernel.paged_decode_attention_ref(q, k_cache, v_cache, tables, lengths, 0.3),
    )


@pytest.mark.usefixtures("fresh_kernel_state")
def test_kernel_build_failure_falls_back_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BOXCAR_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    assert kernel.load() is None
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left in the cache


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def test_kv_cache_is_zero_and_committed_only_where_written() -> None:
    shape = (4, 2, 1024, 16, 8, 64)  # 1 GiB of float32
    before = _rss_kib()
    cache = zeroed_kv_cache(shape, torch.float32, torch.device("cpu"))
    assert cache.shape == shape and cache.is_contiguous() and cache.dtype == torch.float32
    assert _rss_kib() - before < 64 << 10  # not the whole GiB
    cache[1, 0, 7].fill_(2.0)
    assert cache[1, 0, 7].eq(2.0).all() and cache[1, 0, 8].eq(0).all()
    assert cache[3, 1, 1023].eq(0).all()
    bf16 = zeroed_kv_cache((2, 2, 3, 4, 1, 8), torch.bfloat16, torch.device("cpu"))
    assert bf16.dtype == torch.bfloat16 and bf16.eq(0).all()


def test_read_safetensors_round_trip_and_truncation(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.randn(2).bfloat16(),
        "d": torch.randn(2, 2).half(), "e": torch.zeros(0, 3), "f": torch.tensor([True, False]),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    got = dict(read_safetensors(path))
    assert sorted(got) == sorted(tensors)
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ValueError, match="truncated"):
        dict(read_safetensors(path))


def test_small_kv_cache_rejects_what_cannot_fit_and_bounds_the_rest(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=4, block_size=4)  # 16 tokens in all
    engine = llm.engine
    assert engine.max_model_len == 16
    with pytest.raises(ValueError, match="context is 16 tokens"):
        engine.add_request("long", list(range(3, 23)), SamplingParams(max_tokens=4))
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    engine.add_request("fits", list(range(3, 13)), params)
    engine.add_request("waits", list(range(3, 13)), params)  # needs the same blocks: queues
    outputs = {}
    for _ in range(100):  # a bounded loop: a request that could never run would show here
        for output in engine.step():
            outputs[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    assert sorted(outputs) == ["fits", "waits"]
    for output in outputs.values():
        assert len(output.token_ids) == 6 and output.finish_reason == "length"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_weights_are_read_straight_into_the_parameters(tmp_path: Path, kind: str) -> None:
    from engine.checkpoint.loader import load_checkpoint
    from engine.models.no_init import no_init_weights
    from engine.models.registry import get_model_class
    from tests.engine.test_loader import save_checkpoint

    save_checkpoint(tmp_path, kind)
    checkpoint = load_checkpoint(str(tmp_path))
    model_class = get_model_class(checkpoint.config)

    def build(dtype: torch.dtype) -> torch.nn.Module:
        with no_init_weights():
            model = model_class(checkpoint.config, 64)
        return model.to(dtype)

    for dtype in (torch.float32, torch.bfloat16):
        reference = build(dtype)
        reference.load_weights(checkpoint.iter_weights(dtype))  # each read into its own memory
        model = build(dtype)
        params = {p.data_ptr() for p in model.parameters()}
        rows = {p.data_ptr(): p for p in model.parameters()}
        direct = 0
        weights = []
        for name, tensor in checkpoint.iter_weights(dtype, model.weight_destination()):
            # a parameter's memory, or a row range of a packed one (q/k/v, gate/up)
            owner = any(p.data_ptr() <= tensor.data_ptr() < p.data_ptr() + p.nbytes
                        for p in rows.values())
            direct += owner
            weights.append((name, tensor))
        # the file is float32: straight in for a float32 model, cast (own memory) for bf16
        assert direct == (len(weights) if dtype == torch.float32 else 0)
        model.load_weights(weights)
        assert {p.data_ptr() for p in model.parameters()} == params
        for (name, ours), theirs in zip(model.state_dict().items(),
                                        reference.state_dict().values(), strict=True):
            assert torch.equal(ours, theirs), name


def test_read_safetensors_ignores_a_destination_that_does_not_fit(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(2, 2)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    wrong_shape, wrong_dtype = torch.empty(4, 3), torch.empty(2, 2, dtype=torch.float64)
    got = dict(read_safetensors(path, lambda name, shape, dtype:
                                wrong_shape if name == "a" else wrong_dtype))
    for name, tensor in tensors.items():
        assert torch.equal(got[name], tensor), name
    assert got["a"].data_ptr() != wrong_shape.data_ptr()
    assert wrong_dtype.data_ptr() != got["b"].data_ptr()


def test_engine_start_times_the_tokenizer_beside_the_model_and_reports_its_error(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8))
    seconds = engine.startup_seconds
    assert set(seconds) == {"checkpoint", "tokenizer", "model", "kv_cache", "kernel", "total"}
    assert 0 < seconds["tokenizer"] <= seconds["total"]
    assert engine.tokenizer.chat_template and engine.eos_token_ids
    # A folder without tokenizer files: the tokenizer thread's error is the start's error.
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(tiny_model_dir / name, bare / name)
    with pytest.raises(ValueError, match="has no tokenizer files"):
        LLMEngine(EngineConfig(model=str(bare), num_kv_blocks=8))
