"""vLLM's prompt log-probabilities as the sparse top-k arrays of one prompt of T tokens:

    ids            int32   [T-1, k]  by descending logprob, ties by smaller token id
    logprobs       float32 [T-1, k]  log-softmax over the full vocabulary
    target_logprob float32 [T-1]     logprob of prompt token t+1
    tail           float32 [T-1]     probability mass outside the k kept entries

From either output form of a vLLM request (a list of per-position dicts, or a `FlatLogprobs` without a Python
object per position), and from a served answer (`engines/server/`, through `entries_to_sparse`): the vLLM and
server engines share this module, and select from its arrays with `sparsify.row_samples`. The tail
is 1 - sum(top-k), exact to vLLM's fp32 rounding only. docs/build.md "Scale out" lists what vLLM documents
about these entries (entry 0 is None, the prompt token added with its rank, ties by version).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numba
import numpy as np

from logitstore.format.grid import GRIDS
from logitstore.pipelines.engines.vllm import VllmEngineError

# How far past 1 a position's probabilities may sum before its answer is refused as impossible. The finest
# value grid a store takes ("fine", `grid.GRIDS`) holds a log-probability within 0.001 nats, so storing can
# make a true distribution read as summing to e^0.001 = 1.001: an excess within that cannot be told from
# one, and a real server's float32 rounding (1e-6 to 1e-5) stays far below it. Past it is no rounding.
MASS_SLACK = math.expm1(min(grid.error_bound_fine for grid in GRIDS.values()))
# What a reader of an answer's text makes of a token id of 2**62 or more: in int64, past any vocabulary,
# where the id itself would wrap (2**64 + 5 read as 5)
ID_PAST_RANGE = 1 << 62


def prompt_logprobs_to_sparse(
    prompt_token_ids: Sequence[int],
    prompt_logprobs: Sequence[Mapping[int, Any] | None],
    *,
    k: int,
    vocab_size: int,
) -> dict[str, np.ndarray]:
    """Convert one vLLM `RequestOutput.prompt_logprobs` to the sparse top-k arrays.

    Position t (0 <= t < T-1) is the prediction for prompt token t+1, read from entry
    t+1. Each entry must hold at least k candidate tokens besides an added target
    (otherwise the engine's `max_logprobs` / the request's `prompt_logprobs` was below k).
    Candidates beyond k are dropped after sorting by (descending logprob, ascending id).

    The tail is 1 - sum(exp(top-k)), because vLLM returns only top-K values and never the
    mass outside them. It is computed in float64 as -expm1(logsumexp(top-k)), so the
    subtraction itself loses nothing, but the inputs are vLLM's fp32 log-probabilities:
    their rounding and fp32 normalisation error (~1e-6 to 1e-5 at large vocabularies) is
    an absolute error on the tail. Tails below ~1e-5 are therefore noise, and clamping
    to [0, 1] hides small negative results. The torch engine sums the tail directly and
    does not have this limit.
    """
    tokens = _check_inputs(prompt_token_ids, prompt_logprobs, k=k, vocab_size=vocab_size)
    targets = tokens[1:]
    flat_ids, flat_lps, counts, target_lp, extra = _flatten(prompt_logprobs, targets, k=k)
    return entries_to_sparse(targets, flat_ids, flat_lps, counts, target_lp, extra, k=k, vocab_size=vocab_size)


def entries_to_sparse(
    targets: np.ndarray,
    flat_ids: np.ndarray,
    flat_lps: np.ndarray,
    counts: np.ndarray,
    target_lp: np.ndarray,
    extra: np.ndarray,
    *,
    k: int,
    vocab_size: int,
) -> dict[str, np.ndarray]:
    """The sparse top-k arrays of one prompt's entries, flat (position t's are `counts[t]` in a row, the
    prompt token t+1 among them): `target_lp` that token's log-probability, `extra` whether it was added
    outside the top K. Both vLLM's in-process output and a served answer (`pipelines/engines/server/`) end here."""
    rows = np.repeat(np.arange(len(targets)), counts)
    # Drop the added target where it is not a top-k member, so it can neither be kept
    # nor count towards the k candidates a position must have.
    keep = ~((flat_ids == targets[rows]) & extra[rows])
    flat_ids, flat_lps, rows = flat_ids[keep], flat_lps[keep], rows[keep]
    kept = np.bincount(rows, minlength=len(targets))
    _check_candidates(kept, k=k)
    check_ids(flat_ids, vocab_size=vocab_size)
    top_ids, top_lps = _top_k_per_row(flat_ids, flat_lps, rows, kept, k=k)
    return {
        "ids": top_ids.astype(np.int32),
        "logprobs": top_lps.astype(np.float32),
        "target_logprob": target_lp.astype(np.float32),
        "tail": _checked_tail(top_lps, target_lp, extra).astype(np.float32),
    }


def flat_prompt_logprobs_to_sparse(
    prompt_token_ids: Sequence[int], flat, *, k: int, vocab_size: int
) -> dict[str, np.ndarray]:
    """`prompt_logprobs_to_sparse` for a `FlatLogprobs` (`flat_logprobs=True`), without a Python loop.

    Position t's span (entry t+1) is the prompt token t+1 with its vocabulary rank, then the top-K in
    rank order (not deduplicated: a prompt token inside the top-K appears twice). The first k of the
    top-K are kept, sorted by (descending logprob, ascending id) so ties come out as the dict form's.
    """
    tokens = _check_inputs(prompt_token_ids, flat, k=k, vocab_size=vocab_size)
    targets = tokens[1:]
    starts = np.asarray(flat.start_indices, dtype=np.int64)[1:]
    ends = np.asarray(flat.end_indices, dtype=np.int64)[1:]
    ids = np.asarray(flat.token_ids, dtype=np.int64)
    lps = np.asarray(flat.logprobs, dtype=np.float64)
    _check_candidates(ends - starts - 1, k=k)
    if len(targets) and not np.array_equal(ids[starts], targets):
        t = int(np.flatnonzero(ids[starts] != targets)[0])
        raise VllmEngineError(
            f"vLLM prompt logprobs entry {t + 1} does not start with the prompt token "
            f"{int(targets[t])}; prefix caching must be off and prompt_logprobs set"
        )
    take = starts[:, None] + 1 + np.arange(k)
    top_ids, top_lps = ids[take].reshape(-1, k), lps[take].reshape(-1, k)
    check_ids(top_ids, vocab_size=vocab_size)
    order = np.lexsort((top_ids, -top_lps))  # per row (the last axis): by descending logprob, then id
    top_ids, top_lps = np.take_along_axis(top_ids, order, 1), np.take_along_axis(top_lps, order, 1)
    return {
        "ids": top_ids.astype(np.int32),
        "logprobs": top_lps.astype(np.float32),
        "target_logprob": lps[starts].astype(np.float32),
        "tail": _tail(top_lps).astype(np.float32),
    }


def to_sparse(prompt_token_ids: Sequence[int], prompt_logprobs, *, k: int, vocab_size: int) -> dict[str, np.ndarray]:
    """Either output form of one request: a `FlatLogprobs` or a list of per-position dicts."""
    if hasattr(prompt_logprobs, "start_indices"):
        return flat_prompt_logprobs_to_sparse(prompt_token_ids, prompt_logprobs, k=k, vocab_size=vocab_size)
    return prompt_logprobs_to_sparse(prompt_token_ids, prompt_logprobs, k=k, vocab_size=vocab_size)


def _check_inputs(prompt_token_ids, prompt_logprobs, *, k: int, vocab_size: int) -> np.ndarray:
    if not 1 <= k <= vocab_size:
        raise VllmEngineError(f"k={k} must be between 1 and the vocabulary size {vocab_size}")
    if prompt_logprobs is None:
        raise VllmEngineError("vLLM returned no prompt logprobs; the request needs prompt_logprobs")
    tokens = np.asarray(prompt_token_ids, dtype=np.int64).reshape(-1)
    if tokens.size == 0:
        raise VllmEngineError("an empty prompt has no next-token predictions")
    if len(prompt_logprobs) != tokens.size:
        raise VllmEngineError(
            f"vLLM returned {len(prompt_logprobs)} prompt logprob entries for a "
            f"{tokens.size}-token prompt; was the request sent with prompt_logprobs=k?"
        )
    if not 0 <= tokens.min() <= tokens.max() < vocab_size:
        raise VllmEngineError(f"prompt token ids must be in [0, {vocab_size})")
    return tokens


def _flatten(prompt_logprobs, targets: np.ndarray, *, k: int):
    """One pass over vLLM's per-position dicts into flat arrays.

    vLLM hands back Python dicts of Python objects, so a Python loop over positions is
    unavoidable; it only copies (id, logprob) pairs and reads the target, and everything
    else (dropping, sorting, tail) is vectorised over the flat arrays afterwards.
    """
    n = len(targets)
    flat_ids: list[int] = []
    flat_lps: list[float] = []
    counts = np.empty(n, dtype=np.int64)
    target_lp = np.empty(n, dtype=np.float64)
    extra = np.empty(n, dtype=bool)
    # Entry 0 is None by vLLM's contract (nothing predicts the first token): skip it.
    for t, (entry, target) in enumerate(zip(itertools.islice(prompt_logprobs, 1, None), targets.tolist())):
        found = entry.get(target) if entry is not None else None
        if found is None:
            raise VllmEngineError(
                f"vLLM prompt logprobs entry {t + 1} is missing or lacks the prompt token "
                f"{target}; prefix caching must be off and prompt_logprobs set"
            )
        flat_ids.extend(entry)
        flat_lps.extend([item.logprob for item in entry.values()])
        counts[t] = len(entry)
        target_lp[t] = found.logprob
        extra[t] = _target_rank(entry, found) > k
    return (
        np.fromiter(flat_ids, dtype=np.int64, count=len(flat_ids)),
        np.fromiter(flat_lps, dtype=np.float64, count=len(flat_lps)),
        counts,
        target_lp,
        extra,
    )


def _target_rank(entry: Mapping[int, Any], found) -> int:
    # vLLM sets .rank on every prompt-logprob item; the fallback (V1's convention: items
    # at least as likely, itself included) only guards against a None from elsewhere.
    if found.rank is not None:
        return int(found.rank)
    return sum(item.logprob >= found.logprob for item in entry.values())


def _check_candidates(kept: np.ndarray, *, k: int) -> None:
    short = np.flatnonzero(kept < k)
    if short.size:
        t = int(short[0])
        raise VllmEngineError(
            f"vLLM returned only {int(kept[t])} top tokens for position {t} (and "
            f"{short.size - 1} more positions), fewer than k={k}: raise the engine's "
            f"max_logprobs and the request's prompt_logprobs to at least {k}"
        )


def check_ids(flat_ids: np.ndarray, *, vocab_size: int) -> None:
    if flat_ids.size and not 0 <= flat_ids.min() <= flat_ids.max() < vocab_size:
        outside = int(flat_ids[(flat_ids < 0) | (flat_ids >= vocab_size)][0])
        shown = "a token id of 2**62 or more" if outside >= ID_PAST_RANGE else f"token id {outside}"
        raise VllmEngineError(f"vLLM returned {shown}, outside the vocabulary [0, {vocab_size})")


def _checked_tail(top_lps: np.ndarray, target_lp: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """Each position's tail (`_tail`), after checking the position is a distribution's: finite
    log-probabilities, whose probabilities (the kept entries', and the prompt token's where it is
    outside them, `extra`) sum to at most 1 + `MASS_SLACK`. Per position, not per entry: one exp each."""
    finite = np.isfinite(top_lps).all(axis=-1) & np.isfinite(target_lp)
    if not finite.all():
        t = int(np.flatnonzero(~finite)[0])
        values = [*top_lps[t].tolist(), float(target_lp[t])]
        bad = next(v for v in values if not math.isfinite(v))
        raise VllmEngineError(f"position {t} holds a log-probability of {bad}: not a finite number")
    tail = -np.expm1(_log_mass(top_lps))
    outside = np.where(extra, np.exp(target_lp), 0.0)
    over = tail - outside < -MASS_SLACK
    if over.any():
        t = int(np.flatnonzero(over)[0])
        mass = 1 - tail[t] + outside[t]
        which = "its top entries' and the prompt token's" if extra[t] else "its top entries'"
        raise VllmEngineError(f"position {t}: {which} probabilities sum to {mass:.4g}, more than 1")
    return np.clip(tail, 0.0, 1.0)


def _top_k_per_row(flat_ids, flat_lps, rows, kept, *, k: int):
    """The first k of each row (rows ascending, `kept[r]` entries each) by (descending logprob, ascending
    id). Sorting by id last makes ties deterministic (vLLM's own top-k order among equal values is whatever
    torch.topk returned)."""
    top_ids = np.empty((len(kept), k), dtype=np.int64)
    top_lps = np.empty((len(kept), k), dtype=np.float64)
    if len(kept):
        _top_k_kernel(
            np.ascontiguousarray(flat_ids, dtype=np.int64),
            np.ascontiguousarray(flat_lps, dtype=np.float64),
            np.cumsum(kept) - kept,
            np.asarray(kept, dtype=np.int64),
            top_ids,
            top_lps,
        )
    return top_ids, top_lps


@numba.njit(cache=True, nogil=True)
def _top_k_kernel(ids, lps, starts, kept, top_ids, top_lps):
    # An insertion sort per row of its K or K+1 entries: a served answer's rows come nearly in rank order,
    # so this is ~K steps a row, where one lexsort of every entry costs ~0.2 s per million (the client's
    # largest cost at 200k tokens/s).
    k = top_ids.shape[1]
    width = 0
    for r in range(len(kept)):
        width = max(width, kept[r])
    row_ids = np.empty(width, dtype=np.int64)
    row_lps = np.empty(width, dtype=np.float64)
    for r in range(len(kept)):
        n = kept[r]
        for j in range(n):
            key_id = ids[starts[r] + j]
            key_lp = lps[starts[r] + j]
            b = j - 1
            while b >= 0 and (row_lps[b] < key_lp or (row_lps[b] == key_lp and row_ids[b] > key_id)):
                row_ids[b + 1] = row_ids[b]
                row_lps[b + 1] = row_lps[b]
                b -= 1
            row_ids[b + 1] = key_id
            row_lps[b + 1] = key_lp
        for j in range(k):
            top_ids[r, j] = row_ids[j]
            top_lps[r, j] = row_lps[j]


def _tail(top_lps: np.ndarray) -> np.ndarray:
    # 1 - sum(p) = -expm1(log(sum(p))): no cancellation in the subtraction itself
    return np.clip(-np.expm1(_log_mass(top_lps)), 0.0, 1.0)


def _log_mass(top_lps: np.ndarray) -> np.ndarray:
    # The log of each row's sum of probabilities, taken past the row's largest value: one exp per entry,
    # where logaddexp's reduction (an exp and a log1p per entry, one entry at a time) takes ~5% of a top-64
    # served build's CPU. A row of -inf (or none) sums to 0.
    if top_lps.shape[-1] == 0:
        return np.full(top_lps.shape[:-1], -np.inf)
    largest = top_lps.argmax(axis=-1)[..., None]
    top = np.take_along_axis(top_lps, largest, axis=-1)
    top = np.where(np.isfinite(top), top, 0.0)  # a row of -inf: its sum is 0, its tail 1
    others = np.exp(top_lps - top)
    np.put_along_axis(others, largest, 0.0, axis=-1)  # log(1 + the others): exact for a tail near 0
    with np.errstate(divide="ignore"):
        return np.where(np.isfinite(top_lps).any(axis=-1), np.log1p(others.sum(axis=-1)) + top[..., 0], -np.inf)
