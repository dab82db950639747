"""From a teacher forward pass to `SparseSamples`: which entries each position keeps.

    topk     the k most probable tokens
    topp     the smallest set of top tokens whose probability (at the selection temperature) reaches p,
             capped at k; the rest of the top-k joins the tail
    sampled  n draws from the teacher distribution at the temperature, stored as distinct ids with
             counts (unbiased: Anshumann et al. 2025, "Sparse Logit Sampling")

Stored log-probabilities are always at temperature 1. Everything here is vectorised over positions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from logitstore.pipelines.teacher import SparseBatch
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
    if sparsity.mode == "topk":
        keep = np.ones(ids.shape, dtype=bool)
    elif sparsity.mode == "topp":
        selection = logprobs if batch.selection_logprobs is None else batch.selection_logprobs.cpu().numpy()[valid]
        keep, tail = _top_p(logprobs, selection, tail, p=sparsity.p)
    else:
        ids, logprobs, counts, keep = _distinct_draws(ids, logprobs)
    return SparseSamples(
        sample_ids=list(sample_ids),
        n_tokens=lengths,
        input_ids=np.concatenate([np.asarray(x, dtype=np.int64) for x in input_ids]),
        n_entries=keep.sum(axis=1).astype(np.int64),
        entry_ids=ids[keep].astype(np.int64),
        entry_logprobs=logprobs[keep].astype(np.float32),
        tail=np.clip(tail, 0, 1).astype(np.float32),
        target_logprobs=target.astype(np.float32),
        entry_counts=None if counts is None else counts[keep].astype(np.int64),
    )


def _top_p(logprobs: np.ndarray, selection: np.ndarray, tail: np.ndarray, *, p: float):
    """Keep the shortest prefix of the (sorted) top-k whose selection mass reaches p."""
    cumulative = np.cumsum(np.exp(selection.astype(np.float64)), axis=1)
    n_keep = np.minimum((cumulative < p).sum(axis=1) + 1, logprobs.shape[1])
    keep = np.arange(logprobs.shape[1])[None, :] < n_keep[:, None]
    dropped = np.where(keep, 0.0, np.exp(logprobs.astype(np.float64))).sum(axis=1)
    return keep, tail + dropped


def _distinct_draws(draws: np.ndarray, logprobs: np.ndarray):
    """Per row: sorted distinct ids, the log-probability and the count of each; padded with `keep`."""
    order = np.argsort(draws, axis=1, kind="stable")
    draws = np.take_along_axis(draws, order, axis=1)
    logprobs = np.take_along_axis(logprobs, order, axis=1)
    first = np.ones(draws.shape, dtype=bool)
    first[:, 1:] = draws[:, 1:] != draws[:, :-1]
    # Count of each distinct id = distance to the next first-occurrence in the same row.
    flat_first = np.flatnonzero(first.reshape(-1))
    row_ends = np.arange(1, draws.shape[0] + 1) * draws.shape[1]
    next_start = np.minimum(np.append(flat_first[1:], draws.size), np.repeat(row_ends, first.sum(axis=1)))
    counts = np.zeros(draws.shape, dtype=np.int64)
    counts.reshape(-1)[flat_first] = next_start - flat_first
    return draws, logprobs, counts, first
