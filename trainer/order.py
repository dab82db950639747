"""The stream's order: which samples a split holds, in which order an epoch visits them (the window
shuffle over parts), and how the packed token stream is cut into rows, all without reading data.
The rules are the stream's contract (`trainer/stream.py`); `EpochPlan` is one epoch of them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from logitstore.sizes import format_bytes
from logitstore.trainer.spec import StreamConfigError

_WINDOW_STREAM = 2**32  # the RNG stream of the part permutation, apart from the windows' 0, 1, ...


def is_eval_sample(sample_id: str, *, eval_fraction: float) -> bool:
    """True iff the sample belongs to the eval split: blake2b-64 of the id, as a fraction of 2**64,
    is below `eval_fraction`. Stable across runs, machines and Python versions (no `hash()`)."""
    digest = hashlib.blake2b(sample_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < eval_fraction * 2.0**64


def in_split(sample_ids: list[str], *, split: str, eval_fraction: float) -> np.ndarray:
    """bool [n]: which of these samples lie in `split`."""
    in_eval = [is_eval_sample(s, eval_fraction=eval_fraction) for s in sample_ids]  # one step per sample
    return np.array([e == (split == "eval") for e in in_eval], dtype=bool)


@dataclass
class SplitTable:
    """The samples of one split, sorted by sample id: what the engine orders and packs."""

    sample_ids: list[str]
    n_tokens: np.ndarray  # int64 [n]: the packed length of each sample
    part: np.ndarray  # int64 [n]: the part holding it (the unit of reading), 0 for sources without parts
    parts: list[str]  # part names, by code


@dataclass
class Pieces:
    """Fragments covering a span of rows, in row-major order: sample `row` (into the split table), its
    tokens [a, b), starting at `flat` within the span, in window `window` of the epoch."""

    row: np.ndarray
    a: np.ndarray
    b: np.ndarray
    flat: np.ndarray
    window: np.ndarray


class EpochPlan:
    """One epoch's sample order, its windows, and its packed token stream; cuts any span of rows into
    pieces without reading data."""

    def __init__(self, table: SplitTable, *, seed: int, epoch: int, seq_len: int, window_parts: int | None):
        n_parts = len(table.parts)
        if window_parts is None or window_parts >= n_parts:  # one window: the global shuffle
            self.order = np.random.default_rng([seed, epoch]).permutation(len(table.n_tokens))
            self.window_start = np.zeros(1, dtype=np.int64)
        else:
            self.order, self.window_start = _windowed_order(table, seed=seed, epoch=epoch, window_parts=window_parts)
        self.part_sequence = table.part[self.order]  # the part of each sample, in epoch order
        lengths = table.n_tokens[self.order]
        self.ends = np.cumsum(lengths)
        self.begins = self.ends - lengths
        self.seq_len = seq_len
        self._parts_of_window: dict[int, np.ndarray] = {}

    @property
    def n_windows(self) -> int:
        return len(self.window_start)

    def pieces(self, row0: int, row1: int) -> Pieces:
        """The fragments of rows [row0, row1); tokens past the end of the epoch's stream (the eval
        split's padded last row and step) are in none: they are padding."""
        total = int(self.ends[-1]) if len(self.ends) else 0
        start, stop = min(row0 * self.seq_len, total), min(row1 * self.seq_len, total)
        if start == stop:
            empty = np.zeros(0, dtype=np.int64)
            return Pieces(row=empty, a=empty, b=empty, flat=empty, window=empty)
        first = np.searchsorted(self.ends, start, side="right")
        last = np.searchsorted(self.begins, stop, side="left")
        # Every sample boundary and every row boundary inside the span starts a new piece.
        cuts = np.concatenate(
            [self.begins[first:last], self.ends[first:last], np.arange(start, stop, self.seq_len), [stop]]
        )
        cuts = np.unique(cuts[(cuts >= start) & (cuts <= stop)])
        k = np.searchsorted(self.ends, cuts[:-1], side="right")  # position in the epoch order
        return Pieces(
            row=self.order[k],
            a=cuts[:-1] - self.begins[k],
            b=cuts[1:] - self.begins[k],
            flat=cuts[:-1] - start,
            window=np.searchsorted(self.window_start, k, side="right") - 1,
        )

    def parts_of_window(self, window: int) -> np.ndarray:
        """The window's parts in the order the epoch first needs them (the order to read them in)."""
        if window not in self._parts_of_window:
            stop = self.window_start[window + 1] if window + 1 < self.n_windows else len(self.order)
            sequence = self.part_sequence[self.window_start[window] : stop]
            _, first = np.unique(sequence, return_index=True)
            self._parts_of_window[window] = sequence[np.sort(first)]
        return self._parts_of_window[window]


def _windowed_order(table: SplitTable, *, seed: int, epoch: int, window_parts: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample order, start of each window in it): parts permuted and cut into windows, samples
    permuted inside each window. One pass over the samples, one loop step per window."""
    n_parts = len(table.parts)
    part_order = np.random.default_rng([seed, epoch, _WINDOW_STREAM]).permutation(n_parts)
    window_of_part = np.empty(n_parts, dtype=np.int64)
    window_of_part[part_order] = np.arange(n_parts) // window_parts
    window_of_sample = window_of_part[table.part]
    by_window = np.argsort(window_of_sample, kind="stable")  # id order inside each window
    counts = np.bincount(window_of_sample, minlength=int(window_of_part.max()) + 1)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    order = np.empty_like(by_window)
    for k, (s, c) in enumerate(zip(starts.tolist(), counts.tolist())):  # one step per window
        order[s : s + c] = by_window[s : s + c][np.random.default_rng([seed, epoch, k]).permutation(c)]
    return order, starts[counts > 0]


def window_parts(part_bytes: np.ndarray, budget: int, *, where: str) -> int:
    """Parts per window: all of them when the split fits the budget (the global shuffle), else as many
    as two windows of the largest part fit."""
    if int(part_bytes.sum()) <= budget:
        return len(part_bytes)
    largest = int(part_bytes.max())
    if 2 * largest > budget:
        raise StreamConfigError(
            f"memory budget {format_bytes(budget)} is smaller than two parts of {where} "
            f"({format_bytes(2 * largest)}: the part being read and the next); raise "
            f"--memory-budget to at least {format_bytes(2 * largest)}"
        )
    return budget // (2 * largest)
