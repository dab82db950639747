"""From a teacher forward pass to `SparseSamples`: which entries each position keeps.

    topk     the k most probable tokens
    topp     the smallest set of top tokens whose probability (at the selection temperature) reaches p,
             capped at k; the rest of the top-k joins the tail
    sampled  n draws from the teacher distribution at the temperature, stored as distinct ids with
             counts (unbiased: Anshumann et al. 2025, "Sparse Logit Sampling")

Stored log-probabilities are always at temperature 1. Everything here is vectorised over positions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numba
import numpy as np

from logitstore.pipelines.teacher import SparseBatch
from logitstore.errors import LogitstoreError
from logitstore.samples import SparseSamples

MODES = ("topk", "topp", "sampled")


@dataclass(frozen=True)
class Sparsity:
    mode: str = "topk"
    k: int = 64
    p: float | None = None
    n: int | None = None
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"sparsity mode must be one of {MODES}, got {self.mode!r}")
        if self.k < 1:
            raise ValueError(f"--top-k must be at least 1, got {self.k}")
        if self.mode == "topp" and not (self.p is not None and 0 < self.p <= 1):
            raise ValueError(f"--top-p must be in (0, 1], got {self.p}")
        if self.mode == "sampled" and not (self.n is not None and 1 <= self.n <= 65535):
            raise ValueError(f"--sample must be between 1 and 65535 draws, got {self.n}")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be positive, got {self.temperature}")

    @property
    def width(self) -> int:
        """Entries the forward pass produces per position before selection."""
        return self.n if self.mode == "sampled" else self.k

    def to_json(self) -> dict:
        out = asdict(self)
        if self.mode != "topp":
            out.pop("p")
        if self.mode != "sampled":
            out.pop("n")
        else:
            out.pop("k")
        return out


# What `logitstore build` and `train --live-teacher` store when no sparsity flag is given: 16 draws per
# position, the smallest variant of benchmarks/frontier.py whose student matched (in fact beat) top-64
# fp16 entries, at ~21 bytes/token (README "Choosing a budget"). Top-64 stays the default where the
# teacher's probabilities of the entries are needed: cross-tokenizer alignment and the vLLM engine.
# The dataclass default `Sparsity()` stays top-64, the library's stable meaning.
DEFAULT_SAMPLED = Sparsity(mode="sampled", n=16)
DEFAULT_TOPK = Sparsity(k=64)


class SparsityError(LogitstoreError, ValueError):
    """Sparsity flags that contradict each other or are out of range; the message names the flag."""


def sparsity_from_flags(*, top_k: int | None, top_p: float | None, sample: int | None, temperature: float,
                        default: Sparsity) -> Sparsity:
    """The sparsity of build's and live train's flags; `default` when none of --top-k/--top-p/--sample
    is given (at `temperature`)."""
    if top_p is not None and sample is not None:
        raise SparsityError("choose one of --top-p and --sample")
    if sample is not None and top_k is not None:
        raise SparsityError("choose one of --top-k and --sample (--top-k caps --top-p only)")
    try:
        if top_k is None and top_p is None and sample is None:
            return replace(default, temperature=temperature)
        mode = "sampled" if sample is not None else "topp" if top_p is not None else "topk"
        return Sparsity(mode=mode, k=64 if top_k is None else top_k, p=top_p, n=sample, temperature=temperature)
    except ValueError as e:
        raise SparsityError(str(e)) from None


def default_sparsity(*, student_tokenizers: bool = False, engine: str = "torch") -> Sparsity:
    """The default of the CLI and of `BuildConfig`: sampled, unless the build aligns student tokenizers or
    runs on vLLM (top-k only)."""
    return DEFAULT_TOPK if student_tokenizers or engine == "vllm" else DEFAULT_SAMPLED


def to_samples(batch: SparseBatch, *, sample_ids: list[str], lengths: np.ndarray, input_ids: list[np.ndarray],
               sparsity: Sparsity) -> SparseSamples:
    """Rows of a right-padded batch -> `SparseSamples` (padding positions dropped)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    positions = lengths - 1
    valid = np.arange(batch.ids.shape[1])[None, :] < positions[:, None]  # [B, T-1]
    ids = batch.ids.cpu().numpy()[valid]  # [P, width], rows in sample order
    logprobs = batch.logprobs.cpu().numpy()[valid]
    tail = batch.tail.cpu().numpy()[valid].astype(np.float64)
    target = batch.target_logprob.cpu().numpy()[valid]
    counts = None
    if sparsity.mode == "sampled":
        n_entries, entry_ids, entry_logprobs, counts = _distinct_draws(ids, logprobs)
    else:
        if sparsity.mode == "topk":
            keep = np.ones(ids.shape, dtype=bool)
        else:
            selection = logprobs if batch.selection_logprobs is None else batch.selection_logprobs.cpu().numpy()[valid]
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
        used = _distinct_draws_kernel(np.ascontiguousarray(draws), np.ascontiguousarray(logprobs), n_entries, ids, values, counts)
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
