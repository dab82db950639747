"""vLLM's `prompt_logprobs` JSON read straight into flat arrays: one compiled pass over the response's bytes,
no Python object per position or entry.

A `/v1/completions` answer holds, per prompt token, `null` (the first) or an object keyed by token id:

    "prompt_logprobs": [null, {"1234": {"logprob": -0.51, "rank": 1, "decoded_token": "the"}, ...}, ...]

orjson (or json) would make a dict per entry and a dict, a float, an int and a string inside it: at top-64
that is ~300 objects per position, which caps a client near 50k tokens/s before any conversion. The kernel
below reads only what the store needs (the id, `logprob`, `rank`), skips every other value (strings with
their escapes included), and refuses anything that is not this shape. The rest of the answer (a few hundred
bytes: `model`, `usage`, ...) is never looked at. vLLM's own entries (compact, in its field order) take the
fast path of `compact_entry`, eight bytes at a time; this module's byte-at-a-time reader takes the rest.

Numbers (here): the mantissa's digits and the decimal exponent, then one multiplication or division by a power of
ten in float64; exact wherever the mantissa has at most 15 digits, else within an ulp of float64. vLLM's
values are float32s written in full (`tolist()`), and they are kept as float32: far from a float32's
rounding boundary, so equal to the value the server had.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from logitstore.pipelines.engines.prompt_logprobs import ID_PAST_RANGE
from logitstore.pipelines.engines.server.compact_entry import compact_entry

KEY = b'"prompt_logprobs"'
MISSING_RANK = -1  # an entry whose `rank` is absent or null


class MalformedResponse(ValueError):
    """The answer is not a vLLM completion with prompt log-probabilities; the message says where."""


@dataclass(frozen=True)
class FlatPromptLogprobs:
    """One prompt's `prompt_logprobs`, flat: position p's entries are `ids[starts[p]:starts[p + 1]]`. Position
    0 is vLLM's `null` (nothing predicts the first token) and holds no entries; `null_at` lists every null."""

    starts: np.ndarray  # int64 [positions + 1]
    ids: np.ndarray  # int64 [entries]
    logprobs: np.ndarray  # float32 [entries]
    ranks: np.ndarray  # int64 [entries], MISSING_RANK where absent
    null_at: np.ndarray  # int64: positions that were null

    @property
    def positions(self) -> int:
        return len(self.starts) - 1


def parse_prompt_logprobs(body: bytes) -> FlatPromptLogprobs:
    """The first choice's `prompt_logprobs` of a `/v1/completions` answer (one prompt per request)."""
    at = body.find(KEY)
    if at < 0:
        raise MalformedResponse("no prompt_logprobs in the answer")
    data = np.frombuffer(body, dtype=np.uint8)
    bound = len(body) // 16 + 1  # an entry takes at least 26 bytes: '"1":{"logprob":0,"rank":1}'
    starts = np.empty(len(body) // 4 + 2, dtype=np.int64)  # a position takes at least 4 bytes ("null" or "{},")
    ids = np.empty(bound, dtype=np.int64)
    logprobs = np.empty(bound, dtype=np.float32)
    ranks = np.empty(bound, dtype=np.int64)
    nulls = np.empty(len(body) // 4 + 1, dtype=np.int64)
    status, n_positions, n_entries, n_nulls = _scan(data, at + len(KEY), starts, ids, logprobs, ranks, nulls)
    if status < 0:
        raise MalformedResponse(f"malformed prompt_logprobs at byte {-status - 1} of {len(body)}")
    return FlatPromptLogprobs(
        starts=starts[: n_positions + 1].copy(),
        ids=ids[:n_entries].copy(),
        logprobs=logprobs[:n_entries].copy(),
        ranks=ranks[:n_entries].copy(),
        null_at=nulls[:n_nulls].copy(),
    )


# -- the kernel: positions are returned negative (-(byte + 1)) where the bytes break the shape ---------------

_LOGPROB = np.frombuffer(b"logprob", dtype=np.uint8)
_RANK = np.frombuffer(b"rank", dtype=np.uint8)
_NULL = np.frombuffer(b"null", dtype=np.uint8)
_POW10 = np.array([10.0**e for e in range(23)])
_MANTISSA_FULL = 10**17


@numba.njit(cache=True, nogil=True)
def _ws(data, i):
    n = len(data)
    while i < n and (data[i] == 32 or data[i] == 10 or data[i] == 13 or data[i] == 9):
        i += 1
    return i


@numba.njit(cache=True, nogil=True)
def _expect(data, i, byte):
    i = _ws(data, i)
    if i >= len(data) or data[i] != byte:
        return -(i + 1)
    return i + 1


@numba.njit(cache=True, nogil=True)
def _at(data, i, word):
    """Whether `word`'s bytes are at i."""
    if i < 0 or i + len(word) > len(data):
        return False
    for j in range(len(word)):
        if data[i + j] != word[j]:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _word(data, i, word):
    return i + len(word) if _at(data, i, word) else -(i + 1)


@numba.njit(cache=True, nogil=True)
def _skip_string(data, i):
    # at the opening quote; returns past the closing one
    n = len(data)
    i += 1
    while i < n:
        c = data[i]
        if c == 92:  # backslash: the next byte is escaped (\uXXXX's digits are plain bytes)
            i += 2
        elif c == 34:
            return i + 1
        else:
            i += 1
    return -(n + 1)


@numba.njit(cache=True, nogil=True)
def _digits(data, i, mantissa, exponent, shift):
    """(next byte, mantissa, exponent) past the digits at i: 18 significant ones at most (a mantissa below
    10**17 takes one more: a bound on the value, not a count per digit, keeps the loop to one multiply-add).
    Each digit taken moves the exponent by `shift` (0 before the point, -1 after), each dropped by one more."""
    while i < len(data):
        d = np.int64(data[i]) - 48
        if d < 0 or d > 9:
            break
        if mantissa < _MANTISSA_FULL:
            mantissa = mantissa * 10 + d
            exponent += shift
        else:
            exponent += shift + 1
        i += 1
    return i, mantissa, exponent


@numba.njit(cache=True, nogil=True)
def _number(data, i):
    """(value, next byte) of a JSON number, or -Infinity/Infinity/NaN as Python's json writes them."""
    n = len(data)
    sign = 1.0
    if i < n and data[i] == 45:  # -
        sign = -1.0
        i += 1
    if i < n and data[i] == 73:  # Infinity
        j = i + 8
        return (sign * np.inf, j) if j <= n else (0.0, -(i + 1))
    if i < n and data[i] == 78:  # NaN
        return (np.nan, i + 3) if i + 3 <= n else (0.0, -(i + 1))
    start = i
    i, mantissa, exponent = _digits(data, i, 0, 0, 0)
    if i < n and data[i] == 46:  # .
        i, mantissa, exponent = _digits(data, i + 1, mantissa, exponent, -1)
    if i == start:
        return 0.0, -(i + 1)
    if i < n and (data[i] == 101 or data[i] == 69):  # e E
        i += 1
        esign = 1
        if i < n and (data[i] == 45 or data[i] == 43):
            esign = -1 if data[i] == 45 else 1
            i += 1
        e = 0
        while i < n and 48 <= data[i] <= 57:
            e = e * 10 + (data[i] - 48)
            i += 1
        exponent += esign * e
    value = float(mantissa)
    if -22 <= exponent < 0:  # powers of ten to 1e22 are exact doubles: one rounding
        value = value / _POW10[-exponent]
    elif 0 < exponent <= 22:
        value = value * _POW10[exponent]
    elif exponent != 0:
        value = (
            value * 10.0**exponent
            if exponent > 0
            else value / 10.0**308 / 10.0 ** (-exponent - 308)
            if exponent < -308
            else value / 10.0 ** (-exponent)
        )
    return sign * value, i


@numba.njit(cache=True, nogil=True)
def _skip_value(data, i):
    i = _ws(data, i)
    if i >= len(data):
        return -(i + 1)
    c = data[i]
    if c == 34:
        return _skip_string(data, i)
    if c == 110:  # null
        return _word(data, i, _NULL)
    if c == 116:  # true
        return i + 4
    if c == 102:  # false
        return i + 5
    value, j = _number(data, i)
    return j


@numba.njit(cache=True, nogil=True)
def _key_is(data, start, end, word):
    return end - start == len(word) and _at(data, start, word)


@numba.njit(cache=True, nogil=True)
def _entry(data, i, ids, logprobs, ranks, e):
    """One `"id": {...}` at byte i (past whitespace); returns the next byte."""
    if data[i] != 34:
        return -(i + 1)
    i += 1
    token = 0
    digits = 0
    while i < len(data) and 48 <= data[i] <= 57:
        # an id of 2**62 or more is read as ID_PAST_RANGE, which the vocabulary check refuses: int64 would wrap
        token = ID_PAST_RANGE if token >= ID_PAST_RANGE // 10 else token * 10 + (np.int64(data[i]) - 48)
        digits += 1
        i += 1
    if digits == 0 or i >= len(data) or data[i] != 34:
        return -(i + 1)
    i = _expect(data, i + 1, 58)  # :
    if i < 0:
        return i
    i = _expect(data, i, 123)  # {
    if i < 0:
        return i
    ids[e] = token
    logprobs[e] = np.nan
    ranks[e] = MISSING_RANK
    have_logprob = False
    i = _ws(data, i)
    if i < len(data) and data[i] == 125:
        return -(i + 1)  # an entry without its logprob
    while True:
        i = _ws(data, i)
        if i >= len(data) or data[i] != 34:
            return -(i + 1)
        key_start = i + 1
        i = _skip_string(data, i)
        if i < 0:
            return i
        key_end = i - 1
        i = _expect(data, i, 58)
        if i < 0:
            return i
        i = _ws(data, i)
        if _key_is(data, key_start, key_end, _LOGPROB):
            value, i = _number(data, i)
            logprobs[e] = value
            have_logprob = True
        elif _key_is(data, key_start, key_end, _RANK) and i < len(data) and data[i] != 110:
            value, i = _number(data, i)
            ranks[e] = int(value)
        else:
            i = _skip_value(data, i)
        if i < 0:
            return i
        i = _ws(data, i)
        if i < len(data) and data[i] == 44:
            i += 1
            continue
        if i < len(data) and data[i] == 125:
            return i + 1 if have_logprob else -(i + 1)
        return -(i + 1)


@numba.njit(cache=True, nogil=True)
def _scan(data, i, starts, ids, logprobs, ranks, nulls):
    """(status, positions, entries, nulls): status 0, or -(byte + 1) where the shape breaks."""
    i = _expect(data, i, 58)  # :
    if i < 0:
        return i, 0, 0, 0
    i = _expect(data, i, 91)  # [
    if i < 0:
        return i, 0, 0, 0
    p = 0
    e = 0
    n_nulls = 0
    starts[0] = 0
    i = _ws(data, i)
    if i < len(data) and data[i] == 93:
        return 0, 0, 0, 0
    while True:
        i = _ws(data, i)
        if i >= len(data):
            return -(i + 1), 0, 0, 0
        if data[i] == 110:
            i = _word(data, i, _NULL)
            if i < 0:
                return i, 0, 0, 0
            nulls[n_nulls] = p
            n_nulls += 1
        elif data[i] == 123:
            i = _ws(data, i + 1)
            if i < len(data) and data[i] == 125:
                i += 1
            else:
                while True:
                    if e >= len(ids):
                        return -(i + 1), 0, 0, 0
                    j = compact_entry(data, i, ids, logprobs, ranks, e)  # vLLM's own, 8 bytes at a time
                    i = j if j >= 0 else _entry(data, i, ids, logprobs, ranks, e)
                    if i < 0:
                        return i, 0, 0, 0
                    e += 1
                    i = _ws(data, i)
                    if i < len(data) and data[i] == 44:
                        i = _ws(data, i + 1)
                        continue
                    if i < len(data) and data[i] == 125:
                        i += 1
                        break
                    return -(i + 1), 0, 0, 0
        else:
            return -(i + 1), 0, 0, 0
        p += 1
        starts[p] = e
        i = _ws(data, i)
        if i < len(data) and data[i] == 44:
            i += 1
            continue
        if i < len(data) and data[i] == 93:
            return 0, p, e, n_nulls
        return -(i + 1), 0, 0, 0
