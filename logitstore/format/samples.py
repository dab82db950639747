"""`SparseSamples`: the in-memory form of sparse next-token distributions, flat and token-major.

Several samples travel together as flat arrays with per-row counts (the ragged layout Arrow and
Zarr use), so top-k (fixed entries), top-p (varying entries) and sampled (entries with counts) all
fit without padding. For sample s with T_s tokens there are T_s - 1 positions; position t predicts
token t + 1.

    input_ids        [sum T_s]      the tokens the teacher saw
    n_entries        [P]            entries stored for each position, P = sum (T_s - 1)
    entry_ids        [E]            token ids of the entries, E = sum n_entries
    entry_logprobs   [E]            log-softmax over the full vocabulary at temperature 1
    entry_counts     [E] or None    draws per entry (sampled stores only)
    tail             [P]            probability mass outside the stored entries
    target_logprobs  [P]            log-probability of the actual next token, stored or not
    loss_mask        [sum T_s] or None   1 for completion tokens (chat data, `logitstore.text.chat`);
                                    None for plain text, where every token is supervised
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from logitstore.errors import InvalidSampleError

# log_softmax can round a certain token's log-probability to a hair above zero.
LOGPROB_TOLERANCE = 1e-4
# Characters a sample id may not hold: C0 controls (NUL, tab, newline, ...), DEL and C1 controls. `ls`
# would print them raw, and an id with NUL cannot be given to `show`. The build checks its input ids
# against the same class (`pipelines/inputs/columns.py`), naming the row.
CONTROL_CHARACTERS = r"[\x00-\x1f\x7f-\x9f]"
_CONTROL = re.compile(CONTROL_CHARACTERS)


@dataclass
class SparseSamples:
    sample_ids: list[str]
    n_tokens: np.ndarray
    input_ids: np.ndarray
    n_entries: np.ndarray
    entry_ids: np.ndarray
    entry_logprobs: np.ndarray
    tail: np.ndarray
    target_logprobs: np.ndarray
    entry_counts: np.ndarray | None = None
    loss_mask: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def n_positions(self) -> np.ndarray:
        return self.n_tokens - 1

    @property
    def token_offsets(self) -> np.ndarray:
        """[S + 1] start of each sample in `input_ids`."""
        return row_offsets(self.n_tokens)

    @property
    def position_offsets(self) -> np.ndarray:
        """[S + 1] start of each sample in the per-position arrays."""
        return row_offsets(self.n_positions)

    @property
    def entry_offsets(self) -> np.ndarray:
        """[P + 1] start of each position in the per-entry arrays."""
        return row_offsets(self.n_entries)

    def select(self, i: int) -> SparseSamples:
        """Sample i alone (views where possible)."""
        t0, t1 = self.token_offsets[i : i + 2]
        p0, p1 = self.position_offsets[i : i + 2]
        e0, e1 = self.entry_offsets[[p0, p1]]
        counts = None if self.entry_counts is None else self.entry_counts[e0:e1]
        mask = None if self.loss_mask is None else self.loss_mask[t0:t1]
        return SparseSamples(
            sample_ids=[self.sample_ids[i]],
            n_tokens=self.n_tokens[i : i + 1],
            input_ids=self.input_ids[t0:t1],
            n_entries=self.n_entries[p0:p1],
            entry_ids=self.entry_ids[e0:e1],
            entry_logprobs=self.entry_logprobs[e0:e1],
            tail=self.tail[p0:p1],
            target_logprobs=self.target_logprobs[p0:p1],
            entry_counts=counts,
            loss_mask=mask,
        )

    def cut(self, which: np.ndarray, a: np.ndarray, b: np.ndarray) -> SparseSamples:
        """Fragments, as samples of their own in the given order: tokens [a[k], b[k]) and their positions
        [a[k], b[k] - 1) of sample which[k] (`b - a` >= 1; a fragment of one token has no position).
        Vectorised: one gather per array."""
        which, a, b = (np.asarray(x, dtype=np.int64) for x in (which, a, b))
        tokens = ranges(self.token_offsets[which] + a, b - a)
        first = self.position_offsets[which] + a
        positions = ranges(first, b - a - 1)
        e = self.entry_offsets
        entries = ranges(e[first], e[first + b - a - 1] - e[first])
        return SparseSamples(
            sample_ids=[self.sample_ids[i] for i in which.tolist()] if self.sample_ids else [],
            n_tokens=b - a,
            input_ids=self.input_ids[tokens],
            n_entries=self.n_entries[positions],
            entry_ids=self.entry_ids[entries],
            entry_logprobs=self.entry_logprobs[entries],
            tail=self.tail[positions],
            target_logprobs=self.target_logprobs[positions],
            entry_counts=None if self.entry_counts is None else self.entry_counts[entries],
            loss_mask=None if self.loss_mask is None else self.loss_mask[tokens],
        )

    def keep_positions(self, keep: np.ndarray) -> SparseSamples:
        """These samples with no entries at the positions where `keep` [P] is False (tail 1, target
        log-probability 0): what a chat build stores for prompt positions, which no loss reads."""
        keep = np.asarray(keep, dtype=bool)
        entry_keep = np.repeat(keep, self.n_entries)
        counts = None if self.entry_counts is None else self.entry_counts[entry_keep]
        return dataclasses.replace(
            self,
            n_entries=np.where(keep, self.n_entries, 0),
            entry_ids=self.entry_ids[entry_keep],
            entry_logprobs=self.entry_logprobs[entry_keep],
            entry_counts=counts,
            tail=np.where(keep, self.tail, 1).astype(self.tail.dtype),
            target_logprobs=np.where(keep, self.target_logprobs, 0).astype(self.target_logprobs.dtype),
        )

    @classmethod
    def from_dense_topk(
        cls,
        sample_ids: list[str],
        *,
        input_ids: list[np.ndarray],
        topk_ids: list[np.ndarray],
        topk_logprobs: list[np.ndarray],
        tail: list[np.ndarray],
        target_logprobs: list[np.ndarray],
    ) -> SparseSamples:
        """Build from per-sample [T-1, k] arrays (the shape a top-k forward pass produces)."""
        k_per_position = [np.full(len(t), ids.shape[1] if ids.ndim == 2 else 0) for t, ids in zip(tail, topk_ids)]
        return cls(
            sample_ids=list(sample_ids),
            n_tokens=np.array([len(x) for x in input_ids], dtype=np.int64),
            input_ids=_cat(input_ids, np.int64),
            n_entries=_cat(k_per_position, np.int64),
            entry_ids=_cat([np.asarray(x).reshape(-1) for x in topk_ids], np.int64),
            entry_logprobs=_cat([np.asarray(x).reshape(-1) for x in topk_logprobs], np.float32),
            tail=_cat(tail, np.float32),
            target_logprobs=_cat(target_logprobs, np.float32),
        )

    def validate(self, *, vocab_size: int, duplicates: bool = True) -> None:
        """Raise `InvalidSampleError` naming the first problem found. Vectorised: O(E) numpy passes.
        `duplicates=False` leaves out the check for a token id twice among one position's entries,
        the one check that sorts (60 ms per 1M entries): `codec.encode` makes it for free."""
        _check_shapes(self)
        _check_ids(self, vocab_size, duplicates=duplicates)
        _check_values(self)


def concat(parts: list[SparseSamples]) -> SparseSamples:
    assert parts, "concat needs at least one part"
    has_counts = parts[0].entry_counts is not None
    assert all((p.entry_counts is not None) == has_counts for p in parts), "mixing sampled and non-sampled"
    has_mask = parts[0].loss_mask is not None
    assert all((p.loss_mask is not None) == has_mask for p in parts), "mixing chat and plain samples"
    return SparseSamples(
        sample_ids=[sid for p in parts for sid in p.sample_ids],
        n_tokens=np.concatenate([p.n_tokens for p in parts]),
        input_ids=np.concatenate([p.input_ids for p in parts]),
        n_entries=np.concatenate([p.n_entries for p in parts]),
        entry_ids=np.concatenate([p.entry_ids for p in parts]),
        entry_logprobs=np.concatenate([p.entry_logprobs for p in parts]),
        tail=np.concatenate([p.tail for p in parts]),
        target_logprobs=np.concatenate([p.target_logprobs for p in parts]),
        entry_counts=np.concatenate([p.entry_counts for p in parts]) if has_counts else None,
        loss_mask=np.concatenate([p.loss_mask for p in parts]) if has_mask else None,
    )


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lengths) + np.arange(total, dtype=np.int64)


def row_offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _cat(arrays: list, dtype) -> np.ndarray:
    if not arrays:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([np.asarray(a, dtype=dtype).reshape(-1) for a in arrays])


def _fail(message: str) -> None:
    raise InvalidSampleError(message)


def _check_shapes(s: SparseSamples) -> None:
    arrays = {
        "n_tokens": s.n_tokens,
        "input_ids": s.input_ids,
        "n_entries": s.n_entries,
        "entry_ids": s.entry_ids,
        "entry_logprobs": s.entry_logprobs,
        "tail": s.tail,
        "target_logprobs": s.target_logprobs,
    }
    if s.entry_counts is not None:
        arrays["entry_counts"] = s.entry_counts
    if s.loss_mask is not None:
        arrays["loss_mask"] = s.loss_mask
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray) or a.ndim != 1:
            _fail(f"{name} must be a 1-D numpy array, got {type(a).__name__} of shape {getattr(a, 'shape', None)}")
        kind = "f" if name in ("entry_logprobs", "tail", "target_logprobs") else "iub" if name == "loss_mask" else "iu"
        if a.dtype.kind not in kind:
            _fail(f"{name} must have a {'float' if kind == 'f' else 'integer'} dtype, got {a.dtype}")
    if len(s.sample_ids) != len(s.n_tokens):
        _fail(f"{len(s.sample_ids)} sample ids but {len(s.n_tokens)} token counts")
    bad_ids = [sid for sid in s.sample_ids if not isinstance(sid, str) or not sid or _CONTROL.search(sid)]
    if bad_ids:
        _fail(f"sample ids must be non-empty strings without control characters, got {bad_ids[0]!r}")
    if len(set(s.sample_ids)) != len(s.sample_ids):
        dup = next(sid for sid in s.sample_ids if s.sample_ids.count(sid) > 1)
        _fail(f"sample id {dup!r} appears twice in one write")
    if len(s.n_tokens) and s.n_tokens.min() < 2:
        short = s.sample_ids[int(np.argmin(s.n_tokens))]
        _fail(f"sample {short!r} has {int(s.n_tokens.min())} tokens; a sample needs at least 2")
    expected = {
        "input_ids": int(s.n_tokens.sum()),
        "loss_mask": int(s.n_tokens.sum()),
        "n_entries": int(s.n_positions.sum()),
        "tail": int(s.n_positions.sum()),
        "target_logprobs": int(s.n_positions.sum()),
    }
    for name, n in expected.items():
        if name in arrays and len(arrays[name]) != n:
            _fail(f"{name} has {len(arrays[name])} elements, expected {n} from the token counts")
    if len(s.n_entries) and s.n_entries.min() < 0:
        _fail("n_entries has a negative count")
    n_e = int(s.n_entries.sum())
    for name in ("entry_ids", "entry_logprobs", "entry_counts"):
        if name in arrays and len(arrays[name]) != n_e:
            _fail(f"{name} has {len(arrays[name])} elements, expected {n_e} (the sum of n_entries)")


def _check_ids(s: SparseSamples, vocab_size: int, *, duplicates: bool) -> None:
    for name, ids in (("input_ids", s.input_ids), ("entry_ids", s.entry_ids)):
        low, high = (int(ids.min()), int(ids.max())) if len(ids) else (0, 0)
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            _fail(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    if len(s.entry_ids) < 2 or not duplicates:
        return
    # Duplicate ids within one position: sort by (position, id) and look for equal neighbours.
    position = np.repeat(np.arange(len(s.n_entries)), s.n_entries)
    key = position.astype(np.int64) * vocab_size + s.entry_ids.astype(np.int64)
    key.sort()
    if (np.diff(key) == 0).any():
        dup = key[1:][np.diff(key) == 0][0]
        _fail(f"token id {dup % vocab_size} appears twice among the entries of position {dup // vocab_size}")


def _check_values(s: SparseSamples) -> None:
    for name, values in (("entry_logprobs", s.entry_logprobs), ("target_logprobs", s.target_logprobs)):
        if np.isnan(values).any():
            _fail(f"{name} contains NaN")
        if len(values) and values.max() > LOGPROB_TOLERANCE:
            _fail(f"{name} contains a positive log-probability ({float(values.max()):.4g})")
    if np.isnan(s.tail).any() or (len(s.tail) and (s.tail.min() < -1e-4 or s.tail.max() > 1 + 1e-4)):
        _fail("tail must be a probability mass in [0, 1]")
    if s.loss_mask is not None and len(s.loss_mask) and s.loss_mask.max() > 1:
        _fail("loss_mask must hold 0 or 1 per token")
    if s.entry_counts is not None and len(s.entry_counts) and s.entry_counts.min() < 1:
        _fail("entry_counts must be at least 1 for every stored entry")


@dataclass
class StudentTokens:
    """One student tokenizer's view of S samples (flat, like `SparseSamples`): the student's token ids
    and the alignment groups between the sample's teacher tokens and those student tokens.

    Group g of sample s is the row (t0, t1, s0, s1): teacher tokens [t0, t1) of the sample's
    `input_ids` and student tokens [s0, s1) of its `ids` cover exactly the same bytes of the text.
    Groups are in order and contiguous; they cover all of the sample's student ids, and its teacher
    tokens except partial groups cut by a window edge (see `logitstore.pipelines.align.window_groups`).
    """

    ids: np.ndarray  # int32 [N]
    n_ids: np.ndarray  # int32 [S]
    groups: np.ndarray  # int32 [G, 4]
    n_groups: np.ndarray  # int32 [S]
    loss_mask: np.ndarray | None = None  # uint8 [N], chat data: 1 for student tokens inside the completion

    def __len__(self) -> int:
        return len(self.n_ids)

    @classmethod
    def from_samples(cls, samples: list[tuple]) -> StudentTokens:
        """From per-sample (ids, groups [g, 4]) pairs, or (ids, groups, loss_mask) triples (chat data)."""
        ids = [np.asarray(x[0], dtype=np.int32) for x in samples]
        groups = [np.asarray(x[1], dtype=np.int32).reshape(-1, 4) for x in samples]
        masked = bool(samples) and len(samples[0]) == 3
        assert all((len(x) == 3) == masked for x in samples), "mixing chat and plain samples"
        return cls(
            ids=_cat(ids, np.int32),
            n_ids=np.array([len(i) for i in ids], dtype=np.int32),
            groups=np.concatenate(groups) if groups else np.zeros((0, 4), np.int32),
            n_groups=np.array([len(g) for g in groups], dtype=np.int32),
            loss_mask=_cat([x[2] for x in samples], np.uint8) if masked else None,
        )

    def sample(self, i: int) -> tuple:
        """(ids, groups) of sample i, and its loss mask for chat data."""
        id_off, group_off = row_offsets(self.n_ids), row_offsets(self.n_groups)
        out = (self.ids[id_off[i] : id_off[i + 1]], self.groups[group_off[i] : group_off[i + 1]])
        return out if self.loss_mask is None else (*out, self.loss_mask[id_off[i] : id_off[i + 1]])

    def select(self, rows: list[int]) -> StudentTokens:
        return StudentTokens.from_samples([self.sample(i) for i in rows])

    def validate(self, *, n_tokens: np.ndarray, vocab_size: int) -> None:
        if len(self.n_ids) != len(n_tokens) or len(self.n_groups) != len(n_tokens):
            _fail(f"student tokens for {len(self.n_ids)} samples, teacher arrays for {len(n_tokens)}")
        if len(self.ids) and (self.ids.min() < 0 or self.ids.max() >= vocab_size):
            _fail(f"student token ids must lie in [0, {vocab_size})")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.ids):
            _fail(
                f"student loss_mask has {len(self.loss_mask)} elements, expected {len(self.ids)} (one per student token)"
            )
        g = self.groups
        sample_of = np.repeat(np.arange(len(n_tokens)), self.n_groups)
        if (g[:, 0] > g[:, 1]).any() or (g[:, 2] > g[:, 3]).any() or (g[:, 0] < 0).any() or (g[:, 2] < 0).any():
            _fail("alignment groups must be half-open ranges (t0 <= t1, s0 <= s1)")
        if (g[:, 1] > np.asarray(n_tokens)[sample_of]).any() or (g[:, 3] > self.n_ids[sample_of]).any():
            _fail("alignment groups must lie within the sample's teacher and student tokens")
