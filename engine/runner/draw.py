"""Drawing one token a row from temperature-scaled logits: top-k, top-p and min-p, then the draw.

Truncation without sorting the vocabulary: a row with top-k or top-p is cut from its best few
candidates (``topk``), which is exact when the kept set lies inside them: top-k keeps the tokens
at or above the k-th value, top-p the smallest prefix (by descending probability) whose mass
reaches top_p plus any token tied with its last, min-p the tokens at or above min_p times the top
probability. A row whose kept set may reach past its candidates tries wider ones, then a sort.

The draw is by inverse CDF: one uniform per row, over the kept tokens in token-id order (a
row's outcome does not depend on how many candidates it was cut from), or over the whole
vocabulary for a row without top-k or top-p. A request with a seed takes its uniform from its own
generator, one per token, so its output never depends on what else is in the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Candidate widths. A row starts at its top_k rounded up to a power of two (at least MIN_WIDTH),
# so rows with near top_k share one topk call, or at TOP_P_WIDTH for top-p alone; a row whose kept
# set does not fit moves on to RETRY_WIDTH, then to a sort of the whole row. A width past a
# quarter of the vocabulary is a sort: topk costs about as much there.
MIN_WIDTH = 64
TOP_P_WIDTH = 256
RETRY_WIDTH = 4096
# The full-vocabulary draw picks a block of this many tokens by the blocks' totals, then a token
# inside it: two short cumulative sums in float64 instead of one over the vocabulary.
DRAW_BLOCK = 256


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]``, without the copy when ``rows`` is every row (they are increasing)."""
    return x if len(rows) == x.shape[0] else x[rows]


def draw_from_vocab(
    logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), min-p applied, over the whole
    vocabulary: the block is chosen from the blocks' totals, then the token inside it."""
    num_rows, vocab = logits.shape
    num_blocks = -(-vocab // DRAW_BLOCK)
    scaled = logits / temperatures
    # [num_rows, vocab]: each token's probability over the top one's
    weights = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()
    weights = _drop_below_min_p(weights, min_ps)
    if vocab % DRAW_BLOCK:
        weights = F.pad(weights, (0, num_blocks * DRAW_BLOCK - vocab))
    blocks = weights.view(num_rows, num_blocks, DRAW_BLOCK)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1, dtype=torch.float64)  # [num_rows, num_blocks]
    target = uniforms[:, None] * block_cdf[:, -1:]
    block = _search(block_cdf, target)  # [num_rows, 1]
    target = target - F.pad(block_cdf, (1, 0)).gather(1, block)  # the mass left inside the block
    inside = blocks[torch.arange(num_rows), block.squeeze(1)]  # [num_rows, DRAW_BLOCK]
    offset = _search(inside.cumsum(dim=-1, dtype=torch.float64), target)
    return (block * DRAW_BLOCK + offset).squeeze(1)


def _drop_below_min_p(weights: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the weights (probabilities over the top one's) under the row's min_p."""
    distinct = set(min_ps.tolist())
    if distinct == {0.0}:
        return weights
    if len(distinct) == 1:
        # One min_p for the batch: threshold keeps w > t, so t is the float32 just below min_p;
        # no [rows, vocab] mask to build.
        below = torch.nextafter(min_ps[:1], torch.tensor([float("-inf")]))
        return torch.threshold_(weights, float(below), 0.0)
    return weights.masked_fill_(weights < min_ps[:, None], 0.0)


def draw_truncated(
    logits: torch.Tensor, top_ks: list[int | None], top_ps: torch.Tensor,
    temperatures: torch.Tensor, min_ps: torch.Tensor, uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per row, each row with top_k (< vocab) or top_p (< 1), cut from its best
    candidates: from the narrowest width that can hold its kept set to wider ones, as needed."""
    num_rows, vocab = logits.shape
    token_ids = torch.empty(num_rows, dtype=torch.int64)
    has_k = torch.tensor([k is not None for k in top_ks])
    ks = torch.tensor([k or 1 for k in top_ks])
    # Top-p without top-k keeps a share of the whole row's mass, so that mass is needed.
    totals = torch.full((num_rows,), float("nan"), dtype=torch.float64)
    without_k = [i for i, k in enumerate(top_ks) if k is None]
    if without_k:
        scaled = take_rows(logits, without_k) / temperatures[without_k]
        weights = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()
        totals[without_k] = weights.sum(dim=-1).double()

    starts = [_width(TOP_P_WIDTH if k is None else max(k, MIN_WIDTH), vocab) for k in top_ks]
    widths = sorted({*starts, _width(RETRY_WIDTH, vocab), vocab})
    pending = set(range(num_rows))
    for width in widths:
        rows = [i for i in sorted(pending) if starts[i] <= width]
        if not rows:
            continue
        values, ids = _candidates(take_rows(logits, rows), width)
        values = values / temperatures[rows]
        weights, num_kept, fits = _truncate(
            values, ks[rows], has_k[rows], top_ps[rows], totals[rows], min_ps[rows],
            complete=width == vocab,
        )
        done = fits.nonzero().squeeze(1)
        done_rows = [rows[j] for j in done.tolist()]
        if done_rows:
            token_ids[done_rows] = _draw_candidates(
                weights[done], ids[done], num_kept[done], uniforms[done_rows]
            )
        pending.difference_update(done_rows)
    return token_ids


def _width(width: int, vocab: int) -> int:
    """``width`` rounded up to a power of two; the whole vocabulary past a quarter of it."""
    width = 1 << (width - 1).bit_length()
    return width if 4 * width <= vocab else vocab


def _candidates(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``width`` largest logits and their token ids, in descending order."""
    if width == logits.shape[-1]:
        return logits.sort(dim=-1, descending=True)
    values, ids = logits.topk(width, dim=-1)
    return values, ids


def _truncate(
    values: torch.Tensor, ks: torch.Tensor, has_k: torch.Tensor, top_ps: torch.Tensor,
    totals: torch.Tensor, min_ps: torch.Tensor, complete: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k, top-p and min-p on each row's candidates.

    ``values`` [num_rows, width]: the row's largest scaled logits, descending; ``totals``: the
    whole row's mass (over the top probability) for rows without top-k. Returns the candidates'
    weights (zero where dropped), how many lead the row kept (the kept set is a prefix), and
    whether the row's kept set is known to lie inside its candidates (else it needs more).
    """
    minus_inf = torch.tensor(float("-inf"))
    weights = (values - values[:, :1]).exp_()  # [num_rows, width]: probability over the top one's
    kth = torch.where(has_k[:, None], values.gather(1, (ks - 1)[:, None]), minus_inf)
    weights = weights * (values >= kth)
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [num_rows, width]
    has_p = top_ps < 1.0
    totals = torch.where(has_k, cdf[:, -1], totals)
    # Keep the smallest prefix whose mass reaches top_p (always the first token).
    ahead = F.pad(cdf[:, :-1], (1, 0))  # the mass ahead of each candidate
    num_nucleus = (ahead < (top_ps.double() * totals)[:, None]).sum(dim=-1).clamp_(min=1)
    last_in_nucleus = values.gather(1, (num_nucleus - 1)[:, None])
    boundary = torch.where(has_p[:, None], last_in_nucleus, minus_inf)
    # The kept set fits if the last candidate falls strictly below what a row keeps (tokens past
    # it are no larger), or the candidates are the whole row, or all past them are -inf.
    last = values[:, -1:]
    fits = (
        complete | (last == minus_inf)
        | ((~has_k[:, None] | (last < kth)) & (~has_p[:, None] | (last < boundary)))
    )
    keep = (values >= torch.maximum(kth, boundary)) & (weights >= min_ps[:, None])
    return weights * keep, keep.sum(dim=-1), fits.squeeze(1)


def _draw_candidates(
    weights: torch.Tensor, ids: torch.Tensor, num_kept: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """One token per row among its kept candidates, taken in token-id order: the same draw
    whatever width the row was cut from, and whatever order topk gave tied values."""
    width = max(int(num_kept.max()), 1)
    ids, order = ids[:, :width].sort(dim=-1)
    weights = weights[:, :width].gather(1, order)
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    return ids.gather(1, _search(cdf, uniforms[:, None] * cdf[:, -1:])).squeeze(1)


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[num_rows, 1]: the first index whose ``cdf`` exceeds ``target`` (``target`` in
    [0, total)), and the last index with weight where ``u * total`` rounded up to the total.
    A row of NaN (logits all -inf or NaN) gets some index in range rather than an error."""
    index = torch.searchsorted(cdf, target, right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous())
    return torch.minimum(index, last).clamp_(max=cdf.shape[-1] - 1)
