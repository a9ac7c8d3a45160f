"""A BERT cross-encoder (``BertForSequenceClassification``, one label) on the packed pooling path,
against sentence-transformers' ``CrossEncoder.predict`` on a tiny random checkpoint in fp32:
the pair ``[CLS] a [SEP] b [SEP]`` with its token types, the [CLS] state through the pooler and
the classifier, the activation its sentence-transformers config says (sigmoid by default,
identity when ``activation_fn`` says so); packed in any order and step budget."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from engine import EngineConfig, LLMEngine
from engine.layers.pooling import ScoreActivation, read_score_activation
from engine.pooling.inputs import pair_token_ids
from engine.pooling_params import PoolingParams

WORDS = ("search index cluster vector batch offline corpus query document retrieval token "
         "model paris france capital city river bank money the a of and to in is what").split()


def bert_tokenizer(path):
    """A WordPiece BERT tokenizer with [CLS]/[SEP] pair encoding and token types."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *letters,
             *(f"##{c}" for c in letters), ".", "?", ","]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    tokenizer = transformers.BertTokenizerFast(str(path / "vocab.txt"), do_lower_case=True)
    tokenizer.model_max_length = 128
    return tokenizer


def make_cross_encoder(path, activation: torch.nn.Module | None = None):
    """A random one-label BertForSequenceClassification folder; with ``activation``, saved again
    by sentence-transformers' ``CrossEncoder`` with it (its own files say it)."""
    tokenizer = bert_tokenizer(path)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, type_vocab_size=2, num_labels=1,
        initializer_range=0.2, architectures=["BertForSequenceClassification"])
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).float()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if activation is None:
        return path
    from sentence_transformers import CrossEncoder

    saved = path.with_name(path.name + "-st")
    CrossEncoder(str(path), device="cpu", activation_fn=activation).save(str(saved))
    return saved


def pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))

    return [(text(), text()) for _ in range(n)]


def engine_scores(engine: LLMEngine, items: list[tuple[str, str]], *, group: int,
                  seed: int) -> list[float]:
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    chunks = [order[i:i + group] for i in range(0, len(order), group)]
    for n, chunk in enumerate(chunks):
        encoded = [pair_token_ids(engine.encode(items[i][0]), engine.encode(items[i][1]))
                   for i in chunk]
        params = PoolingParams(token_type_starts=tuple(start for _, start in encoded))
        engine.add_request(f"r{n}", [ids for ids, _ in encoded], params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    scores = [0.0] * len(items)
    for n, chunk in enumerate(chunks):
        for i, vector in zip(chunk, done[f"r{n}"].embeddings, strict=True):
            assert vector is not None and vector.shape == (1,)
            scores[i] = float(vector[0])
    return scores


@pytest.mark.parametrize("activation", [None, torch.nn.Identity()], ids=["default", "identity"])
@pytest.mark.parametrize("budget", [4096, 48])
def test_cross_encoder_equals_sentence_transformers(tmp_path, activation, budget):
    from sentence_transformers import CrossEncoder

    path = make_cross_encoder(tmp_path / "ce", activation)
    items = pairs(23)
    reference = CrossEncoder(str(path), device="cpu").predict(items, batch_size=7)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32",
                                    max_num_batched_tokens=budget))
    assert engine.embedding is not None and engine.embedding.cross_encoder
    for seed, group in ((0, 1), (1, 5), (2, len(items))):
        got = engine_scores(engine, items, group=group, seed=seed)
        assert torch.allclose(torch.tensor(got), torch.tensor(reference, dtype=torch.float32),
                              atol=1e-5, rtol=1e-5), (got, reference)
    if activation is None:  # sigmoid: in (0, 1)
        assert all(0 < s < 1 for s in got)
    else:
        assert any(s < 0 or s > 1 for s in got)
    # No padding: the packed step computes exactly the pairs' tokens.
    tokens = sum(len(pair_token_ids(engine.encode(a), engine.encode(b))[0]) for a, b in items)
    assert engine.get_stats().num_prompt_tokens == 3 * tokens


def test_pair_token_ids_are_the_tokenizers_pair_encoding(tmp_path):
    tokenizer = bert_tokenizer(tmp_path / "tok")
    for a, b in pairs(10, seed=3):
        encoded = tokenizer(a, b)
        ids, start = pair_token_ids(tokenizer(a).input_ids, tokenizer(b).input_ids)
        assert ids == encoded.input_ids
        assert [int(i >= start) for i in range(len(ids))] == encoded.token_type_ids


def test_activation_from_the_sentence_transformers_files(tmp_path):
    config = transformers.BertConfig(num_labels=1)
    assert read_score_activation(None, config) is ScoreActivation.SIGMOID
    config.sentence_transformers = {"activation_fn": "torch.nn.modules.linear.Identity"}
    assert read_score_activation(None, config) is ScoreActivation.IDENTITY
    (tmp_path / "config_sentence_transformers.json").write_text(
        json.dumps({"activation_fn": "torch.nn.modules.activation.Tanh"}))
    assert read_score_activation(tmp_path, config) is ScoreActivation.TANH
    (tmp_path / "config_sentence_transformers.json").write_text(
        json.dumps({"activation_fn": "torch.nn.modules.activation.ReLU"}))
    with pytest.raises(ValueError, match="activation_fn"):
        read_score_activation(tmp_path, config)


def test_more_than_one_label_is_refused(tmp_path):
    path = make_cross_encoder(tmp_path / "ce")
    config = json.loads((path / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b"}
    config["label2id"] = {"a": 0, "b": 1}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_labels=2"):
        LLMEngine(EngineConfig(model=str(path), dtype="float32"))


def test_auto_dtype_serves_a_cross_encoder_in_fp32(tmp_path):
    path = make_cross_encoder(tmp_path / "ce")
    engine = LLMEngine(EngineConfig(model=str(path), dtype="auto"))
    assert engine.model_runner.dtype == torch.float32
    assert engine.embedding is not None and engine.embedding.hidden_size == 1


def test_a_cross_encoder_over_two_ranks_equals_sentence_transformers(tmp_path):
    # The encoder split over two ranks (token types and the pooler/classifier head whole on
    # each), the driver's [CLS] state scored: CrossEncoder's numbers.
    from sentence_transformers import CrossEncoder

    from tests.engine.test_embeddings import two_rank_engine

    path = make_cross_encoder(tmp_path / "ce", None)
    items = pairs(11)
    reference = CrossEncoder(str(path), device="cpu").predict(items, batch_size=4)
    with two_rank_engine(path) as engine:
        got = engine_scores(engine, items, group=3, seed=0)
    assert torch.allclose(torch.tensor(got), torch.tensor(reference, dtype=torch.float32),
                          atol=1e-5, rtol=1e-5), (got, reference)
