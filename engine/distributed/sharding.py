"""Which share of the model a rank holds (Megatron-style, Shoeybi et al. 2019), and the layers that
join the shares.

Column-parallel: q/k/v and gate/up keep a rank's heads and its slice of the intermediate size, so
attention and the activation run on local data. Row-parallel: ``o_proj`` and ``down_proj`` take
that local data and yield a partial sum of the full hidden state; one all-reduce each completes
it. KV heads split with the query heads that read them; with fewer KV heads than ranks each rank
keeps the one its query heads use (replicated). The embedding and the output layer split the
vocabulary: a rank looks up only its ids (the others' rows are zero, the all-reduce fills them)
and computes only its logits (an all-gather joins them for the sampler).

The rank's model is the family's own class built from a config with the local sizes (heads, KV
heads, intermediate size, vocabulary share), so no family file knows about ranks; ``shard_model``
then turns its row-parallel and vocabulary layers into the classes below (same parameters and
names, one collective added).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.group import TPGroup
from engine.layers.attention import SelfAttention
from engine.layers.linear import Linear
from engine.layers.mlp import GatedMLP
from engine.layers.moe import SparseMoeBlock
from engine.layers.norm import RMSNorm
from engine.lora.layers import LoRALinear
from engine.models.bert import BertEmbeddings, BertOutput, BertSelfOutput
from engine.models.mxfp4 import GROUP_SIZE as MXFP4_GROUP

# A per-expert checkpoint tensor: ``<head><expert index><tail>``.
_PER_EXPERT = re.compile(r"^(?P<head>.*\.experts\.)(?P<expert>\d+)(?P<tail>\..*)$")


def is_vocabulary(name: str) -> bool:
    """The embedding or the output layer (a base-model checkpoint names its embedding without
    the ``model.`` prefix; BERT's are its word embeddings, ``bert.``-prefixed in a task head's
    checkpoint)."""
    return name in ("model.embed_tokens.weight", "embed_tokens.weight", "lm_head.weight",
                    "embeddings.word_embeddings.weight",
                    "bert.embeddings.word_embeddings.weight")


# A BERT encoder's projections by their roles in a decoder layer (the first match wins:
# ``attention.output.dense`` before the layer's ``output.dense``).
_ENCODER_PROJECTIONS = {"attention.self.query": "q_proj", "attention.self.key": "k_proj",
                        "attention.self.value": "v_proj", "attention.output.dense": "o_proj",
                        "intermediate.dense": "up_proj", "output.dense": "down_proj"}


def _projection(name: str) -> str:
    """The projection a tensor belongs to, in the decoder families' names: a BERT encoder's
    query is a ``q_proj``, its intermediate dense an ``up_proj``, its output dense a
    ``down_proj``, so one set of rules splits both."""
    if ".encoder.layer." in f".{name}":
        for path, projection in _ENCODER_PROJECTIONS.items():
            if f".{path}." in name:
                return projection
    return name.split(".")[-2] if "." in name else name


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``world_size``: the ranges of heads, KV heads, intermediate columns and
    vocabulary rows it holds."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    # A mixture of experts: each expert's intermediate size (``moe_intermediate_size``, else
    # ``intermediate_size``) and the shared expert's (Qwen2-MoE), split like a dense MLP's.
    expert_intermediate: int | None = None
    shared_intermediate: int | None = None
    # Expert parallel: the experts spread whole over the ranks, not each split across them.
    num_experts: int | None = None
    expert_parallel: bool = False
    split_intermediate: bool = True  # False: intermediate_size sizes only whole experts

    @classmethod
    def of(cls, hf_config: Any, rank: int, world_size: int, *,
           expert_parallel: bool = False) -> ShardPlan:
        from engine.models.llama import head_dim_of

        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        inter = hf_config.intermediate_size
        if heads % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} must divide the model's "
                             f"num_attention_heads ({heads})")
        if kv_heads % world_size and world_size % kv_heads:
            raise ValueError(f"tensor_parallel_size={world_size} must divide the model's "
                             f"num_key_value_heads ({kv_heads}) or be a multiple of it")
        experts_field = next((f for f in ("num_experts", "num_local_experts")
                              if getattr(hf_config, f, None)), None)
        is_moe = experts_field is not None
        num_experts = getattr(hf_config, experts_field) if experts_field else None
        if expert_parallel:
            architecture = (getattr(hf_config, "architectures", None) or ["this model"])[0]
            if num_experts is None:
                raise ValueError(f"expert_parallel spreads a mixture of experts' experts over "
                                 f"the ranks; {architecture} is dense: leave expert_parallel off")
            if num_experts % world_size:
                raise ValueError(f"expert_parallel: tensor_parallel_size={world_size} must "
                                 f"divide the model's {experts_field} ({num_experts})")
        expert_field = ("moe_intermediate_size" if getattr(hf_config, "moe_intermediate_size", None)
                        else "intermediate_size")
        # Mixtral, OLMoE and gpt-oss size their experts by intermediate_size and have no dense
        # MLP: under expert parallel nothing of that size is split.
        split_intermediate = not (expert_parallel and is_moe
                                  and expert_field == "intermediate_size")
        sizes = {"intermediate_size": inter} if split_intermediate else {}
        if is_moe and not expert_parallel:  # (expert parallel keeps each expert whole)
            sizes[expert_field] = getattr(hf_config, expert_field)
        if is_moe and getattr(hf_config, "shared_expert_intermediate_size", None):
            sizes["shared_expert_intermediate_size"] = hf_config.shared_expert_intermediate_size
        for field, size in sizes.items():
            if size % world_size:
                raise ValueError(f"tensor_parallel_size={world_size} must divide the model's "
                                 f"{field} ({size})")
        quant = getattr(hf_config, "quantization_config", None) or {}
        if (is_moe and not expert_parallel
                and (quant.get("quant_method") if isinstance(quant, dict) else None) == "mxfp4"):
            expert_size = sizes[expert_field]
            if (expert_size // world_size) % MXFP4_GROUP:
                raise ValueError(
                    f"tensor_parallel_size={world_size} splits the MXFP4 experts' "
                    f"{expert_field} ({expert_size}) into {expert_size // world_size} columns a "
                    f"rank, not a whole number of {MXFP4_GROUP}-value groups")
        return cls(rank, world_size, heads, kv_heads, head_dim_of(hf_config), inter,
                   hf_config.vocab_size,
                   sizes.get(expert_field) if is_moe and not expert_parallel else None,
                   sizes.get("shared_expert_intermediate_size"), num_experts, expert_parallel,
                   split_intermediate)

    @property
    def held_experts(self) -> tuple[int, int] | None:
        """Expert parallel: (first, count) of the experts this rank holds whole; else None."""
        if not self.expert_parallel or self.num_experts is None:
            return None
        count = self.num_experts // self.world_size
        return self.rank * count, count

    def local_expert_name(self, name: str) -> str | None:
        """Expert parallel: a per-expert checkpoint name (``...experts.7.w1.weight``) with the
        expert's index on this rank, None for another rank's expert; other names unchanged."""
        held = self.held_experts
        match = _PER_EXPERT.match(name) if held is not None else None
        if match is None or held is None:
            return name
        local = int(match["expert"]) - held[0]
        if not 0 <= local < held[1]:
            return None
        return f"{match['head']}{local}{match['tail']}"

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        return max(self.num_kv_heads // self.world_size, 1)

    @property
    def kv_head_start(self) -> int:
        if self.num_kv_heads >= self.world_size:
            return self.rank * self.local_kv_heads
        return self.rank * self.num_kv_heads // self.world_size  # replicated: this rank's one

    @property
    def local_intermediate(self) -> int:
        if not self.split_intermediate:
            return self.intermediate_size
        return self.intermediate_size // self.world_size

    @property
    def vocab_shard(self) -> int:
        """Rows of the vocabulary each rank holds (the last one's tail is padding)."""
        return -(-self.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def local_config(self, hf_config: Any) -> Any:
        """The config a family class builds this rank's share from."""
        local = copy.copy(hf_config)
        local.num_attention_heads = self.local_heads
        local.num_key_value_heads = self.local_kv_heads
        local.head_dim = self.head_dim  # not hidden / local heads
        local.intermediate_size = self.local_intermediate
        local.vocab_size = self.vocab_shard
        if self.expert_intermediate is not None and getattr(local, "moe_intermediate_size", None):
            local.moe_intermediate_size = self.expert_intermediate // self.world_size
        if self.shared_intermediate is not None:
            local.shared_expert_intermediate_size = self.shared_intermediate // self.world_size
        return local

    def _mlp_size(self, name: str) -> int:
        """The intermediate size of the MLP ``name`` belongs to: an expert's, the shared
        expert's, or the dense one's."""
        if ".experts." in name and self.expert_intermediate is not None:
            return self.expert_intermediate
        if ".shared_expert." in name and self.shared_intermediate is not None:
            return self.shared_intermediate
        return self.intermediate_size

    def row_slices(self, name: str) -> list[tuple[int, int]] | None:
        """For a column-parallel or vocabulary tensor: the (start, length) row ranges of the
        stored tensor this rank keeps, concatenated; None if it is not split by rows."""
        if self.expert_parallel and ".experts." in name:
            return None  # each expert whole on the rank that holds it
        proj = _projection(name)
        hd = self.head_dim
        q = self._heads_range
        kv = (self.kv_head_start * hd, self.local_kv_heads * hd)
        inter = self._intermediate_range(name)
        if proj == "q_proj":
            return [q]
        if proj in ("k_proj", "v_proj"):
            return [kv]
        if proj == "qkv_proj":  # stored fused (Phi-3): q rows, then k, then v
            q_rows, kv_rows = self.num_heads * hd, self.num_kv_heads * hd
            return [q, (q_rows + kv[0], kv[1]), (q_rows + kv_rows + kv[0], kv[1])]
        if proj in ("gate_proj", "up_proj") or (proj in ("w1", "w3") and ".experts." in name):
            return [inter]  # (Mixtral's experts: w1 the gate, w3 the up projection)
        if proj == "gate_up_proj":  # stored fused (Phi-3): gate rows, then up
            return [inter, (self._mlp_size(name) + inter[0], inter[1])]
        if name.endswith("self_attn.sinks"):  # one learned sink logit a query head (gpt-oss)
            return [(self.rank * self.local_heads, self.local_heads)]
        if is_vocabulary(name):
            start = self.vocab_start
            return [(start, max(min(self.vocab_shard, self.vocab_size - start), 0))]
        return None

    def norm_rows(self, name: str, size: int) -> tuple[int, int] | None:
        """For a q/k norm over every head at once (OLMoE; ``size`` values, not one head's):
        the (start, length) of this rank's heads' values."""
        hd = self.head_dim
        if name.endswith("self_attn.q_norm.weight") and size == self.num_heads * hd != hd:
            return self.rank * self.local_heads * hd, self.local_heads * hd
        if name.endswith("self_attn.k_norm.weight") and size == self.num_kv_heads * hd != hd:
            return self.kv_head_start * hd, self.local_kv_heads * hd
        return None

    def stacked_expert_slice(self, name: str) -> tuple[int, int, int] | None:
        """For experts stored stacked (gpt-oss: ``gate_up_proj [E, hidden, 2 * inter]`` with
        gate and up columns interleaved, ``down_proj [E, inter, hidden]``): (dim, start,
        length) of this rank's share. Interleaved pairs keep a rank's gate and up columns side
        by side, so its share of both is one run of columns."""
        if ".experts." not in name:
            return None
        held = self.held_experts
        if held is not None:  # every stacked expert tensor: this rank's experts, whole
            return (0, *held) if _PER_EXPERT.match(name) is None else None
        if self.expert_intermediate is None:
            return None
        local = self.expert_intermediate // self.world_size
        stored = name.rsplit(".", 1)[-1]
        if stored == "gate_up_proj":
            return 2, 2 * self.rank * local, 2 * local
        if stored in ("gate_up_proj_bias", "gate_up_proj_blocks", "gate_up_proj_scales"):
            return 1, 2 * self.rank * local, 2 * local  # MXFP4: [E, out, groups(, 16)]
        if stored == "down_proj":
            return 1, self.rank * local, local
        if stored in ("down_proj_blocks", "down_proj_scales"):  # groups of 32 inputs
            return 2, self.rank * local // MXFP4_GROUP, local // MXFP4_GROUP
        return None

    def is_row_parallel_bias(self, name: str) -> bool:
        """A bias added after a row-parallel product: rank 0 keeps it, the others hold zeros,
        so the all-reduce adds it once."""
        if ".experts." in name:  # (expert parallel: an expert's bias goes with the expert)
            return name.endswith("down_proj_bias") and not self.expert_parallel
        return name.endswith(".bias") and _projection(name) in ("o_proj", "down_proj")

    def column_slice(self, name: str) -> tuple[int, int] | None:
        """For a row-parallel weight: the (start, length) range of its input columns."""
        if (self.expert_parallel and ".experts." in name) or not name.endswith(".weight"):
            return None
        proj = _projection(name)
        if proj == "o_proj":
            return self._heads_range
        if proj == "down_proj" or (proj == "w2" and ".experts." in name):
            return self._intermediate_range(name)
        return None

    @property
    def _heads_range(self) -> tuple[int, int]:
        """(start, length) of this rank's query heads' values in a projection's rows (or, in a
        row-parallel one, its input columns)."""
        return self.rank * self.local_heads * self.head_dim, self.local_heads * self.head_dim

    def _intermediate_range(self, name: str) -> tuple[int, int]:
        """(start, length) of this rank's columns of the MLP ``name`` belongs to."""
        local = self._mlp_size(name) // self.world_size
        return self.rank * local, local


class RowParallelLinear(Linear):
    """A ``Linear`` over this rank's input columns: its product summed over the ranks."""

    group: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding, ``[vocab_start, vocab_start + rows)``; ids outside
    them give zeros here and their row on their own rank."""

    group: TPGroup
    vocab_start: int

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden = hidden.masked_fill(outside.unsqueeze(-1), 0)  # [num_tokens, hidden_size]
        return self.group.all_reduce(hidden)


class VocabParallelHead(Linear):
    """This rank's rows of the output layer: its logits, gathered into the whole vocabulary."""

    group: TPGroup
    vocab_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.group.all_gather(super().forward(x))  # world_size x [rows, vocab_shard]
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]  # [rows, vocab_size]


class ParallelHeadsNorm(RMSNorm):
    """An RMS norm over every head's values at once (OLMoE's q/k norms) when a rank holds only
    its heads': the sum of squares is all-reduced, so each rank scales by the whole vector's
    mean. ``replicas``: how many ranks hold each of its heads (KV heads fewer than ranks)."""

    group: TPGroup
    full_size: int
    replicas: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = self.group.all_reduce(x.float().pow(2).sum(dim=-1, keepdim=True))
        normed = x.float() * torch.rsqrt(squares / (self.replicas * self.full_size) + self.eps)
        if x.dtype == torch.float32:
            return normed * self.weight
        return self.weight * normed.to(x.dtype)


class ParallelMoeBlock(SparseMoeBlock):
    """A ``SparseMoeBlock`` whose experts (and shared expert) hold this rank's slice of their
    intermediate size: the router runs whole on every rank, each expert's partial sum and the
    shared expert's add up here, and one all-reduce completes them, as for a dense MLP."""

    group: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


def shard_model(model: nn.Module, plan: ShardPlan, group: TPGroup) -> None:
    """Give the rank's model its collectives: the row-parallel projections all-reduce (a
    mixture-of-experts block once, after its experts and shared expert), the embedding and the
    output layer work on this rank's vocabulary rows."""
    in_moe: set[int] = set()
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            in_moe.update(id(m) for m in module.modules() if m is not module)
            module.__class__ = ParallelMoeBlock
            assert isinstance(module, ParallelMoeBlock)
            module.group = group
    for module in model.modules():
        if id(module) in in_moe:
            continue  # the shared expert's partial sum joins the experts' before the all-reduce
        if isinstance(module, SelfAttention):
            _share_heads_norms(module, plan, group)
        if isinstance(module, SelfAttention | GatedMLP):
            proj = module.o_proj if isinstance(module, SelfAttention) else module.down_proj
            proj.__class__ = RowParallelLinear  # a bias: rank 0's only (is_row_parallel_bias)
            assert isinstance(proj, RowParallelLinear)
            proj.group = group
    embed = model.get_submodule("model.embed_tokens")
    if type(embed) is not nn.Embedding:
        raise ValueError(f"tensor parallelism needs a plain embedding, got {type(embed)}")
    embed.__class__ = VocabParallelEmbedding
    assert isinstance(embed, VocabParallelEmbedding)
    embed.group, embed.vocab_start = group, plan.vocab_start
    if not hasattr(model, "lm_head"):
        return  # an embedder's decoder: no output layer
    head = model.get_submodule("lm_head")
    head.__class__ = VocabParallelHead
    assert isinstance(head, VocabParallelHead)
    head.group, head.vocab_size = group, plan.vocab_size


def _share_heads_norms(attention: SelfAttention, plan: ShardPlan, group: TPGroup) -> None:
    """Turn q/k norms over all of the layer's heads (not one head's ``head_dim`` values) into
    ``ParallelHeadsNorm``s."""
    if not attention.norms_span_heads:
        return  # no q/k norms, or one head's (Qwen3): a rank computes them alone
    for name, num_heads in (("q_norm", plan.num_heads), ("k_norm", plan.num_kv_heads)):
        norm = getattr(attention, name)
        assert isinstance(norm, RMSNorm)
        norm.__class__ = ParallelHeadsNorm
        assert isinstance(norm, ParallelHeadsNorm)
        norm.group, norm.full_size = group, num_heads * plan.head_dim
        norm.replicas = max(plan.world_size // num_heads, 1)


class RowParallelLoRALinear(LoRALinear):
    """A row-parallel projection with LoRA: the rank's product and its partial delta (this
    rank's columns of A), summed by one all-reduce after both, as ``RowParallelLinear`` sums
    the product alone."""

    group: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


def reduce_after_lora(linear: LoRALinear, group: TPGroup) -> None:
    """Move a ``RowParallelLinear``'s all-reduce out to the ``LoRALinear`` that wraps it."""
    linear.base.__class__ = Linear
    linear.__class__ = RowParallelLoRALinear
    assert isinstance(linear, RowParallelLoRALinear)
    linear.group = group


def shard_encoder(model: nn.Module, plan: ShardPlan, group: TPGroup) -> None:
    """A BERT encoder's collectives: the attention output and the layer output all-reduce
    (their biases are rank 0's), the word embeddings are this rank's vocabulary rows."""
    for module in model.modules():
        if isinstance(module, BertSelfOutput | BertOutput):
            module.dense.__class__ = RowParallelLinear
            assert isinstance(module.dense, RowParallelLinear)
            module.dense.group = group
        elif isinstance(module, BertEmbeddings):
            embed = module.word_embeddings
            embed.__class__ = VocabParallelEmbedding
            assert isinstance(embed, VocabParallelEmbedding)
            embed.group, embed.vocab_start = group, plan.vocab_start
