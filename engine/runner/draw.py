"""Drawing one token a row from temperature-scaled logits: top-k, top-p and min-p, then the draw.

Truncation without sorting the vocabulary: a row with top-k or top-p is cut from its best few
candidates (``topk``), which is exact when the kept set lies inside them: top-k keeps the tokens
at or above the k-th value, top-p the smallest prefix (by descending probability) whose mass
reaches top_p plus any token tied with its last, min-p the tokens at or above min_p times the top
probability. A row whose kept set may reach past its candidates tries wider ones, then a sort.

The draw is by inverse CDF: one uniform per row, over the kept tokens in token-id order (a
row's outcome does not depend on how many candidates it was cut from), or over the whole
vocabulary for a row without top-k or top-p. A request with a seed takes its uniform from its
own stream (``sampler.seeded_uniforms``), one per token, so its output never depends on what
else is in the batch.

Everything runs where the logits are. The whole-vocabulary draw never waits for the device; the
truncated one does once per candidate width it tries (``draw_truncated``).
"""

from __future__ import annotations

import numpy as np
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


def on_device(values: list[int] | list[float] | list[bool] | np.ndarray, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A small host-built tensor (row indices, per-row parameters: a list or a numpy array) on
    ``device``, copied without blocking: the host never waits here for the work queued on the
    device."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]``, without the copy when ``rows`` is every row (they are increasing)."""
    if len(rows) == x.shape[0]:
        return x
    return x.index_select(0, on_device(rows, torch.int64, x.device))


def draw_from_vocab(
    logits: torch.Tensor, temperatures: torch.Tensor, min_ps: np.ndarray,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), min-p applied, over the whole
    vocabulary: the block is chosen from the blocks' totals, then the token inside it. No
    value is read back from the device (``min_ps`` are the host's)."""
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
    arange = torch.arange(num_rows, device=logits.device)
    inside = blocks[arange, block.squeeze(1)]  # [num_rows, DRAW_BLOCK]
    offset = _search(inside.cumsum(dim=-1, dtype=torch.float64), target)
    return (block * DRAW_BLOCK + offset).squeeze(1)


def _drop_below_min_p(weights: torch.Tensor, min_ps: np.ndarray) -> torch.Tensor:
    """Zero, in place, the weights (probabilities over the top one's) under the row's min_p
    (``min_ps``: [rows] float64, the host's)."""
    if not min_ps.any():
        return weights
    first = float(min_ps[0])
    if (min_ps == first).all():
        # One min_p for the batch: threshold keeps w > t, so t is the float32 just below min_p
        # (found on the host); no [rows, vocab] mask to build.
        below = torch.nextafter(torch.tensor(first), torch.tensor(float("-inf")))
        return torch.threshold_(weights, float(below), 0.0)
    thresholds = on_device(min_ps, torch.float32, weights.device)
    return weights.masked_fill_(weights < thresholds[:, None], 0.0)


def draw_truncated(
    logits: torch.Tensor, top_ks: np.ndarray, top_ps: torch.Tensor,
    temperatures: torch.Tensor, min_ps: torch.Tensor, uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per row, each row with top_k (``top_ks``: [rows] int64 on the host, 0 for none,
    else < vocab) or top_p (< 1), cut from its best candidates: from the narrowest width that
    can hold its kept set to wider ones, as needed.

    The sampler's one wait on the device: at each width tried (one, for most rows), whether
    each row's kept set fits its candidates decides on the host which rows go on to a wider
    cut, so that [rows] answer crosses, with the kept counts that size the draw."""
    num_rows, vocab = logits.shape
    device = logits.device
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    has_k_host = top_ks > 0
    has_k = on_device(has_k_host, torch.bool, device)
    ks = on_device(np.maximum(top_ks, 1), torch.int64, device)
    # Top-p without top-k keeps a share of the whole row's mass, so that mass is needed.
    totals = torch.full((num_rows,), float("nan"), dtype=torch.float64, device=device)
    without_k = np.flatnonzero(~has_k_host).tolist()
    if without_k:
        index = on_device(without_k, torch.int64, device)
        scaled = take_rows(logits, without_k) / temperatures.index_select(0, index)
        weights = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()
        totals.index_copy_(0, index, weights.sum(dim=-1).double())

    # Each row's first width: its top_k, or TOP_P_WIDTH; a batch holds a few distinct ones.
    firsts = np.where(has_k_host, np.maximum(top_ks, MIN_WIDTH), TOP_P_WIDTH)
    distinct, which = np.unique(firsts, return_inverse=True)
    starts = np.array([_width(int(w), vocab) for w in distinct], dtype=np.int64)[which]
    widths = sorted({*starts.tolist(), _width(RETRY_WIDTH, vocab), vocab})
    pending = np.ones(num_rows, dtype=bool)
    for width in widths:
        rows = np.flatnonzero(pending & (starts <= width)).tolist()
        if not rows:
            continue
        index = on_device(rows, torch.int64, device)
        values, ids = _candidates(take_rows(logits, rows), width)
        values = values / temperatures.index_select(0, index)
        weights, num_kept, fits = _truncate(
            values, ks[index], has_k[index], top_ps[index], totals[index], min_ps[index],
            complete=width == vocab,
        )
        # [len(rows)]: the row's kept count where its kept set fits, else -1 (the crossing)
        kept = torch.where(fits, num_kept, -1).numpy(force=True)
        done = np.flatnonzero(kept >= 0)
        if len(done):
            done_rows = [rows[j] for j in done.tolist()]
            at = on_device(done, torch.int64, device)
            token_ids.index_copy_(0, on_device(done_rows, torch.int64, device), _draw_candidates(
                weights[at], ids[at], max(int(kept[done].max()), 1),
                take_rows(uniforms, done_rows),
            ))
            pending[done_rows] = False
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
    minus_inf = values.new_full((), float("-inf"))
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
    weights: torch.Tensor, ids: torch.Tensor, width: int, uniforms: torch.Tensor
) -> torch.Tensor:
    """One token per row among its kept candidates (the first ``width`` hold every row's),
    taken in token-id order: the same draw whatever width the row was cut from, and whatever
    order topk gave tied values."""
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
