"""Embeddings on tiny random models of both kinds, against transformers in fp32: a BertModel
encoder (CLS; MEAN + Normalize from sentence-transformers files) and decoders used as embedders
(a ``Qwen3Model`` checkpoint, a ``LlamaForCausalLM`` one with ``task='embed'``, a Gemma 2 one
with its sliding window and soft-cap), last-token pooled; cosine >= 0.99999 on every input,
packed in any order, budget and batch size. Then the scheduling (whole inputs, no KV blocks,
budget filled), the options, and the typed errors."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
import transformers

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import (
    DimensionsNotSupported,
    EmptyInput,
    InputTooLong,
    NotAnEmbeddingModel,
    TokenOutOfVocabulary,
)
from engine.pooling_params import PoolingParams
from tests.conftest import build_tokenizer, make_checkpoint

LENS = (1, 2, 5, 17, 33, 64, 3, 100, 41, 9, 127, 8, 8, 8)
MODES = {
    "default": {},
    "tiny-budget": {"max_num_batched_tokens": 40},
    "one-at-a-time": {"max_num_seqs": 1},
    "budget-under-longest": {"max_num_batched_tokens": 16},
}


def make_bert(path, *, st_files: dict | None = None, **overrides):
    tokenizer = build_tokenizer()
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, type_vocab_size=2,
        initializer_range=0.2, architectures=["BertModel"], **overrides)
    torch.manual_seed(0)
    model = transformers.BertModel(config).float()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    for name, content in (st_files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(json.dumps(content))
    return path


MEAN_NORMALIZE = {
    "modules.json": [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}],
    "1_Pooling/config.json": {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
                              "pooling_mode_mean_tokens": True},
    "sentence_bert_config.json": {"max_seq_length": 100, "do_lower_case": False},
    "config_sentence_transformers.json": {"matryoshka_dimensions": [16, 32]},
}


def inputs(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENS]


@torch.no_grad()
def hf_embeddings(model, prompts, pooling: str, normalize: bool) -> torch.Tensor:
    rows = []
    for ids in prompts:
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        row = {"cls": hidden[0], "mean": hidden.mean(0), "last": hidden[-1]}[pooling]
        rows.append(F.normalize(row, dim=-1) if normalize else row)
    return torch.stack(rows)


def embed_all(engine: LLMEngine, prompts, *, seed: int, group: int,
              params: PoolingParams | None = None) -> torch.Tensor:
    """Requests of ``group`` inputs each, added in a shuffled order; rows back in input order."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    chunks = [order[i:i + group] for i in range(0, len(order), group)]
    for n, chunk in enumerate(chunks):
        engine.add_request(f"r{n}", [prompts[i] for i in chunk], params or PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    rows: list[torch.Tensor | None] = [None] * len(prompts)
    for n, chunk in enumerate(chunks):
        for i, vector in zip(chunk, done[f"r{n}"].embeddings, strict=True):
            rows[i] = vector
    return torch.stack(rows)


@contextmanager
def two_rank_engine(path, **options) -> Iterator[LLMEngine]:
    """An embedding engine over two ranks (the tensor-parallel pooling runner); its helper
    ranks stopped after."""
    from engine.distributed.pooling_runner import TPPoolingRunner

    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2,
                                    **options))
    assert isinstance(engine.model_runner, TPPoolingRunner)
    try:
        yield engine
    finally:
        engine.model_runner.close()


def qwen3_base_embedder(tmp_path, **overrides):
    """A Qwen3 base-model checkpoint (``Qwen3Model``: no output layer, unprefixed names) and
    transformers' model of it, in fp32."""
    causal = make_checkpoint(tmp_path / "lm", "qwen3", **overrides)
    base = transformers.Qwen3ForCausalLM.from_pretrained(causal).model.float()
    base.config.architectures = ["Qwen3Model"]
    base.save_pretrained(tmp_path / "base")
    transformers.AutoTokenizer.from_pretrained(causal).save_pretrained(tmp_path / "base")
    return tmp_path / "base", base


def assert_cosine(got: torch.Tensor, expected: torch.Tensor, at_least: float = 0.99999):
    cosine = F.cosine_similarity(got.double(), expected.double(), dim=-1)
    assert float(cosine.min()) >= at_least, cosine.tolist()


@pytest.fixture(scope="module")
def bert_cls(tmp_path_factory):
    path = make_bert(tmp_path_factory.mktemp("bert-cls"))
    model = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    prompts = inputs(model.config.vocab_size)
    return path, prompts, hf_embeddings(model, prompts, "cls", False)


@pytest.fixture(scope="module")
def bert_mean(tmp_path_factory):
    path = make_bert(tmp_path_factory.mktemp("bert-mean"), st_files=MEAN_NORMALIZE)
    model = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    prompts = inputs(model.config.vocab_size, seed=2)
    return path, prompts, hf_embeddings(model, prompts, "mean", True)


@pytest.mark.parametrize("mode", list(MODES))
def test_bert_cls_equals_transformers(bert_cls, mode):
    path, prompts, expected = bert_cls
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", **MODES[mode]))
    assert engine.is_embedding and engine.model_runner.num_kv_blocks == 0
    for seed, group in ((0, 1), (1, 5), (2, len(prompts))):
        assert_cosine(embed_all(engine, prompts, seed=seed, group=group), expected)
    stats = engine.get_stats()
    assert stats.num_kv_blocks == 0 and stats.num_generated_tokens == 0
    assert stats.num_prompt_tokens == 3 * sum(LENS)
    budget = engine.config.max_num_batched_tokens
    # Whole inputs only: a step over the budget is one input longer than the budget, alone.
    for tokens in stats.scheduled_tokens_hist:
        assert tokens <= budget or tokens in LENS


def test_bert_mean_normalize_from_sentence_transformers_files(bert_mean):
    path, prompts, expected = bert_mean
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32",
                                    max_num_batched_tokens=64))
    pooler = engine.model_runner.pooler
    assert (pooler.pooling_type.value, pooler.normalize, pooler.max_seq_len) == ("mean", True, 100)
    assert engine.max_model_len == 100  # sentence_bert_config's max_seq_length
    got = embed_all(engine, prompts[:-4] + prompts[-3:], seed=3, group=4)
    assert_cosine(got, torch.cat([expected[:-4], expected[-3:]]))
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(got)), atol=1e-5)


def test_engine_options_override_the_files(bert_mean, bert_cls):
    path, prompts, _ = bert_mean
    model = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", pooling="cls",
                                    normalize=False, max_model_len=128))
    assert engine.max_model_len == 128
    assert_cosine(embed_all(engine, prompts, seed=0, group=3),
                  hf_embeddings(model, prompts, "cls", False))


def test_matryoshka_dimensions(bert_mean):
    path, prompts, _ = bert_mean
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    full = embed_all(engine, prompts[:4], seed=0, group=4)
    cut = embed_all(engine, prompts[:4], seed=0, group=4, params=PoolingParams(dimensions=16))
    assert cut.shape == (4, 16)
    assert_cosine(cut, F.normalize(full[:, :16], dim=-1))
    assert torch.allclose(cut.norm(dim=-1), torch.ones(4), atol=1e-5)
    with pytest.raises(DimensionsNotSupported, match="one of \\[16, 32\\]"):
        engine.add_request("x", prompts[0], PoolingParams(dimensions=20))
    with pytest.raises(DimensionsNotSupported, match="at most 64"):
        engine.add_request("x", prompts[0], PoolingParams(dimensions=65))


def test_checked_inputs_are_added_without_a_second_check(bert_mean, monkeypatch):
    path, prompts, _ = bert_mean
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    params = PoolingParams(dimensions=16)
    checked = engine.check_embedding(["hello there", prompts[0]], params)
    assert checked.token_ids[1] == prompts[0] and checked.params is params
    with pytest.raises(DimensionsNotSupported):
        engine.check_embedding(prompts[0], PoolingParams(dimensions=20))

    def no_second_check(*args, **kwargs):
        raise AssertionError("add_request checked the inputs again")

    monkeypatch.setattr(engine, "_tokenize", no_second_check)
    monkeypatch.setattr("engine.llm_engine.check_dimensions", no_second_check)
    engine.add_request("checked", checked, params)
    with pytest.raises(ValueError, match="params differ"):
        engine.add_request("other", checked, PoolingParams())
    (output,) = [o for _ in range(4) for o in engine.step()]
    assert output.request_id == "checked" and [e.shape for e in output.embeddings] == [(16,)] * 2


@pytest.mark.parametrize("kind", ["qwen3-base", "llama-causal-lm-as-embedder",
                                  "gemma2-windowed-soft-capped-as-embedder"])
def test_decoder_last_token_equals_transformers(tmp_path, kind):
    if kind.startswith("gemma2"):
        # Gemma 2's layers alternate a sliding window (16 here: shorter than most inputs) with
        # full attention, and soft-cap their scores: the packed backend's per-sequence path.
        path = make_checkpoint(tmp_path / "lm", "gemma2", sliding_window=16,
                               attn_logit_softcapping=20.0)
        options = {"task": "embed"}
        base = transformers.Gemma2ForCausalLM.from_pretrained(
            path, attn_implementation="eager").model.float()
    elif kind == "qwen3-base":
        path, base = qwen3_base_embedder(tmp_path)
        options = {}
    else:
        path, options = make_checkpoint(tmp_path / "lm", "llama"), {"task": "embed"}
        base = transformers.LlamaForCausalLM.from_pretrained(path).model.float()
    base = base.eval()
    prompts = inputs(base.config.vocab_size, seed=4)
    expected = hf_embeddings(base, prompts, "last", False)
    for mode in ("default", "tiny-budget", "one-at-a-time"):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", **options,
                                        **MODES[mode]))
        assert engine.is_embedding
        assert_cosine(embed_all(engine, prompts, seed=5, group=3), expected)


def test_typed_errors_and_truncation(bert_cls):
    path, prompts, _ = bert_cls
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    vocab = engine.model_runner.vocab_size
    with pytest.raises(EmptyInput):
        engine.add_request("a", [], PoolingParams())
    with pytest.raises(ValueError, match="lora_name"):  # an embedder runs no adapter
        engine.add_request("a", "fine", PoolingParams(), lora_name="adapter")
    with pytest.raises(EmptyInput) as empty_string:
        engine.add_request("a", ["fine", ""], PoolingParams())
    assert empty_string.value.index == 1
    with pytest.raises(TokenOutOfVocabulary, match=f"0 to {vocab - 1}"):
        engine.add_request("a", [[1, 2], [3, vocab]], PoolingParams())
    with pytest.raises(InputTooLong, match="maximum input length is 128 tokens") as too_long:
        engine.add_request("a", [[1] * 5, [1] * 129], PoolingParams())
    assert too_long.value.index == 1
    with pytest.raises(DimensionsNotSupported, match="declares no Matryoshka"):
        engine.add_request("a", [[1, 2]], PoolingParams(dimensions=8))
    with pytest.raises(NotAnEmbeddingModel):
        engine.add_request("a", [1, 2], SamplingParams())
    assert not engine.has_unfinished_requests()  # nothing half-added

    truncating = LLMEngine(EngineConfig(model=str(path), dtype="float32",
                                        truncate_embedding_inputs=True))
    long = list(range(3, 203))
    got = embed_all(truncating, [long, long[:128]], seed=0, group=2)
    assert_cosine(got[:1], got[1:])


def test_generation_engine_refuses_pooling(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    assert not engine.is_embedding
    with pytest.raises(NotAnEmbeddingModel, match="does not embed"):
        engine.add_request("a", [1, 2, 3], PoolingParams())


def test_abort_and_priority(bert_cls):
    path, prompts, expected = bert_cls
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32",
                                    max_num_batched_tokens=130))
    engine.add_request("bulk", prompts, PoolingParams(), priority=5)
    engine.add_request("urgent", prompts[:2], PoolingParams(), priority=-1)
    first = engine.step()
    assert [o.request_id for o in first] == ["urgent"]  # the urgent inputs went first
    aborted = engine.abort_request("bulk")
    assert aborted[0].embeddings is not None and len(aborted[0].embeddings) == len(prompts)
    assert not engine.has_unfinished_requests()


def test_a_sentence_transformers_decoder_folder_embeds_without_options(tmp_path):
    """Qwen3-Embedding's layout: a causal-LM checkpoint with modules.json (last-token pooling,
    Normalize): ``task='auto'`` makes it an embedder."""
    path = make_checkpoint(tmp_path / "qwen3-embedding", "qwen3")
    files = {
        "modules.json": [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}],
        "1_Pooling/config.json": {"pooling_mode_lasttoken": True},
    }
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(json.dumps(content))
    base = transformers.Qwen3ForCausalLM.from_pretrained(path).model.float().eval()
    prompts = inputs(base.config.vocab_size, seed=6)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    assert engine.is_embedding
    assert_cosine(embed_all(engine, prompts, seed=1, group=4),
                  hf_embeddings(base, prompts, "last", True))
    generating = LLMEngine(EngineConfig(model=str(path), dtype="float32", task="generate"))
    assert not generating.is_embedding


@pytest.mark.parametrize("kind", ["qwen3-base", "gemma2-windowed-soft-capped-as-embedder"])
def test_a_decoder_embedder_over_two_ranks_equals_one(tmp_path, kind):
    # The decoder split as its generating family is (heads, MLP columns, vocabulary rows; a
    # base-model checkpoint's unprefixed names too); the driver pools the whole final state.
    if kind == "qwen3-base":
        path, _ = qwen3_base_embedder(tmp_path, vocab_size=387)  # odd: padded rows
        options = {}
    else:
        path = make_checkpoint(tmp_path / "lm", "gemma2", sliding_window=16,
                               attn_logit_softcapping=20.0)
        options = {"task": "embed"}
    prompts = inputs(300, seed=4)
    one = LLMEngine(EngineConfig(model=str(path), dtype="float32", **options))
    expected = embed_all(one, prompts, seed=5, group=3)
    with two_rank_engine(path, **options, **MODES["tiny-budget"]) as two:
        got = embed_all(two, prompts, seed=5, group=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_bert_encoder_over_two_ranks_equals_one(bert_cls):
    # Heads and MLP columns split, the attention and layer outputs all-reduced (their biases
    # rank 0's), the word embeddings' vocabulary split, LayerNorms and position embeddings whole.
    path, prompts, expected = bert_cls
    with two_rank_engine(path) as two:
        got = embed_all(two, prompts, seed=0, group=5)
    assert_cosine(got, expected)
