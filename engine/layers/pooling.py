"""Pooling: one vector per packed sequence out of its final hidden states (CLS, MEAN or LAST),
optionally L2-normalized, optionally cut to fewer (Matryoshka) dimensions.

``read_pooler_config`` reads what sentence-transformers stores beside a model: ``modules.json``
(which modules run: a ``Pooling`` module's folder, whether a ``Normalize`` follows),
``<pooling folder>/config.json`` (``pooling_mode_cls_token`` / ``_mean_tokens`` /
``_lasttoken``), ``sentence_bert_config.json`` (``max_seq_length``) and
``config_sentence_transformers.json`` (``matryoshka_dimensions`` where a model declares them;
config.json's ``matryoshka_dimensions`` too). Whatever the files do not say comes from the
architecture's defaults (an encoder: CLS; a decoder: LAST) and the engine's options win over both.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


class PoolingType(enum.Enum):
    CLS = "cls"  # the first token's state (BERT's [CLS])
    MEAN = "mean"  # the mean over the sequence's tokens
    LAST = "last"  # the last token's state (a decoder's: it has seen every token)


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: PoolingType
    normalize: bool
    # The longest input the model takes (sentence-transformers' max_seq_length), if it says.
    max_seq_len: int | None = None
    # Matryoshka dimensions the model declares; None: it declares none (``dimensions`` refused).
    matryoshka_dimensions: tuple[int, ...] | None = None


_ST_MODES = (
    ("pooling_mode_cls_token", PoolingType.CLS),
    ("pooling_mode_mean_tokens", PoolingType.MEAN),
    ("pooling_mode_lasttoken", PoolingType.LAST),
)
_UNSUPPORTED_ST_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from error


def read_pooler_config(folder: Path | None, default_pooling: PoolingType,
                       hf_config: Any = None) -> PoolerConfig:
    """The pooling a model folder declares (module docstring); ``default_pooling`` and no
    normalization where it declares none."""
    pooling, normalize = default_pooling, False
    max_seq_len: int | None = None
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if folder is not None and folder.is_dir():
        modules_file = folder / "modules.json"
        if modules_file.is_file():
            modules = _read_json(modules_file)
            for module in modules if isinstance(modules, list) else []:
                kind = str(module.get("type", ""))
                if kind.endswith(".Pooling"):
                    pooling = _st_pooling(folder / str(module.get("path", "")) / "config.json")
                elif kind.endswith(".Normalize"):
                    normalize = True
        st_config = folder / "sentence_bert_config.json"
        if st_config.is_file():
            value = _read_json(st_config).get("max_seq_length")
            max_seq_len = int(value) if isinstance(value, int) and value > 0 else None
        st_extra = folder / "config_sentence_transformers.json"
        if st_extra.is_file():
            dims = _read_json(st_extra).get("matryoshka_dimensions", dims)
    matryoshka = None
    if dims:
        if not isinstance(dims, list | tuple) or not all(isinstance(d, int) and d > 0
                                                         for d in dims):
            raise ValueError(f"matryoshka_dimensions must be a list of positive integers, "
                             f"got {dims!r}")
        matryoshka = tuple(sorted(set(dims)))
    return PoolerConfig(pooling, normalize, max_seq_len, matryoshka)


def _st_pooling(path: Path) -> PoolingType:
    config = _read_json(path)
    chosen = [kind for key, kind in _ST_MODES if config.get(key)]
    unsupported = [key for key in _UNSUPPORTED_ST_MODES if config.get(key)]
    if unsupported or len(chosen) != 1:
        raise ValueError(f"{path}: boxcar pools with exactly one of CLS, MEAN or LAST "
                         f"(pooling_mode_cls_token, _mean_tokens, _lasttoken); this one sets "
                         f"{[key for key, value in config.items() if value is True]}")
    return chosen[0]


def pool(
    hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
    seq_lens: list[int],
    pooling_type: PoolingType,
) -> torch.Tensor:  # [num_seqs, hidden_size], fp32
    """One fp32 vector per packed sequence (sequences back to back, ``seq_lens`` tokens each)."""
    device = hidden_states.device
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    ends = torch.cumsum(lens, 0)
    if pooling_type is PoolingType.CLS:
        return hidden_states.index_select(0, ends - lens).float()
    if pooling_type is PoolingType.LAST:
        return hidden_states.index_select(0, ends - 1).float()
    seq_ids = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens)
    sums = torch.zeros(len(seq_lens), hidden_states.shape[1], dtype=torch.float32, device=device)
    sums.index_add_(0, seq_ids, hidden_states.float())
    return sums / lens[:, None].to(torch.float32)


def finish_embedding(vector: torch.Tensor, *, normalize: bool,
                     dimensions: int | None) -> torch.Tensor:
    """Cut a pooled ``[hidden_size]`` vector to ``dimensions`` (Matryoshka) and normalize it if
    the model does (a cut vector of a normalizing model is normalized again, as OpenAI's and
    sentence-transformers' ``truncate_dim`` are)."""
    if dimensions is not None:
        vector = vector[:dimensions]
    return F.normalize(vector, p=2, dim=-1) if normalize else vector


class ScoreActivation(enum.Enum):
    """What a cross-encoder puts on its logit (sentence-transformers' ``activation_fn``)."""

    SIGMOID = "Sigmoid"
    IDENTITY = "Identity"
    TANH = "Tanh"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self is ScoreActivation.SIGMOID:
            return torch.sigmoid(logits)
        if self is ScoreActivation.TANH:
            return torch.tanh(logits)
        return logits


def read_score_activation(folder: Path | None, hf_config: Any) -> ScoreActivation:
    """A cross-encoder's activation as sentence-transformers' ``CrossEncoder`` picks it: the
    ``activation_fn`` of ``config_sentence_transformers.json``, else config.json's
    ``sentence_transformers.activation_fn``, else its older
    ``sbert_ce_default_activation_function``; sigmoid for one label where none says. A path
    outside ``torch.`` is what CrossEncoder runs only with ``trust_remote_code``, so it falls back
    to the default as CrossEncoder does; a torch activation other than these is refused."""
    saved = None
    if folder is not None and (folder / "config_sentence_transformers.json").is_file():
        saved = _read_json(folder / "config_sentence_transformers.json").get("activation_fn")
    st = getattr(hf_config, "sentence_transformers", None)
    if isinstance(st, dict) and "activation_fn" in st:
        configured = st["activation_fn"]
    else:
        configured = getattr(hf_config, "sbert_ce_default_activation_function", None)
    for path in (saved, configured):
        if isinstance(path, str) and path.startswith("torch."):
            name = path.rsplit(".", 1)[-1]
            try:
                return ScoreActivation(name)
            except ValueError:
                raise ValueError(f"activation_fn {path!r} is not supported; supported: "
                                 f"{[a.value for a in ScoreActivation]}") from None
    return ScoreActivation.SIGMOID  # one label (BertForSequenceClassification checks it)
