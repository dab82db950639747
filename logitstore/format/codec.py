"""The sparse codec: how `SparseSamples` become small integer arrays, and back.

Three transforms, each chosen by measurement on the default teacher (`benchmarks/codec.py`):

1. Entry ids are stored losslessly as *codes*: ids renumbered by frequency (most frequent token first,
   so the ids a teacher ranks highly get small numbers), sorted ascending within each position and
   delta-coded. The gaps are small and zstd squeezes them; ids are ~80% of the bytes in published codecs.
2. Log-probabilities (entries, target, and the tail as log-mass) are quantized to a uint16 code on a
   two-slope grid: steps of `fine_step` nats down to `coarse_below`, then steps of `coarse_step`.
   The absolute error is at most `fine_step / 2` for log-probabilities >= `coarse_below` (where the
   loss gradient lives: p >= 0.0067 with the defaults) and at most `coarse_step / 2` below it.
   Code 65535 means minus infinity (a tail of exactly zero). On the default teacher the coarse slope
   stores 93.6 bytes/token at 64 entries where a uniform 0.1-nat grid
   needs 108.0 (benchmarks/codec.py).
   Values are stored in id order: pairing ids with values costs ~37 bytes/position whichever of the
   two is stored in sorted order, and sorted ids are the cheaper half.
3. Zstd (in Zarr's codec chain, `layout.array_kwargs`) on top of every array.

Entries come back in code order, not rank order; sort by log-probability if you need ranks.
Encode and decode are vectorised numpy plus numba kernels; nothing loops per token in Python.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numba
import numpy as np

from logitstore.errors import InvalidSampleError
from logitstore.format.grid import Q_MAX, CodecParams
from logitstore.format.samples import SparseSamples, row_offsets


@dataclass
class EncodedSamples:
    """Integer arrays exactly as stored in Zarr (before zstd)."""

    input_ids: np.ndarray  # uint16/uint32
    n_entries: np.ndarray  # uint16
    entry_codes: np.ndarray  # uint16/uint32 delta-coded codes
    entry_logprobs: np.ndarray  # uint16 quantized
    tail: np.ndarray  # uint16 quantized log of the tail mass
    target_logprobs: np.ndarray  # uint16 quantized
    entry_counts: np.ndarray | None = None  # uint16
    loss_mask: np.ndarray | None = None  # uint8 per token, chat data only

    def arrays(self) -> dict[str, np.ndarray]:
        out = {k: v for k, v in self.__dict__.items() if v is not None}
        return out


def id_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def frequency_id_order(ids: np.ndarray, *, vocab_size: int) -> np.ndarray:
    """Code of each id: its rank by count in `ids` (most frequent first, ties and unseen ids by id)."""
    counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    by_frequency = np.lexsort((np.arange(vocab_size), -counts))  # ids, most frequent first
    code_of_id = np.empty(vocab_size, dtype=np.uint32)
    code_of_id[by_frequency] = np.arange(vocab_size, dtype=np.uint32)
    return code_of_id


def quantize(logprobs: np.ndarray, *, params: CodecParams) -> np.ndarray:
    out = np.empty(np.shape(logprobs), dtype=np.uint16)
    if out.size:
        _quantize_kernel(np.ascontiguousarray(logprobs).reshape(-1), out.reshape(-1), *_grid(params))
    return out


def _grid(params: CodecParams) -> tuple[float, float, float, float]:
    """(fine_step, coarse_step, nats where the coarse slope starts, fine_levels) as the kernels take them."""
    return params.fine_step, params.coarse_step, -params.coarse_below, float(params.fine_levels)


@numba.njit(cache=True, nogil=True, inline="always")
def _quantize_one(value, fine_step, coarse_step, split, fine_levels):
    # The two-slope grid in float64, element by element: one pass where numpy's np.where takes eight
    # (~2 ms for 1M top-64 entries against 18 ms). Same arithmetic, so the same codes:
    # nats below certainty (a hair above 0 rounds to 0), minus infinity -> Q_MAX, NaN -> 0, and
    # finite values past the grid's floor take its last finite code.
    x = -np.float64(value)
    if x != x:
        return np.uint16(0)
    if x < 0.0:
        x = 0.0
    if x == np.inf:
        return np.uint16(Q_MAX)
    if x <= split:
        q = np.rint(x / fine_step)
    else:
        q = fine_levels + np.rint((x - split) / coarse_step)
    if q >= Q_MAX - 1:
        return np.uint16(Q_MAX - 1)
    return np.uint16(q)


@numba.njit(cache=True, nogil=True)
def _quantize_kernel(values, out, fine_step, coarse_step, split, fine_levels):
    for i in range(len(values)):
        out[i] = _quantize_one(values[i], fine_step, coarse_step, split, fine_levels)


def dequantize(q: np.ndarray, *, params: CodecParams) -> np.ndarray:
    # One gather from the grid's table of all 2**16 values: 4-5x faster than the arithmetic per call.
    return _dequantize_table(params)[q]


@functools.lru_cache(maxsize=16)
def _dequantize_table(params: CodecParams) -> np.ndarray:
    q64 = np.arange(Q_MAX + 1, dtype=np.float64)
    x = np.where(
        q64 <= params.fine_levels,
        q64 * params.fine_step,
        -params.coarse_below + (q64 - params.fine_levels) * params.coarse_step,
    )
    table = (-x).astype(np.float32)
    table[Q_MAX] = -np.inf
    table.flags.writeable = False
    return table


def encode(samples: SparseSamples, *, params: CodecParams, code_of_id: np.ndarray, vocab_size: int) -> EncodedSamples:
    """`samples` must already be validated (ids in range; `validate(..., duplicates=False)` is enough:
    a token id twice among one position's entries raises `InvalidSampleError` here, where the sort by
    code finds it for free). `code_of_id` maps token id -> stored code (a permutation)."""
    dtype = id_dtype(vocab_size)
    n = len(samples.entry_ids)
    deltas = np.empty(n, dtype=dtype)
    logprobs = np.empty(n, dtype=np.uint16)
    counts = None if samples.entry_counts is None else np.empty(n, dtype=np.uint16)
    if n:
        keys = np.empty(n, dtype=np.int64)
        no_counts = np.zeros(0, dtype=np.int64)
        duplicate = _encode_entries_kernel(
            np.asarray(samples.entry_ids),
            np.asarray(code_of_id),
            samples.entry_offsets,
            np.asarray(samples.entry_logprobs),
            no_counts if counts is None else np.asarray(samples.entry_counts),
            keys,
            deltas,
            logprobs,
            no_counts.astype(np.uint16) if counts is None else counts,
            *_grid(params),
        )
        if duplicate >= 0:
            _duplicate_error(samples, duplicate)
    return EncodedSamples(
        input_ids=samples.input_ids.astype(dtype),
        n_entries=samples.n_entries.astype(np.uint16),
        entry_codes=deltas,
        entry_logprobs=logprobs,
        tail=quantize(_log_mass(samples.tail), params=params),
        target_logprobs=quantize(samples.target_logprobs, params=params),
        entry_counts=counts,
        loss_mask=None if samples.loss_mask is None else samples.loss_mask.astype(np.uint8),
    )


def _duplicate_error(samples: SparseSamples, entry: int) -> None:
    position = int(np.searchsorted(samples.entry_offsets, entry, side="right")) - 1
    start, stop = samples.entry_offsets[position], samples.entry_offsets[position + 1]
    ids = np.sort(np.asarray(samples.entry_ids[start:stop]))
    token = int(ids[1:][np.diff(ids) == 0][0])
    raise InvalidSampleError(f"token id {token} appears twice among the entries of position {position}")


def decode(enc: EncodedSamples, *, params: CodecParams, id_of_code: np.ndarray, n_tokens: np.ndarray) -> SparseSamples:
    """Inverse of `encode` (up to the quantization bound). Sample ids are left empty for the caller."""
    n_entries = enc.n_entries.astype(np.int64)
    entry_ids, entry_logprobs = decode_entries(
        enc.entry_codes, enc.entry_logprobs, row_offsets(n_entries), id_of_code=id_of_code, params=params
    )
    with np.errstate(over="ignore"):
        tail = np.exp(dequantize(enc.tail, params=params))
    return SparseSamples(
        sample_ids=[],
        n_tokens=np.asarray(n_tokens, dtype=np.int64),
        input_ids=enc.input_ids.astype(np.int64),
        n_entries=n_entries,
        entry_ids=entry_ids,
        entry_logprobs=entry_logprobs,
        tail=tail,
        target_logprobs=dequantize(enc.target_logprobs, params=params),
        entry_counts=None if enc.entry_counts is None else enc.entry_counts.astype(np.int64),
        loss_mask=enc.loss_mask,
    )


# Positions with at most this many entries are sorted by counting each key's rank (how many of the
# position's keys are smaller), a branch-free inner loop the compiler vectorises: at top-64, 6 ms per
# 1M entries where insertion sort took 19 ms (its mispredicted branches) and numba's quicksort 40 ms;
# still 2x ahead of both at 256 entries. Longer positions take the quicksort.
_RANK_SORT_MAX = 256


@numba.njit(cache=True, nogil=True)
def _encode_entries_kernel(
    entry_ids,
    code_of_id,
    offsets,
    logprobs,
    counts,
    keys,
    deltas,
    q_out,
    counts_out,
    fine_step,
    coarse_step,
    split,
    fine_levels,
):
    # Per position, one pass: codes, ordered by code, first code absolute and the rest as gaps, the
    # log-probabilities (quantized) and counts in that order. Sorting keys of (code << 32 | entry)
    # sorts by code, then by input order among equal codes, so the order is that of a stable sort.
    # A zero gap after the first entry is a duplicate token id: returns the first such entry, or -1.
    # One kernel where numpy needs a gather, a global argsort and copies per array.
    duplicate = -1
    low = np.int64(0xFFFFFFFF)
    unsorted = np.empty(_RANK_SORT_MAX, dtype=np.int64)  # signed: codes < 2**31, and signed compares vectorise better
    for p in range(len(offsets) - 1):
        start, stop = offsets[p], offsets[p + 1]
        n = stop - start
        if n <= _RANK_SORT_MAX:
            for j in range(n):
                unsorted[j] = (np.int64(code_of_id[entry_ids[start + j]]) << 32) | j
            for i in range(n):  # keys are distinct (their low half is the entry): ranks are a permutation
                key = unsorted[i]
                rank = 0
                for j in range(n):
                    rank += unsorted[j] < key
                keys[start + rank] = key
        else:
            for j in range(n):
                keys[start + j] = (np.int64(code_of_id[entry_ids[start + j]]) << 32) | j
            keys[start:stop].sort()
        previous = np.int64(0)
        for j in range(n):
            key = keys[start + j]
            code = key >> 32
            e = start + (key & low)
            if j > 0 and code == previous and duplicate < 0:
                duplicate = start + j
            deltas[start + j] = code - previous
            previous = code
            q_out[start + j] = _quantize_one(logprobs[e], fine_step, coarse_step, split, fine_levels)
            if len(counts_out):
                counts_out[start + j] = counts[e]
    return duplicate


@numba.njit(cache=True, nogil=True)
def _undelta_kernel(deltas, offsets, id_of_code, out):
    # One pass: running sum within each position, then code -> id. Numpy needs four passes for this.
    for p in range(len(offsets) - 1):
        code = 0
        for e in range(offsets[p], offsets[p + 1]):
            code += deltas[e]
            out[e] = id_of_code[code]


@numba.njit(cache=True, nogil=True)
def _decode_entries_kernel(deltas, codes, offsets, id_of_code, table, ids_out, logprobs_out):
    # The entries' two arrays without the GIL, so the stream's reader threads keep decompressing
    # while a batch decodes: a top-64 batch's 1M entries in ~3 ms, where the numpy passes (undelta,
    # table gather, int64 copy) take ~8 ms holding the GIL for most of it. Two loops, not one: fused,
    # the loop runs 2x slower (6.9 ms), and a signed running sum costs another 20%.
    for p in range(len(offsets) - 1):
        code = np.uint64(0)
        for e in range(offsets[p], offsets[p + 1]):
            code += np.uint64(deltas[e])
            ids_out[e] = id_of_code[code]
    for e in range(len(codes)):
        logprobs_out[e] = table[codes[e]]


def decode_entries(
    deltas: np.ndarray, codes: np.ndarray, offsets: np.ndarray, *, id_of_code: np.ndarray, params: CodecParams
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64, log-probabilities float32) of encoded entries: gaps of codes per position (the
    positions' `offsets`) and quantized log-probabilities. int64 is what the loss indexes with."""
    ids = np.empty(len(deltas), dtype=np.int64)
    logprobs = np.empty(len(deltas), dtype=np.float32)
    if len(deltas):
        _decode_entries_kernel(deltas, codes, offsets, id_of_code, _dequantize_table(params), ids, logprobs)
    return ids, logprobs


def undelta_codes_to_ids(deltas: np.ndarray, offsets: np.ndarray, id_of_code: np.ndarray) -> np.ndarray:
    out = np.empty(len(deltas), dtype=np.int32)
    if len(deltas):
        _undelta_kernel(deltas, offsets, id_of_code.astype(np.int32, copy=False), out)
    return out


def invert_permutation(code_of_id: np.ndarray) -> np.ndarray:
    id_of_code = np.empty_like(code_of_id)
    id_of_code[code_of_id] = np.arange(len(code_of_id), dtype=code_of_id.dtype)
    return id_of_code


def identity_order(vocab_size: int) -> np.ndarray:
    return np.arange(vocab_size, dtype=np.uint32)


def _log_mass(mass: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(np.clip(mass, 0, 1).astype(np.float64))
