"""CUDAGraphRunner: bucketing and padding on any device; graph capture itself on CUDA only.

On CPU the graph is stood in for by re-running ``forward`` over the static buffers, which checks
everything but the capture: buckets, the copy into static rows, padding rows that write nothing to
the KV cache and attend to nothing, and slicing the output back to the real batch.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.layers.attention_metadata import AttentionMetadata  # noqa: E402
from engine.runner.cuda_graphs import (  # noqa: E402
    CUDAGraphRunner,
    DecodeInputs,
    Replay,
    bucket_sizes,
    decode_metadata,
    select_bucket,
)


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    with pytest.raises(ValueError, match="max_batch_size"):
        bucket_sizes(0)


def test_select_bucket() -> None:
    buckets = bucket_sizes(32)
    assert [select_bucket(b, buckets) for b in (1, 2, 3, 5, 8, 9, 17, 32)] == [
        1, 2, 4, 8, 8, 16, 24, 32
    ]
    assert select_bucket(33, buckets) is None
    assert select_bucket(3, []) is None


def _inputs(batch_size: int, width: int, offset: int = 0) -> DecodeInputs:
    return DecodeInputs(
        input_ids=torch.arange(batch_size) + 100 + offset,
        positions=torch.arange(batch_size) + 10,
        slot_mapping=torch.arange(batch_size) * 3 + offset,
        block_tables=torch.arange(batch_size * width, dtype=torch.int32).view(batch_size, width),
        context_lens=torch.arange(batch_size, dtype=torch.int32) + 11,
    )


def test_static_buffers_start_as_padding() -> None:
    static = DecodeInputs.allocate(4, 3, "cpu")
    assert static.slot_mapping.tolist() == [-1] * 4
    assert static.context_lens.tolist() == [0] * 4
    assert static.block_tables.shape == (4, 3) and static.block_tables.dtype == torch.int32


def test_fill_copies_rows_and_pads_the_bucket() -> None:
    static = DecodeInputs.allocate(8, 4, "cpu")
    static.fill(_inputs(6, 4), 8)  # leave stale rows behind
    static.fill(_inputs(3, 2, offset=1), 4)
    rows = static.rows(4)
    assert rows.input_ids.tolist() == [101, 102, 103, 0]
    assert rows.positions.tolist() == [10, 11, 12, 0]
    assert rows.slot_mapping.tolist() == [1, 4, 7, -1]
    assert rows.context_lens.tolist() == [11, 12, 13, 0]
    assert rows.block_tables[:3, :2].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert rows.block_tables[3].tolist() == [0, 0, 0, 0]
    # Rows past the bucket are not the graph's business and stay as they were.
    assert static.slot_mapping[4:6].tolist() == [12, 15]


def test_fill_rejects_what_does_not_fit() -> None:
    static = DecodeInputs.allocate(4, 2, "cpu")
    with pytest.raises(ValueError, match="bucket"):
        static.fill(_inputs(3, 2), 2)
    with pytest.raises(ValueError, match="bucket"):
        static.fill(_inputs(3, 2), 8)
    with pytest.raises(ValueError, match="max_num_blocks"):
        static.fill(_inputs(2, 3), 2)


def test_decode_metadata() -> None:
    inputs = _inputs(3, 2)
    md = decode_metadata(inputs)
    assert isinstance(md, AttentionMetadata)
    assert md.num_decodes == 3 and md.num_prefills == 0
    assert md.slot_mapping is inputs.slot_mapping
    assert md.decode_block_tables is inputs.block_tables
    assert md.decode_context_lens is inputs.context_lens
    assert md.prefill_query_start_loc.tolist() == [0]
    assert md.prefill_block_tables.shape == (0, 2) and md.prefill_context_lens.shape == (0,)


class ToyDecoder:
    """One attention layer over a paged cache: q/k/v from an embedding of (token, position)."""

    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 16, 8, 12

    def __init__(self, device: str) -> None:
        from engine.layers.triton_attention import TritonAttentionBackend

        gen = torch.Generator().manual_seed(0)
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.embed = torch.randn(256, width, generator=gen).to(device)
        self.pos_embed = torch.randn(64, width, generator=gen).to(device)
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(device)
        self.v_cache = torch.randn(shape, generator=gen).to(device)
        self.backend = TritonAttentionBackend()
        self.calls: list[int] = []

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        self.calls.append(input_ids.shape[0])
        qkv = self.embed[input_ids] + self.pos_embed[positions]  # [B, (H + 2 Hkv) * D]
        q, k, v = qkv.split(
            [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2], dim=-1
        )
        out = self.backend.forward(
            q.reshape(-1, self.num_heads, self.head_dim),
            k.reshape(-1, self.num_kv_heads, self.head_dim),
            v.reshape(-1, self.num_kv_heads, self.head_dim),
            self.k_cache,
            self.v_cache,
            metadata,
            0.25,
        )
        return out.flatten(1) * 2.0  # [B, H * D]


def _decode_step(batch_size: int, step: int, device: str) -> DecodeInputs:
    """Sequence b owns blocks [b, b + 6] and has ``8 + b + step`` tokens, the new one included."""
    lens = torch.arange(batch_size, dtype=torch.int32) + 8 + step
    tables = torch.stack([torch.arange(batch_size), torch.arange(batch_size) + 6], 1).int()
    new_pos = lens.long() - 1
    slots = tables.long().gather(1, (new_pos // 8)[:, None])[:, 0] * 8 + new_pos % 8
    input_ids = (torch.arange(batch_size) * 7 + step) % 256
    return DecodeInputs(
        *(t.to(device) for t in (input_ids, new_pos, slots, tables, lens))
    )


class EagerReplayRunner(CUDAGraphRunner):
    """Stands in for capture: "replay" re-runs forward over the same static buffers."""

    def _capture_one(self, bucket: int) -> tuple[Replay, torch.Tensor]:
        inputs = self.static.rows(bucket)
        metadata = decode_metadata(inputs)
        output = self.forward(inputs.input_ids, inputs.positions, metadata)

        def replay() -> None:
            output.copy_(self.forward(inputs.input_ids, inputs.positions, metadata))

        return replay, output


def _check_runner_matches_eager(runner_cls: type[CUDAGraphRunner], device: str) -> None:
    graphed, eager = ToyDecoder(device), ToyDecoder(device)
    runner = runner_cls(graphed, [1, 2, 4], max_num_blocks=2, device=device)
    runner.capture()
    assert runner.captured == [1, 2, 4]
    for step, batch_size in enumerate([3, 1, 4, 2, 3]):
        inputs = _decode_step(batch_size, step, device)
        out = runner.run(
            inputs.input_ids, inputs.positions, inputs.block_tables, inputs.context_lens,
            inputs.slot_mapping,
        )
        expected = eager(inputs.input_ids, inputs.positions, decode_metadata(inputs))
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        # Padding rows wrote nothing: both caches hold exactly the same values.
        assert torch.equal(graphed.k_cache, eager.k_cache)
        assert torch.equal(graphed.v_cache, eager.v_cache)


# CPU tensors reach Triton only through its interpreter (a GPU machine's run compiles instead)
on_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                    reason="CPU tensors need TRITON_INTERPRET=1")


@on_interpreter
def test_runner_pads_replays_and_slices_on_cpu() -> None:
    pytest.importorskip("triton")
    _check_runner_matches_eager(EagerReplayRunner, "cpu")


@on_interpreter
def test_runner_falls_back_to_eager() -> None:
    pytest.importorskip("triton")
    model = ToyDecoder("cpu")
    runner = EagerReplayRunner(model, [1, 2], max_num_blocks=2, device="cpu")
    runner.capture()
    model.calls.clear()
    inputs = _decode_step(3, 0, "cpu")  # larger than every bucket
    args = (inputs.input_ids, inputs.positions, inputs.block_tables, inputs.context_lens,
            inputs.slot_mapping)
    assert runner.run(*args).shape == (3, 64)
    assert model.calls == [3]

    eager = EagerReplayRunner(model, [1, 2, 4], max_num_blocks=2, device="cpu",
                              enforce_eager=True)
    eager.capture()
    assert eager.captured == []
    model.calls.clear()
    eager.run(*args)
    assert model.calls == [3]  # unpadded, straight through


def test_runner_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="batch_sizes"):
        CUDAGraphRunner(lambda *a: a[0], [], max_num_blocks=2, device="cpu")
    with pytest.raises(ValueError, match="max_num_blocks"):
        CUDAGraphRunner(lambda *a: a[0], [1], max_num_blocks=0, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_eager() -> None:
    pytest.importorskip("triton")
    _check_runner_matches_eager(CUDAGraphRunner, "cuda")
