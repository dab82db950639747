"""A packed micro-batch (`PackedBatch`) and how a source lays its pieces out in one (`assemble`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypedDict

import numpy as np
import torch

from logitstore.chat import supervised_positions
from logitstore.trainer.order import Pieces, ranges


@dataclass
class PackedBatch:
    """One micro-batch of `B` rows of `L` tokens, with the teacher's sparse targets flattened in
    row-major (b, t) order. `positions[p] = b*L + t` is a supervised token; it predicts token t+1."""

    input_ids: torch.Tensor  # [B, L] int64
    position_ids: torch.Tensor  # [B, L] int64, 0 at each sample or fragment start
    document_ids: torch.Tensor  # [B, L] int64, segment number within the row; padding -1
    positions: torch.Tensor  # [P] int64
    entry_ids: torch.Tensor  # [E] int64
    entry_logprobs: torch.Tensor  # [E] float32
    entry_pos: torch.Tensor  # [E] int64 in [0, P), non-decreasing
    tail: torch.Tensor  # [P] float32, teacher mass outside the entries
    target_ids: torch.Tensor  # [P] int64, = input_ids.view(-1)[positions + 1]
    target_logprobs: torch.Tensor  # [P] float32, teacher log-probability of the target
    entry_counts: torch.Tensor | None  # [E] float32 draws per entry (sampled stores), else None
    n_tokens: int  # real (non-padding) tokens
    # (sample id, first token of the fragment in the sample, flat start b*L + t, length) per segment,
    # in row-major order: for logging and tests; skipped fragments are absent.
    segments: list[tuple[str, int, int, int]] = field(default_factory=list)
    # Runs with several teachers or a cross-tokenizer teacher (`trainer/mixing.py`): per teacher,
    # (name, SparseTargets | AlignedTargets) over the same P positions, and counts for the metrics.
    # The single-teacher fields above then hold no entries.
    signals: list | None = None
    signal_counts: dict | None = None
    # The stream's `state_dict()` once this batch is consumed: resume point for a loop that reads the
    # stream through a DataLoader's worker processes, whose progress the parent's stream cannot see.
    data_state: dict | None = None

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
        """A copy with every tensor on `device`."""
        moved: dict[str, Any] = {}  # field name -> value, of that field's type
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        return PackedBatch(**moved)


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


class _RowTensors(TypedDict):
    """The [B, L] tensors of a `PackedBatch`, shared by the two ways `assemble` ends."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor


def assemble(
    pieces: Pieces,
    ok: np.ndarray,
    decoded,
    *,
    sample_ids: list[str],
    micro_batch: int,
    seq_len: int,
    sampled: bool,
    completion_only: bool = True,
) -> PackedBatch:
    """The batch of the readable pieces (`ok`), whose decoded samples are `decoded` in piece order. Chat
    data (`decoded.loss_mask`) with `completion_only` keeps the positions whose next token is completion."""
    B, L = micro_batch, seq_len
    lay = layout(pieces, ok, micro_batch=B, seq_len=L)
    input_ids = np.zeros(B * L, dtype=np.int64)
    empty_long, empty_float = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
    common = _RowTensors(
        input_ids=torch.from_numpy(input_ids.reshape(B, L)),
        position_ids=torch.from_numpy(lay.position_ids.reshape(B, L)),
        document_ids=torch.from_numpy(lay.document_ids.reshape(B, L)),
    )
    if decoded is None:  # every fragment was skipped: all padding, no targets
        return PackedBatch(
            **common,
            positions=empty_long,
            entry_ids=empty_long,
            entry_logprobs=empty_float,
            entry_pos=empty_long,
            tail=empty_float,
            target_ids=empty_long,
            target_logprobs=empty_float,
            entry_counts=empty_float if sampled else None,
            n_tokens=0,
        )
    input_ids[lay.tokens] = decoded.input_ids
    positions = lay.positions
    if completion_only and decoded.loss_mask is not None:
        keep = supervised_positions(decoded.loss_mask, lay.n)
        positions, decoded = positions[keep], _positions_only(decoded, keep)
    entry_pos = np.repeat(np.arange(len(positions), dtype=np.int64), decoded.n_entries)
    segments = [
        (sample_ids[r], int(a), int(f), int(m))
        for r, a, f, m in zip(pieces.row[ok].tolist(), pieces.a[ok].tolist(), lay.flat.tolist(), lay.n.tolist())
    ]
    counts = None if decoded.entry_counts is None else torch.from_numpy(decoded.entry_counts.astype(np.float32))
    return PackedBatch(
        **common,
        positions=torch.from_numpy(positions),
        entry_ids=torch.from_numpy(decoded.entry_ids.astype(np.int64)),
        entry_logprobs=torch.from_numpy(decoded.entry_logprobs),
        entry_pos=torch.from_numpy(entry_pos),
        tail=torch.from_numpy(decoded.tail.astype(np.float32)),
        target_ids=torch.from_numpy(input_ids[positions + 1]),
        target_logprobs=torch.from_numpy(decoded.target_logprobs),
        entry_counts=counts,
        n_tokens=int(lay.n.sum()),
        segments=segments,
    )


def _positions_only(decoded, keep: np.ndarray):
    """The decoded pieces' per-position and per-entry arrays at the kept positions only."""
    entries = np.repeat(keep, decoded.n_entries)
    counts = None if decoded.entry_counts is None else decoded.entry_counts[entries]
    return dataclasses.replace(
        decoded,
        n_entries=decoded.n_entries[keep],
        tail=decoded.tail[keep],
        target_logprobs=decoded.target_logprobs[keep],
        entry_ids=decoded.entry_ids[entries],
        entry_logprobs=decoded.entry_logprobs[entries],
        entry_counts=counts,
    )
