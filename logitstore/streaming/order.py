"""The stream's order: which samples a split holds, in which order an epoch visits them (the window
shuffle over parts), and how the packed token stream is cut into rows, all without reading data.
The rules are the stream's contract (`logitstore/streaming/stream.py`); `EpochPlan` is one epoch of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from logitstore.sizes import format_bytes
from logitstore.streaming.spec import StreamConfigError

_WINDOW_STREAM = 2**32  # the RNG stream of the part permutation, apart from the windows' 0, 1, ...
_GROUP_STREAM = 2**32 + 1  # the RNG stream that deals parts to reader groups (once per run)


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
    tokens [a, b), starting at `flat` within the span, in window `window` of reader group `group`."""

    row: np.ndarray
    a: np.ndarray
    b: np.ndarray
    flat: np.ndarray
    window: np.ndarray
    group: np.ndarray

    @staticmethod
    def concat(pieces: list[Pieces]) -> Pieces:
        fields = ("row", "a", "b", "flat", "window", "group")
        if not pieces:
            empty = np.zeros(0, dtype=np.int64)
            return Pieces(*(empty for _ in fields))
        return Pieces(*(np.concatenate([getattr(p, f) for p in pieces]) for f in fields))


def deal_samples(table: SplitTable, *, seed: int, groups: int) -> np.ndarray:
    """int64 [n]: the reader group of each sample. The parts, permuted once per run (not per epoch, so
    every group packs the same rows in every epoch, as Mosaic's canonical nodes hold the same shards),
    are laid end to end (each part's samples in id order) and cut into `groups` runs of equal tokens
    (MosaicML Streaming's spans divided at canonical-node boundaries): each group holds about 1/G of the
    tokens, give or take a sample, so all groups pack the same rows give or take one, and at most G - 1
    parts are cut between two groups (read by both). One group: all in 0."""
    n = len(table.n_tokens)
    if groups <= 1 or n == 0:
        return np.zeros(n, dtype=np.int64)
    place = np.empty(len(table.parts), dtype=np.int64)
    place[np.random.default_rng([seed, _GROUP_STREAM]).permutation(len(table.parts))] = np.arange(len(table.parts))
    laid = np.lexsort((np.arange(n), place[table.part]))  # by part (permuted), then id
    starts = np.cumsum(table.n_tokens[laid]) - table.n_tokens[laid]
    group = np.empty(n, dtype=np.int64)
    group[laid] = np.minimum(starts * groups // max(int(table.n_tokens.sum()), 1), groups - 1)
    return group


class GroupPlan:
    """One reader group's epoch: its samples' order, its windows, and its own packed rows."""

    def __init__(
        self,
        table: SplitTable,
        members: np.ndarray,
        own: np.ndarray,
        *,
        key: list[int],
        seq_len: int,
        window_parts: int | None,
        rows: Callable[[int], int],
    ):
        if window_parts is None or window_parts >= int(own.sum()):  # one window: the group's shuffle
            self.order = members[np.random.default_rng(key).permutation(len(members))]
            self.window_start = np.zeros(1, dtype=np.int64)
        else:
            self.order, self.window_start = _windowed_order(table, members, own, key=key, window_parts=window_parts)
        self.part_sequence = table.part[self.order]  # the part of each sample, in epoch order
        lengths = table.n_tokens[self.order]
        self.ends = np.cumsum(lengths)
        self.begins = self.ends - lengths
        self.seq_len = seq_len
        self.rows = rows(int(self.ends[-1]) if len(self.ends) else 0)  # rows this group packs per epoch
        self._parts_of_window: dict[int, np.ndarray] = {}

    @property
    def n_windows(self) -> int:
        return len(self.window_start)

    def pieces(self, row0: int, row1: int, *, group: int = 0) -> Pieces:
        """The fragments of the group's rows [row0, row1); tokens past the end of its stream (the eval
        split's padded last row and step) are in none: they are padding."""
        total = int(self.ends[-1]) if len(self.ends) else 0
        start, stop = min(row0 * self.seq_len, total), min(row1 * self.seq_len, total)
        if start == stop:
            return Pieces.concat([])
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
            group=np.full(len(k), group, dtype=np.int64),
        )

    def needs(self, row0: int, row1: int) -> tuple[np.ndarray, np.ndarray]:
        """(part, window) of each sample the group's rows [row0, row1) touch, in the order they need them."""
        first = np.searchsorted(self.ends, row0 * self.seq_len, side="right")
        last = np.searchsorted(self.begins, row1 * self.seq_len, side="left")
        windows = np.searchsorted(self.window_start, np.arange(first, last), side="right") - 1
        return self.part_sequence[first:last], windows

    def parts_of_window(self, window: int) -> np.ndarray:
        """The window's parts in the order the epoch first needs them (the order to read them in)."""
        if window not in self._parts_of_window:
            stop = self.window_start[window + 1] if window + 1 < self.n_windows else len(self.order)
            sequence = self.part_sequence[self.window_start[window] : stop]
            _, first = np.unique(sequence, return_index=True)
            self._parts_of_window[window] = sequence[np.sort(first)]
        return self._parts_of_window[window]


class EpochPlan:
    """One epoch: each reader group's order and packed rows (`GroupPlan`), and the global row stream
    that deals the groups' rows round-robin (global row i is row j of group g, for the j-th round and the
    g-th group still holding rows in it). A step's rows are laid out group by group, so the ranks (and
    DataLoader workers) that split a step split its groups, and read disjoint parts. Cuts any block of a
    step into pieces without reading data. One group: global row i is the group's row i."""

    def __init__(
        self,
        table: SplitTable,
        *,
        seed: int,
        epoch: int,
        seq_len: int,
        window_parts: int | None,
        group_of_sample: np.ndarray,
        rows: Callable[[int], int],
    ):
        n_groups = int(group_of_sample.max()) + 1 if len(group_of_sample) else 1
        members = np.argsort(group_of_sample, kind="stable")  # id order inside each group
        bounds = np.searchsorted(group_of_sample[members], np.arange(n_groups + 1))
        keys = [[seed, epoch]] if n_groups == 1 else [[seed, epoch, g] for g in range(n_groups)]
        self.groups = [
            GroupPlan(
                table,
                members[bounds[g] : bounds[g + 1]],
                np.bincount(table.part[members[bounds[g] : bounds[g + 1]]], minlength=len(table.parts)) > 0,
                key=keys[g],
                seq_len=seq_len,
                window_parts=window_parts,
                rows=rows,
            )
            for g in range(n_groups)
        ]
        self.seq_len = seq_len
        self.windowed = any(g.n_windows > 1 for g in self.groups)
        rows_of = np.array([g.rows for g in self.groups], dtype=np.int64)
        self.total_rows = int(rows_of.sum())
        # Round j holds the groups with more than j rows, in group order.
        self._levels = np.unique(rows_of)
        below = np.concatenate([[-1], self._levels[:-1]])
        self._active = np.full((len(self._levels), n_groups), -1, dtype=np.int64)
        for level, floor in enumerate(below.tolist()):  # one step per distinct group length
            holding = np.flatnonzero(rows_of > floor)
            self._active[level, : len(holding)] = holding
        per_round = n_groups - np.searchsorted(np.sort(rows_of), np.arange(int(rows_of.max())), side="right")
        self._round_start = np.concatenate([[0], np.cumsum(per_round)])

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(group, row within the group) of global rows (all below `total_rows`)."""
        j = np.searchsorted(self._round_start, rows, side="right") - 1
        level = np.searchsorted(self._levels, j, side="right")
        return self._active[level, rows - self._round_start[j]], j

    def block_runs(self, row0: int, n_rows: int, *, first: int, count: int) -> list[tuple[int, int, int, int]]:
        """Of the step's global rows [row0, row0 + n_rows), laid out by group (then row), the `count`
        rows from `first` on, as runs (group, first row in it, rows, position in the block). Rows past
        the end of the epoch's stream are padding, in no run."""
        rows = np.arange(row0, min(row0 + n_rows, self.total_rows))
        group, j = self.locate(rows)
        layout = np.lexsort((j, group))[first : first + count]
        group, j = group[layout], j[layout]
        if not len(group):
            return []
        starts = np.flatnonzero(np.diff(group, prepend=-1))  # a group's rows in a step are consecutive
        lengths = np.diff(np.append(starts, len(group)))
        return list(zip(group[starts].tolist(), j[starts].tolist(), lengths.tolist(), starts.tolist()))

    def block(self, row0: int, n_rows: int, *, first: int, count: int) -> Pieces:
        """The fragments of a block of a step (see `block_runs`), `flat` counted from the block's start."""
        out = []
        for g, j0, n, at in self.block_runs(row0, n_rows, first=first, count=count):  # one step per group
            p = self.groups[g].pieces(j0, j0 + n, group=g)
            p.flat += at * self.seq_len
            out.append(p)
        return Pieces.concat(out)


def _windowed_order(
    table: SplitTable, members: np.ndarray, own: np.ndarray, *, key: list[int], window_parts: int
) -> tuple[np.ndarray, np.ndarray]:
    """(sample order, start of each window in it) of a group's samples `members` (in id order) and parts
    (`own`): its parts permuted and cut into windows, samples permuted inside each window. One pass
    over the samples, one loop step per window."""
    n_parts = len(table.parts)
    part_order = np.random.default_rng([*key, _WINDOW_STREAM]).permutation(n_parts)
    part_order = part_order[own[part_order]]  # the group's parts, in the permuted order
    window_of_part = np.zeros(n_parts, dtype=np.int64)
    window_of_part[part_order] = np.arange(len(part_order)) // window_parts
    window_of_sample = window_of_part[table.part[members]]
    by_window = members[np.argsort(window_of_sample, kind="stable")]  # id order inside each window
    counts = np.bincount(window_of_sample, minlength=int(window_of_part.max()) + 1)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    order = np.empty_like(by_window)
    for k, (s, c) in enumerate(zip(starts.tolist(), counts.tolist())):  # one step per window
        order[s : s + c] = by_window[s : s + c][np.random.default_rng([*key, k]).permutation(c)]
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


def group_window_parts(window: int | None, *, groups: int, where: str) -> int | None:
    """Parts per window of each reader group: the budget's window (`window_parts`, None for one window)
    shared by the groups, so a reader that takes rows of every group (one rank) holds two windows of
    each and stays within the budget; readers of fewer groups hold less. Never depends on the world size."""
    if window is None or groups == 1:
        return window
    if window < groups:
        raise StreamConfigError(
            f"the memory budget holds windows of {window} parts of {where}, fewer than one part for each of "
            f"{groups} reader groups; raise --memory-budget or lower --reader-groups"
        )
    return window // groups
