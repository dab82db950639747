"""From a teacher forward pass to `SparseSamples`: which entries each position keeps, as a
`logitstore.format.sparsity.Sparsity` says (top-k, top-p or sampled; stored log-probabilities are always at
temperature 1), made where the logits are.

`on_device` turns a `teacher.SparseBatch` (float log-probabilities on the teacher's device) into `Selected`,
the batch's real positions only, in the types the store keeps: each position's kept entry ids (int32), their
log-probabilities as the value grid's uint16 codes (`quantize`: the codec's arithmetic, so the same codes),
the codes of the tail's log-mass and of the target's log-probability, and for top-p and sampled entries how
many a position keeps (top-p's cut, and the distinct draws with their counts, are made here too). Only these
cross to the host (`to_host`): on CUDA into pinned buffers by non-blocking copies on a copy stream, with an
event that `HostSelected.samples` waits on, so the thread that launched a batch launches the next batch's
forward pass before it reads this one (`torch_engine.Selection`). The host reads the codes back as the grid's
values (`codec.dequantize`), which the writer's encode turns into the same codes again.

Everything is vectorised over positions. On the CPU "the device" is the CPU, the selection runs in numpy's
and numba's kernels (`select_numpy`; a GPU runs torch's, `select_torch`) and the copy is a view.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import numba
import numpy as np
import torch
from torch import Tensor

from logitstore.format import codec
from logitstore.format.grid import Q_MAX, CodecParams
from logitstore.format.samples import SparseSamples, ranges
from logitstore.format.sparsity import Sparsity
from logitstore.pipelines.teacher import SparseBatch, sampled_forward, sparse_topk_forward


@dataclass
class Selected:
    """One batch's selection over its real positions P (padding left out), in stored types. The 16-bit
    codes travel as int16 with the same bits (torch's uint16 has few kernels) and are read as uint16."""

    ids: Tensor  # int32 [P, w]: top-k/top-p by rank; sampled: the distinct draws ascending, packed first
    codes: Tensor  # int16 bits [P, w]: grid codes of the entries' log-probabilities
    tail: Tensor  # int16 bits [P]: code of the log of the mass outside the kept entries
    target: Tensor  # int16 bits [P]: code of the target's log-probability
    n_entries: Tensor | None = None  # int32 [P]: a position keeps its first n entries (top-p, sampled)
    counts: Tensor | None = None  # int16 bits [P, w]: draws of each distinct entry (sampled)

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def quantize(values: Tensor, grid: CodecParams) -> Tensor:
    """`codec.quantize` on the values' device: the same float64 arithmetic, so the same codes (int32):
    nats below certainty rounded half to even on the fine, then the coarse slope; minus infinity the
    reserved code, NaN code 0, anything past the grid's floor its last finite code."""
    x = -values.double()
    nan = torch.isnan(x)
    x = x.clamp(min=0.0)
    split = -grid.coarse_below
    fine = torch.round(x / grid.fine_step)
    coarse = grid.fine_levels + torch.round((x - split) / grid.coarse_step)
    q = torch.where(x <= split, fine, coarse).clamp(max=Q_MAX - 1)
    q = torch.where(torch.isinf(x), Q_MAX, q)
    return torch.where(nan, 0, q).to(torch.int32)


def _bits16(values: Tensor) -> Tensor:
    """Values in [0, 65535] as int16 with the same bits."""
    return torch.where(values >= 1 << 15, values - (1 << 16), values).to(torch.int16)


def real_positions(lengths: np.ndarray, width: int) -> np.ndarray:
    """Flat indices, into a right-padded batch's [rows x width] positions, of the positions that predict a
    real token: the first `length - 1` of each row, rows in order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return ranges(np.arange(len(lengths), dtype=np.int64) * width, lengths - 1)


def on_device(batch: SparseBatch, *, positions: Tensor, sparsity: Sparsity) -> Selected:
    """The selection of `batch` at `positions` (flat indices, on the batch's device) in stored types: torch's
    kernels on a GPU (`select_torch`), numpy's and numba's on the CPU (`select_numpy`, the same codes and
    entries). On the CPU torch's kernels hand work to its thread pool above ~32k elements, and on a busy
    2-core machine those hand-overs stalled a served answer's top-64 selection (1 ms of work) to ~150 ms."""
    if batch.ids.device.type == "cpu":
        return select_numpy(batch, positions=positions.numpy(), sparsity=sparsity)
    return select_torch(batch, positions=positions, sparsity=sparsity)


def select_torch(batch: SparseBatch, *, positions: Tensor, sparsity: Sparsity) -> Selected:
    """`on_device` in torch's kernels, on the batch's device."""
    every = len(positions) == batch.tail.numel()  # no padding (a served answer's one row): nothing to gather

    def take(t: Tensor) -> Tensor:
        flat = t.reshape(-1, *t.shape[2:])
        return flat if every else flat.index_select(0, positions)

    ids, logprobs, tail = take(batch.ids), take(batch.logprobs), take(batch.tail).double()
    n_entries = counts = None
    if sparsity.sampled:
        ids, logprobs, counts, n_entries = _distinct_draws(ids, logprobs)
    elif sparsity.mode == "topp":
        assert sparsity.p is not None, "Sparsity refuses top-p without p"
        selection = logprobs if batch.selection_logprobs is None else take(batch.selection_logprobs)
        n_entries, tail = _top_p(logprobs, selection, tail, p=sparsity.p)
    grid = sparsity.grid
    # The tail as the store has always taken it: a float32 mass in [0, 1], then the log of that.
    log_mass = torch.log(tail.clamp(0.0, 1.0).float().double())
    return Selected(
        ids=ids.to(torch.int32),
        codes=_bits16(quantize(logprobs, grid)),
        tail=_bits16(quantize(log_mass, grid)),
        target=_bits16(quantize(take(batch.target_logprob), grid)),
        n_entries=n_entries,
        counts=None if counts is None else _bits16(counts),
    )


def select_numpy(batch: SparseBatch, *, positions: np.ndarray, sparsity: Sparsity) -> Selected:
    """`on_device` in numpy's and numba's kernels, for a batch on the CPU: the same arithmetic as
    `select_torch` (the codes are the codec's own, `codec.quantize`)."""
    every = len(positions) == batch.tail.numel()

    def take(t: Tensor) -> np.ndarray:
        flat = t.reshape(-1, *t.shape[2:]).numpy()
        return flat if every else flat[positions]

    ids, logprobs, tail = take(batch.ids), take(batch.logprobs), take(batch.tail).astype(np.float64)
    n_entries = counts = None
    if sparsity.sampled:
        ids, logprobs, counts, n_entries = _distinct_draws_numpy(ids, logprobs)
    elif sparsity.mode == "topp":
        assert sparsity.p is not None, "Sparsity refuses top-p without p"
        selection = logprobs if batch.selection_logprobs is None else take(batch.selection_logprobs)
        n_entries, tail = _top_p_numpy(logprobs, selection, tail, p=sparsity.p)
    grid = sparsity.grid
    with np.errstate(divide="ignore"):  # a tail of 0: log 0 is minus infinity, the grid's reserved code
        log_mass = np.log(np.clip(tail, 0.0, 1.0).astype(np.float32).astype(np.float64))

    def codes(values: np.ndarray) -> Tensor:
        return torch.from_numpy(codec.quantize(values, params=grid).view(np.int16))

    return Selected(
        ids=torch.from_numpy(np.asarray(ids, dtype=np.int32)),
        codes=codes(logprobs),
        tail=codes(log_mass),
        target=codes(take(batch.target_logprob)),
        n_entries=None if n_entries is None else torch.from_numpy(n_entries),
        counts=None if counts is None else torch.from_numpy(counts.view(np.int16)),
    )


def _top_p_numpy(logprobs: np.ndarray, selection: np.ndarray, tail: np.ndarray, *, p: float):
    """`_top_p` in numpy."""
    width = logprobs.shape[1]
    cumulative = np.cumsum(np.exp(selection.astype(np.float64)), axis=1)
    n_keep = np.minimum((cumulative < p).sum(axis=1) + 1, width)
    kept = np.arange(width)[None, :] < n_keep[:, None]
    dropped = np.where(kept, 0.0, np.exp(logprobs.astype(np.float64))).sum(axis=1)
    return n_keep.astype(np.int32), tail + dropped


def _distinct_draws_numpy(draws: np.ndarray, logprobs: np.ndarray):
    """`_distinct_draws` in one numba pass: (ids, log-probabilities, counts uint16, entries per row)."""
    ids = np.zeros(draws.shape, dtype=np.int32)
    values = np.zeros(draws.shape, dtype=np.float32)
    counts = np.zeros(draws.shape, dtype=np.uint16)
    n_entries = np.zeros(len(draws), dtype=np.int32)
    if draws.size:
        _distinct_draws_kernel(
            np.ascontiguousarray(draws), np.ascontiguousarray(logprobs), ids, values, counts, n_entries
        )
    return ids, values, counts, n_entries


@numba.njit(cache=True, nogil=True)
def _distinct_draws_kernel(draws, logprobs, ids, values, counts, n_entries):
    # One pass per row: insertion sort of its n draws (n is small, 16 by default; an equal id always has
    # the same log-probability), then each run of equal ids becomes one entry, its length the count.
    width = draws.shape[1]
    row_ids = np.empty(width, dtype=np.int64)
    row_values = np.empty(width, dtype=np.float32)
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
        e = 0
        for j in range(width):
            if j > 0 and row_ids[j] == row_ids[j - 1]:
                counts[p, e - 1] += 1
            else:
                ids[p, e] = row_ids[j]
                values[p, e] = row_values[j]
                counts[p, e] = 1
                e += 1
        n_entries[p] = e


def _top_p(logprobs: Tensor, selection: Tensor, tail: Tensor, *, p: float) -> tuple[Tensor, Tensor]:
    """Keep the shortest prefix of the (sorted) top-k whose selection mass reaches p: (entries kept, the
    tail with the dropped entries' mass)."""
    width = logprobs.shape[1]
    cumulative = torch.cumsum(torch.exp(selection.double()), dim=1)
    n_keep = ((cumulative < p).sum(dim=1) + 1).clamp(max=width)
    kept = torch.arange(width, device=logprobs.device)[None, :] < n_keep[:, None]
    dropped = torch.where(kept, 0.0, torch.exp(logprobs.double())).sum(dim=1)
    return n_keep.to(torch.int32), tail + dropped


def _distinct_draws(draws: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row [P, n]: the distinct drawn ids ascending, each with its log-probability and its count,
    packed at the row's start (zeros after): (ids, log-probabilities, counts, entries per row). Equal ids
    have equal log-probabilities, so writing a run's values to its one slot is the same in any order."""
    ids, order = torch.sort(draws.to(torch.int64), dim=1, stable=True)
    values = logprobs.gather(1, order)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    slot = torch.cumsum(first, dim=1) - 1  # the distinct entry each draw belongs to
    counts = torch.zeros_like(slot).scatter_add_(1, slot, torch.ones_like(slot))
    packed_ids = torch.zeros_like(ids).scatter_(1, slot, ids)
    packed_values = torch.zeros_like(values).scatter_(1, slot, values)
    return packed_ids, packed_values, counts, first.sum(dim=1).to(torch.int32)


# -- to the host ------------------------------------------------------------------------------------------

_copy_streams: dict[torch.device, torch.cuda.Stream] = {}
_copy_streams_lock = threading.Lock()  # the worker's unit threads may launch their first copies at once


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per GPU, shared by the threads that launch batches on it."""
    with _copy_streams_lock:
        if device not in _copy_streams:
            _copy_streams[device] = torch.cuda.Stream(device=device)
        return _copy_streams[device]


@dataclass
class HostSelected:
    """A `Selected` on its way to the host: host tensors (pinned on CUDA) and the event after which they
    hold the values (None: they hold them already)."""

    arrays: dict[str, Tensor]
    ready: torch.cuda.Event | None = None

    def samples(
        self, *, sample_ids: list[str], lengths: np.ndarray, input_ids: list[np.ndarray], sparsity: Sparsity
    ) -> SparseSamples:
        """`SparseSamples` of the batch's rows (in row order): waits for the copies first."""
        if self.ready is not None:
            self.ready.synchronize()
        arrays = {name: t.numpy() for name, t in self.arrays.items()}
        ids, codes = arrays["ids"], arrays["codes"].view(np.uint16)
        counts = None
        if "n_entries" in arrays:
            n_entries = arrays["n_entries"].astype(np.int64)
            kept = np.arange(ids.shape[1])[None, :] < n_entries[:, None]
            ids, codes = ids[kept], codes[kept]
            if "counts" in arrays:
                counts = arrays["counts"].view(np.uint16)[kept].astype(np.int64)
        else:
            n_entries = np.full(len(ids), ids.shape[1], dtype=np.int64)
        grid = sparsity.grid
        with np.errstate(over="ignore"):
            tail = np.exp(codec.dequantize(arrays["tail"].view(np.uint16), params=grid))
        return SparseSamples(
            sample_ids=list(sample_ids),
            n_tokens=np.asarray(lengths, dtype=np.int64),
            input_ids=np.concatenate([np.asarray(x, dtype=np.int64) for x in input_ids]),
            n_entries=n_entries,
            entry_ids=ids.reshape(-1).astype(np.int64),
            entry_logprobs=codec.dequantize(codes.reshape(-1), params=grid),
            tail=tail,
            target_logprobs=codec.dequantize(arrays["target"].view(np.uint16), params=grid),
            entry_counts=counts,
        )


def to_host(selected: Selected) -> HostSelected:
    """Start copying `selected` to the host. On CUDA: pinned buffers (PyTorch's caching host allocator
    reuses them), filled by non-blocking copies on the device's copy stream after the kernels queued so
    far on the current stream; the device tensors are marked used by the copy stream, so the allocator
    keeps them until the copies are done."""
    tensors = selected.tensors()
    device = selected.ids.device
    if device.type != "cuda":
        return HostSelected({name: t.cpu() for name, t in tensors.items()})
    stream = _copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    host = {}
    with torch.cuda.stream(stream):
        for name, t in tensors.items():
            host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host[name].copy_(t, non_blocking=True)
            t.record_stream(stream)
        ready = torch.cuda.Event()
        ready.record(stream)
    return HostSelected(host, ready)


def forward_selected(
    forward,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    lengths: np.ndarray,
    sparsity: Sparsity,
    generator: torch.Generator | None,
    keep: Tensor | None = None,
) -> Selected:
    """The teacher's forward pass over a right-padded batch (rows of `lengths` tokens) and the selection of
    its real positions, all on the teacher's device (`teacher.TeacherForward` or a transformers model)."""
    if sparsity.sampled:
        assert sparsity.n is not None and generator is not None, "sampling draws n ids with a seeded generator"
        batch = sampled_forward(
            forward,
            input_ids,
            attention_mask,
            n=sparsity.n,
            generator=generator,
            temperature=sparsity.temperature,
            keep=keep,
        )
    else:
        batch = sparse_topk_forward(
            forward, input_ids, attention_mask, k=sparsity.k, temperature=sparsity.temperature, keep=keep
        )
    positions = torch.from_numpy(real_positions(lengths, batch.ids.shape[1])).to(batch.ids.device)
    return on_device(batch, positions=positions, sparsity=sparsity)


def to_samples(
    batch: SparseBatch, *, sample_ids: list[str], lengths: np.ndarray, input_ids: list[np.ndarray], sparsity: Sparsity
) -> SparseSamples:
    """Rows of a right-padded batch -> `SparseSamples` (padding positions dropped), through the same
    selection in stored types as the torch engine's (`on_device`, `to_host`)."""
    positions = torch.from_numpy(real_positions(lengths, batch.ids.shape[1])).to(batch.ids.device)
    selected = on_device(batch, positions=positions, sparsity=sparsity)
    return to_host(selected).samples(sample_ids=sample_ids, lengths=lengths, input_ids=input_ids, sparsity=sparsity)


def row_samples(sample_id: str, tokens: np.ndarray, row: dict, sparsity) -> SparseSamples:
    """One request's arrays through the torch engine's selection (`to_samples`); the vLLM and server engines' answers, one
    prompt's `[T-1, k]` arrays (`engines/prompt_logprobs.py`), take this path: top-k or top-p."""
    batch = SparseBatch(**{name: torch.from_numpy(array[None]) for name, array in row.items()})
    return to_samples(
        batch, sample_ids=[sample_id], lengths=np.array([len(tokens)]), input_ids=[tokens], sparsity=sparsity
    )
