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
3. Zstd (in Zarr's codec chain, see `store.py`) on top of every array.

Entries come back in code order, not rank order; sort by log-probability if you need ranks.
Encode and decode are vectorised numpy plus one numba kernel; nothing loops per token in Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numba
import numpy as np

from logitstore.samples import SparseSamples, _offsets

CODEC_NAME = "logitstore.sparse"
CODEC_VERSION = 1
Q_MAX = np.iinfo(np.uint16).max  # the code reserved for minus infinity


@dataclass(frozen=True)
class CodecParams:
    fine_step: float = 0.05  # nats per step for log-probabilities >= coarse_below
    coarse_step: float = 0.5  # nats per step below it
    coarse_below: float = -5.0
    id_order: str = "frequency"  # "frequency" or "identity"

    def __post_init__(self) -> None:
        if not (0 < self.fine_step <= self.coarse_step <= 4):
            raise ValueError(f"need 0 < fine_step <= coarse_step <= 4 nats, got {self.fine_step}, {self.coarse_step}")
        if self.coarse_below > 0 or abs(self.fine_levels * self.fine_step + self.coarse_below) > 1e-9:
            raise ValueError(f"coarse_below must be <= 0 and a multiple of fine_step, got {self.coarse_below}")
        if self.id_order not in ("frequency", "identity"):
            raise ValueError(f"id_order must be 'frequency' or 'identity', got {self.id_order!r}")

    @property
    def fine_levels(self) -> int:
        return round(-self.coarse_below / self.fine_step)

    @property
    def floor(self) -> float:
        """The lowest finite log-probability the grid holds; anything lower (but finite) is stored as it."""
        return self.coarse_below - (Q_MAX - 1 - self.fine_levels) * self.coarse_step

    @property
    def error_bound(self) -> float:
        """Largest absolute error, in nats, of any decoded log-probability (and of the log of the tail)."""
        return self.coarse_step / 2

    @property
    def error_bound_fine(self) -> float:
        """Largest absolute error for log-probabilities >= `coarse_below`."""
        return self.fine_step / 2

    def to_json(self) -> dict:
        bounds = {"error_bound": self.error_bound, "error_bound_fine": self.error_bound_fine}
        return {"name": CODEC_NAME, "version": CODEC_VERSION, **bounds, **asdict(self)}

    @classmethod
    def from_json(cls, meta: dict) -> CodecParams:
        if meta.get("name") != CODEC_NAME or meta.get("version", 0) > CODEC_VERSION:
            from logitstore.errors import IncompatibleStoreError

            raise IncompatibleStoreError(
                f"codec {meta.get('name')} v{meta.get('version')} is not readable by this logitstore "
                f"({CODEC_NAME} v{CODEC_VERSION}); upgrade logitstore"
            )
        fields = ("fine_step", "coarse_step", "coarse_below", "id_order")
        return cls(**{k: meta[k] for k in fields})


# Named value grids, measured against each other by benchmarks/frontier.py. "fine" is finer than fp16
# for every log-probability below -1 nat (0.001-nat bound to -131 nats); "coarse" halves the grid's
# entropy (0.05 / 0.5-nat bounds).
GRIDS = {
    "default": CodecParams(),
    "fine": CodecParams(fine_step=0.002, coarse_step=0.002, coarse_below=-60.0),
    "coarse": CodecParams(fine_step=0.1, coarse_step=1.0, coarse_below=-5.0),
}


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
    x = np.maximum(-np.asarray(logprobs, dtype=np.float64), 0)  # nats below certainty; -inf -> +inf
    split = -params.coarse_below
    with np.errstate(invalid="ignore"):
        q = np.where(
            x <= split,
            np.rint(x / params.fine_step),
            params.fine_levels + np.rint((x - split) / params.coarse_step),
        )
    # Finite values past the grid's floor take its last finite code; only minus infinity gets Q_MAX.
    return np.where(np.isinf(x), Q_MAX, np.minimum(np.nan_to_num(q, posinf=Q_MAX - 1), Q_MAX - 1)).astype(np.uint16)


def dequantize(q: np.ndarray, *, params: CodecParams) -> np.ndarray:
    q64 = q.astype(np.float64)
    x = np.where(
        q64 <= params.fine_levels,
        q64 * params.fine_step,
        -params.coarse_below + (q64 - params.fine_levels) * params.coarse_step,
    )
    out = (-x).astype(np.float32)
    out[q == Q_MAX] = -np.inf
    return out


def encode(samples: SparseSamples, *, params: CodecParams, code_of_id: np.ndarray, vocab_size: int) -> EncodedSamples:
    """`samples` must already be validated. `code_of_id` maps token id -> stored code (a permutation)."""
    dtype = id_dtype(vocab_size)
    codes = code_of_id[samples.entry_ids]
    order, deltas = _sort_and_delta(codes, samples.entry_offsets)
    counts = None if samples.entry_counts is None else samples.entry_counts[order].astype(np.uint16)
    return EncodedSamples(
        input_ids=samples.input_ids.astype(dtype),
        n_entries=samples.n_entries.astype(np.uint16),
        entry_codes=deltas.astype(dtype),
        entry_logprobs=quantize(samples.entry_logprobs[order], params=params),
        tail=quantize(_log_mass(samples.tail), params=params),
        target_logprobs=quantize(samples.target_logprobs, params=params),
        entry_counts=counts,
    )


def decode(enc: EncodedSamples, *, params: CodecParams, id_of_code: np.ndarray, n_tokens: np.ndarray) -> SparseSamples:
    """Inverse of `encode` (up to the quantization bound). Sample ids are left empty for the caller."""
    n_entries = enc.n_entries.astype(np.int64)
    entry_ids = undelta_codes_to_ids(enc.entry_codes, _offsets(n_entries), id_of_code)
    with np.errstate(over="ignore"):
        tail = np.exp(dequantize(enc.tail, params=params))
    return SparseSamples(
        sample_ids=[],
        n_tokens=np.asarray(n_tokens, dtype=np.int64),
        input_ids=enc.input_ids.astype(np.int64),
        n_entries=n_entries,
        entry_ids=entry_ids,
        entry_logprobs=dequantize(enc.entry_logprobs, params=params),
        tail=tail,
        target_logprobs=dequantize(enc.target_logprobs, params=params),
        entry_counts=None if enc.entry_counts is None else enc.entry_counts.astype(np.int64),
    )


@numba.njit(cache=True, nogil=True)
def _sort_and_delta_kernel(codes, offsets, order, deltas):
    # Per position: order entries by code, first code absolute, the rest as gaps. A numpy version
    # needs a global argsort over (position, code) keys, 2.5x slower at 64 entries per position.
    for p in range(len(offsets) - 1):
        start, stop = offsets[p], offsets[p + 1]
        local = np.argsort(codes[start:stop], kind="mergesort")
        previous = 0
        for j in range(stop - start):
            e = start + local[j]
            order[start + j] = e
            deltas[start + j] = codes[e] - previous
            previous = codes[e]


def _sort_and_delta(codes: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(entry order by code within each position, delta-coded codes in that order)."""
    order = np.empty(len(codes), dtype=np.int64)
    deltas = np.empty(len(codes), dtype=np.int64)
    if len(codes):
        _sort_and_delta_kernel(codes.astype(np.int64), offsets, order, deltas)
    return order, deltas


@numba.njit(cache=True, nogil=True)
def _undelta_kernel(deltas, offsets, id_of_code, out):
    # One pass: running sum within each position, then code -> id. Numpy needs four passes for this.
    for p in range(len(offsets) - 1):
        code = 0
        for e in range(offsets[p], offsets[p + 1]):
            code += deltas[e]
            out[e] = id_of_code[code]


def undelta_codes_to_ids(deltas: np.ndarray, offsets: np.ndarray, id_of_code: np.ndarray) -> np.ndarray:
    out = np.empty(len(deltas), dtype=np.int32)
    if len(deltas):
        _undelta_kernel(deltas, offsets, id_of_code.astype(np.int32), out)
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
