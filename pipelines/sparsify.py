"""From a teacher forward pass to `SparseSamples`: which entries each position keeps, as a
`logitstore.format.sparsity.Sparsity` says (top-k, top-p or sampled; stored log-probabilities are always at
temperature 1). Everything here is vectorised over positions.
"""

from __future__ import annotations

import numba
import numpy as np

from logitstore.format.samples import SparseSamples
from logitstore.format.sparsity import Sparsity
from logitstore.pipelines.teacher import SparseBatch


def to_samples(
    batch: SparseBatch, *, sample_ids: list[str], lengths: np.ndarray, input_ids: list[np.ndarray], sparsity: Sparsity
) -> SparseSamples:
    """Rows of a right-padded batch -> `SparseSamples` (padding positions dropped)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    positions = lengths - 1
    valid = np.arange(batch.ids.shape[1])[None, :] < positions[:, None]  # [B, T-1]
    ids = batch.ids.cpu().numpy()[valid]  # [P, width], rows in sample order
    logprobs = batch.logprobs.cpu().numpy()[valid]
    tail = batch.tail.cpu().numpy()[valid].astype(np.float64)
    target = batch.target_logprob.cpu().numpy()[valid]
    counts = None
    if sparsity.sampled:
        n_entries, entry_ids, entry_logprobs, counts = _distinct_draws(ids, logprobs)
    else:
        if sparsity.mode == "topk":
            keep = np.ones(ids.shape, dtype=bool)
        else:
            selection = logprobs if batch.selection_logprobs is None else batch.selection_logprobs.cpu().numpy()[valid]
            assert sparsity.p is not None, "Sparsity refuses top-p without p"
            keep, tail = _top_p(logprobs, selection, tail, p=sparsity.p)
        n_entries, entry_ids, entry_logprobs = keep.sum(axis=1), ids[keep], logprobs[keep]
    return SparseSamples(
        sample_ids=list(sample_ids),
        n_tokens=lengths,
        input_ids=np.concatenate([np.asarray(x, dtype=np.int64) for x in input_ids]),
        n_entries=n_entries.astype(np.int64),
        entry_ids=entry_ids.astype(np.int64),
        entry_logprobs=entry_logprobs.astype(np.float32),
        tail=np.clip(tail, 0, 1).astype(np.float32),
        target_logprobs=target.astype(np.float32),
        entry_counts=counts,
    )


def _top_p(logprobs: np.ndarray, selection: np.ndarray, tail: np.ndarray, *, p: float):
    """Keep the shortest prefix of the (sorted) top-k whose selection mass reaches p."""
    cumulative = np.cumsum(np.exp(selection.astype(np.float64)), axis=1)
    n_keep = np.minimum((cumulative < p).sum(axis=1) + 1, logprobs.shape[1])
    keep = np.arange(logprobs.shape[1])[None, :] < n_keep[:, None]
    dropped = np.where(keep, 0.0, np.exp(logprobs.astype(np.float64))).sum(axis=1)
    return keep, tail + dropped


def _distinct_draws(draws: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row [P, n]: the distinct drawn ids in ascending order, each with its log-probability and its
    count, flat: (entries per row, ids, log-probabilities, counts)."""
    positions, width = draws.shape
    n_entries = np.empty(positions, dtype=np.int64)
    ids = np.empty(positions * width, dtype=np.int64)
    values = np.empty(positions * width, dtype=np.float32)
    counts = np.empty(positions * width, dtype=np.int64)
    if draws.size:
        used = _distinct_draws_kernel(
            np.ascontiguousarray(draws), np.ascontiguousarray(logprobs), n_entries, ids, values, counts
        )
        ids, values, counts = ids[:used], values[:used], counts[:used]
    else:
        ids, values, counts = ids[:0], values[:0], counts[:0]
    return n_entries, ids, values, counts


@numba.njit(cache=True, nogil=True)
def _distinct_draws_kernel(draws, logprobs, n_entries, ids, values, counts):
    # One pass per row: insertion sort of its n draws (n is small, 16 by default; an equal id always
    # has the same log-probability), then each run of equal ids becomes one entry with its length as
    # the count. numpy needed a sort, two gathers and a cumulative count over [P, n]: ~15 ms per 16k
    # positions at n = 16, this ~1 ms. Returns the entries written.
    width = draws.shape[1]
    row_ids = np.empty(width, dtype=np.int64)
    row_values = np.empty(width, dtype=np.float32)
    e = 0
    for p in range(draws.shape[0]):
        for j in range(width):
            key = np.int64(draws[p, j])
            value = logprobs[p, j]
            b = j - 1
            while b >= 0 and row_ids[b] > key:
                row_ids[b + 1] = row_ids[b]
                row_values[b + 1] = row_values[b]
                b -= 1
            row_ids[b + 1] = key
            row_values[b + 1] = value
        start = e
        for j in range(width):
            if j > 0 and row_ids[j] == row_ids[j - 1]:
                counts[e - 1] += 1
            else:
                ids[e] = row_ids[j]
                values[e] = row_values[j]
                counts[e] = 1
                e += 1
        n_entries[p] = e - start
    return e
