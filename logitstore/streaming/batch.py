"""A packed micro-batch (`PackedBatch`) and how a source lays its pieces out in one (`assemble`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numba
import numpy as np
import torch

from logitstore.format.samples import SparseSamples, ranges
from logitstore.streaming.order import Pieces
from logitstore.streaming.segments import SegmentPlan
from logitstore.streaming.targets import AlignedTargets, SparseTargets
from logitstore.text.chat import supervised_positions


@dataclass
class PackedBatch:
    """One micro-batch of `B` rows of `L` tokens, with each teacher's sparse targets flattened in
    row-major (b, t) order. `positions[p] = b*L + t` is a supervised token; it predicts token t+1.

    One layout for one teacher or several: `signals` holds (name, targets) per teacher over the same P
    positions, `SparseTargets` for a teacher with the student's tokenizer, `AlignedTargets` for a
    cross-tokenizer one. A batch of one same-tokenizer teacher (a store's, or live mode's) also reads as
    that teacher's targets: `batch.entry_ids`, `.tail`, ... are those of `batch.targets`."""

    input_ids: torch.Tensor  # [B, L] int64
    position_ids: torch.Tensor  # [B, L] int64, 0 at each sample or fragment start
    document_ids: torch.Tensor  # [B, L] int64, segment number within the row; padding -1
    positions: torch.Tensor  # [P] int64
    target_ids: torch.Tensor  # [P] int64, = input_ids.view(-1)[positions + 1]
    signals: list[tuple[str, SparseTargets | AlignedTargets]]  # per teacher, its targets at the P positions
    n_tokens: int  # real (non-padding) tokens
    # (sample id, first token of the fragment in the sample, flat start b*L + t, length) per segment,
    # in row-major order: for logging and tests; skipped fragments are absent.
    segments: list[tuple[str, int, int, int]] = field(default_factory=list)
    # A mix of teachers (`logitstore/streaming/mixing.py`: several, or cross-tokenizer ones): the counts behind its
    # metrics (each teacher's share of the positions); empty for one teacher's batch.
    signal_counts: dict = field(default_factory=dict)
    # The stream's `state_dict()` once this batch is consumed: resume point for a loop that reads the
    # stream through a DataLoader's worker processes, whose progress the parent's stream cannot see.
    data_state: dict | None = None
    # Where the segments lie, for the attention (`segments.plan_segments`): planned by the stream when it
    # packs the batch, so the step neither computes it nor reads anything back from the device for it.
    segment_plan: SegmentPlan | None = None

    @property
    def mixed(self) -> bool:
        """From a mix of teachers: the metrics add each teacher's KL and the signal shares."""
        return bool(self.signal_counts)

    @property
    def targets(self) -> SparseTargets:
        """The targets of a batch of one same-tokenizer teacher."""
        ((_, targets),) = self.signals
        assert isinstance(targets, SparseTargets), "one teacher with the student's tokenizer"
        return targets

    # The one teacher's targets, by the names of the Python API (`batch.entry_ids`, ...).
    entry_ids = property(lambda self: self.targets.entry_ids, doc="[E] int64")
    entry_logprobs = property(lambda self: self.targets.entry_logprobs, doc="[E] float32")
    entry_pos = property(lambda self: self.targets.entry_pos, doc="[E] int64 in [0, P), non-decreasing")
    tail = property(lambda self: self.targets.tail, doc="[P] float32, teacher mass outside the entries")
    target_logprobs = property(lambda self: self.targets.target_logprobs, doc="[P] float32, of the target")
    entry_counts = property(lambda self: self.targets.entry_counts, doc="[E] float32 draws (sampled), or None")

    def block_causal_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[B, 1, L, L] additive mask: 0 where query may attend key (same document, key <= query),
        `finfo(dtype).min` elsewhere. A padding query attends to itself only, so softmax has no NaN."""
        doc = self.document_ids
        length = doc.shape[1]
        same = doc[:, :, None] == doc[:, None, :]
        causal = torch.ones(length, length, dtype=torch.bool, device=doc.device).tril()
        itself = torch.eye(length, dtype=torch.bool, device=doc.device)
        allowed = torch.where((doc >= 0)[:, :, None], same & causal, itself)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=doc.device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]

    def to(self, device, *, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor on `device`, the teachers' targets too."""
        moved: dict[str, Any] = {}  # field name -> value, of that field's type
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        moved["signals"] = [(name, on_device(t, device, non_blocking=non_blocking)) for name, t in self.signals]
        if self.segment_plan is not None:
            moved["segment_plan"] = self.segment_plan.to(device, non_blocking=non_blocking)
        return PackedBatch(**moved)


def on_device(targets, device, *, non_blocking: bool = False):
    """A teacher's targets (`SparseTargets` or `AlignedTargets`) with every tensor on `device`."""
    tensors = {
        f.name: getattr(targets, f.name).to(device, non_blocking=non_blocking)
        for f in dataclasses.fields(targets)
        if isinstance(getattr(targets, f.name), torch.Tensor)
    }
    return dataclasses.replace(targets, **tensors)


def sparse_targets_of(
    fragments: SparseSamples, *, target_ids: np.ndarray, at: np.ndarray | None = None, weight: np.ndarray | None = None
) -> SparseTargets:
    """One teacher's targets at a batch's P positions (P = len(target_ids)) from its decoded fragments,
    whose positions lie, in order, at `at` (default: all P). A position not in `at` has no entries, a
    tail of 1 and a target log-probability of 0 (a teacher that lacks the sample; its weight there is 0)."""
    P = len(target_ids)
    tail, target_logprobs = fragments.tail.astype(np.float32), fragments.target_logprobs.astype(np.float32)
    if at is None:
        at = np.arange(P, dtype=np.int64)
    else:
        tail, target_logprobs = _at(tail, at, P, fill=1.0), _at(target_logprobs, at, P, fill=0.0)
    counts = fragments.entry_counts
    return SparseTargets(
        entry_ids=torch.from_numpy(fragments.entry_ids.astype(np.int64, copy=False)),
        entry_logprobs=torch.from_numpy(fragments.entry_logprobs.astype(np.float32, copy=False)),
        entry_pos=torch.from_numpy(repeat(at, fragments.n_entries)),
        tail=torch.from_numpy(tail),
        target_ids=torch.from_numpy(target_ids),
        target_logprobs=torch.from_numpy(target_logprobs),
        entry_counts=None if counts is None else torch.from_numpy(counts.astype(np.float32)),
        weight=None if weight is None else torch.from_numpy(weight),
    )


def repeat(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64 `np.repeat(values, counts)` without the GIL (numpy's holds it: at top-64, 1M entries a
    batch, ~2 ms in which the stream's reader threads could not start a decompression)."""
    out = np.empty(int(np.sum(counts)), dtype=np.int64)
    _repeat_kernel(np.asarray(values, dtype=np.int64), np.asarray(counts, dtype=np.int64), out)
    return out


@numba.njit(cache=True, nogil=True)
def _repeat_kernel(values, counts, out):
    k = 0
    for i in range(len(values)):  # a slice fill a value: 3x faster than an element loop
        out[k : k + counts[i]] = values[i]
        k += counts[i]


def _at(values: np.ndarray, at: np.ndarray, n: int, *, fill: float) -> np.ndarray:
    out = np.full(n, fill, dtype=values.dtype)
    out[at] = values
    return out


def no_targets(*, sampled: bool) -> SparseTargets:
    """A teacher's targets at no positions (a batch of padding only)."""
    long, float_ = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
    return SparseTargets(
        entry_ids=long,
        entry_logprobs=float_,
        entry_pos=long,
        tail=float_,
        target_ids=long,
        target_logprobs=float_,
        entry_counts=float_ if sampled else None,
    )


class BatchContext(Protocol):
    """What a source's `build` needs of the stream it builds for: the batch's shape, and where a sample
    that cannot be used goes (`Stream.unreadable`: raised, or skipped)."""

    micro_batch: int
    seq_len: int

    def unreadable(self, row: int, error: Exception, *, part: str | None = None) -> None: ...


@dataclass
class Layout:
    """Where the readable pieces go in the [B * L] batch."""

    flat: np.ndarray  # start of each readable piece in the flat [B * L] batch
    n: np.ndarray  # its length
    tokens: np.ndarray  # flat indices of all their tokens
    positions: np.ndarray  # flat indices of the supervised tokens (all but each piece's last)
    position_ids: np.ndarray  # [B * L]
    document_ids: np.ndarray  # [B * L]


def layout(pieces: Pieces, ok: np.ndarray, *, micro_batch: int, seq_len: int) -> Layout:
    B, L = micro_batch, seq_len
    lengths = pieces.b - pieces.a
    row_of = pieces.flat // L
    document = np.arange(len(lengths)) - np.searchsorted(row_of, row_of, side="left")
    position_ids = np.zeros(B * L, dtype=np.int64)
    document_ids = np.full(B * L, -1, dtype=np.int64)
    flat, n = pieces.flat[ok], lengths[ok]
    tokens = ranges(flat, n)
    position_ids[tokens] = tokens - np.repeat(flat, n)
    document_ids[tokens] = np.repeat(document[ok], n)
    positions = ranges(flat, n - 1)  # all but each piece's last token: the decoded positions' order
    return Layout(
        flat=flat, n=n, tokens=tokens, positions=positions, position_ids=position_ids, document_ids=document_ids
    )


def assemble(
    pieces: Pieces,
    ok: np.ndarray,
    decoded: SparseSamples | None,
    *,
    teacher: str,
    sample_ids: list[str],
    micro_batch: int,
    seq_len: int,
    sampled: bool,
    completion_only: bool = True,
) -> PackedBatch:
    """The batch of one teacher's readable pieces (`ok`), whose fragments, decoded, are `decoded` in piece
    order (None: none is readable). Chat data (`decoded.loss_mask`) with `completion_only` keeps the
    positions whose next token is completion."""
    B, L = micro_batch, seq_len
    lay = layout(pieces, ok, micro_batch=B, seq_len=L)
    input_ids = np.zeros(B * L, dtype=np.int64)
    positions = lay.positions
    if decoded is None:  # every fragment was skipped: all padding, no targets
        targets = no_targets(sampled=sampled)
    else:
        input_ids[lay.tokens] = decoded.input_ids
        targets = sparse_targets_of(decoded, target_ids=input_ids[positions + 1])
        if completion_only and decoded.loss_mask is not None:
            keep = supervised_positions(decoded.loss_mask, lay.n)
            positions, targets = positions[keep], targets.restrict(torch.from_numpy(keep))
    segments = [
        (sample_ids[r], int(a), int(f), int(m))
        for r, a, f, m in zip(pieces.row[ok].tolist(), pieces.a[ok].tolist(), lay.flat.tolist(), lay.n.tolist())
    ]
    return PackedBatch(
        input_ids=torch.from_numpy(input_ids.reshape(B, L)),
        position_ids=torch.from_numpy(lay.position_ids.reshape(B, L)),
        document_ids=torch.from_numpy(lay.document_ids.reshape(B, L)),
        positions=torch.from_numpy(positions),
        target_ids=targets.target_ids,
        signals=[(teacher, targets)],
        n_tokens=int(lay.n.sum()),
        segments=segments,
    )
