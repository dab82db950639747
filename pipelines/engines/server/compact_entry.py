"""vLLM's own `prompt_logprobs` entry, read eight bytes at a time: the fast path of `served_json`'s scanner.

vLLM writes every entry alike, compact and in one field order:

    "87175":{"logprob":-1.5223147869110107,"rank":1,"decoded_token":"Ġdistillation"}

A byte-at-a-time reader pays a mispredicted branch at the end of every run of digits and of every string
(five or six per entry): at top-64 that was ~165 ns per entry, 10.8 ms per 1,024-token answer of 4.8 MB. Here
a run of up to eight digits is found and converted in one 64-bit word (the SWAR steps of fast_float:
Lemire, "Number parsing at a gigabyte per second", 2021), the fixed keys are compared as whole words, and a
string's end is found eight bytes at a time: 2.8x faster on the benchmark's answers (`benchmarks/server.py`,
docs/benchmarks.md). Anything else (spacing, another field order, an exponent, an id or rank of 8+ digits,
a field that is not there, the last 64 bytes of the answer) returns -1 and the general reader reads the entry.

Numbers: the first 18 digits are kept (the rest only move the exponent), then one division by a power of
ten in float64, stored as float32. vLLM's values are float32s written in full: 18 digits are ~11 more than a
float32 needs, so the float32 is the one the server had. Little-endian machines only (`FAST`); elsewhere
the general reader reads everything.
"""

from __future__ import annotations

import sys

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

FAST = sys.byteorder == "little"
# the longest span the path reads before it looks at the bounds again: where less is left it does not start
REACH = 64

U = np.uint64
_ZEROS = U(0x3030303030303030)  # '0' in every byte
_SIXES = U(0x4646464646464646)
_HIGH = U(0x8080808080808080)
_ONES = U(0x0101010101010101)
_QUOTES = U(0x2222222222222222)
_BACKSLASHES = U(0x5C5C5C5C5C5C5C5C)
_PAIRS = U(0x000000FF000000FF)
_MUL1 = U(0x000F424000000064)  # 100 + (1_000_000 << 32)
_MUL2 = U(0x0000271000000001)  # 1 + (10_000 << 32)
_POW10_INT = np.array([10**e for e in range(19)], dtype=np.int64)
_POW10 = np.array([10.0**e for e in range(19)])
KEPT_DIGITS = 18  # below 2**63 with any digits


def _word(text: bytes) -> np.uint64:
    return U(int.from_bytes(text.ljust(8, b"\0"), "little"))


_OPEN = b'":{"logprob":'  # from the id's closing quote
_OPEN_1, _OPEN_2, _OPEN_2_MASK = _word(_OPEN[:8]), _word(_OPEN[8:]), U((1 << (8 * (len(_OPEN) - 8))) - 1)
_RANK = _word(b',"rank":')
_DECODED = b',"decoded_token":"'
_DECODED_1, _DECODED_2 = _word(_DECODED[:8]), _word(_DECODED[8:16])
_DECODED_COLON, _DECODED_QUOTE = _DECODED[16], _DECODED[17]


@intrinsic
def _load8(typingctx, data, at):
    """The 8 bytes at `at` as one little-endian word (an unaligned load)."""
    signature = types.uint64(data, types.intp)

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        pointer = builder.bitcast(builder.gep(array.data, [args[1]]), ir.IntType(64).as_pointer())
        return builder.load(pointer, align=1)

    return signature, codegen


@intrinsic
def _trailing_zeros(typingctx, word):
    signature = types.uint64(types.uint64)

    def codegen(context, builder, sig, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return signature, codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _digits8(data, i):
    """(count, value) of the run of digits at i, up to 8. The first byte that is no digit is flagged exactly
    (a carry or borrow only reaches the bytes after it)."""
    word = _load8(data, i)
    flags = ((word + _SIXES) | (word - _ZEROS)) & _HIGH
    count = _trailing_zeros(flags) >> U(3) if flags else U(8)
    if count == 0:
        return 0, np.int64(0)
    word = word - _ZEROS
    if count < 8:  # the digits to the top, zero digits below them
        word = word << (U(64) - count * U(8))
    word = word * U(10) + (word >> U(8))  # pairs, then fours, then the eight
    word = (((word & _PAIRS) * _MUL1) + (((word >> U(16)) & _PAIRS) * _MUL2)) >> U(32)
    return np.int64(count), np.int64(word & U(0xFFFFFFFF))


@numba.njit(cache=True, nogil=True, inline="always")
def _has_byte(word, pattern):
    zero = word ^ pattern
    return (zero - _ONES) & ~zero & _HIGH


@numba.njit(cache=True, nogil=True)
def compact_entry(data, i, ids, logprobs, ranks, e):
    """Entry `e` at byte i (its id's opening quote): the byte after its closing brace, or -1 where it is not
    vLLM's compact entry (nothing written then but ids[e])."""
    n = len(data)
    if not FAST or i + REACH > n:
        return -1
    count, value = _digits8(data, i + 1)
    if count == 0 or count == 8 or data[i + 1 + count] != 34:
        return -1
    ids[e] = value
    i += 1 + count
    if _load8(data, i) != _OPEN_1 or (_load8(data, i + 8) & _OPEN_2_MASK) != _OPEN_2:
        return -1
    i += len(_OPEN)
    sign = 1.0
    if data[i] == 45:  # -
        sign = -1.0
        i += 1
    count, mantissa = _digits8(data, i)
    if count == 0 or count == 8:
        return -1
    i += count
    kept, exponent = count, 0
    if data[i] == 46:  # .
        i += 1
        count = 8
        first = True
        while count == 8:
            if i + 8 > n:
                return -1
            count, value = _digits8(data, i)
            if count == 0:
                if first:
                    return -1
                break
            first = False
            take = min(count, KEPT_DIGITS - kept)
            if take == count:
                mantissa = mantissa * _POW10_INT[count] + value
            elif take > 0:  # the last digits kept (a division, once per long number)
                mantissa = mantissa * _POW10_INT[take] + value // _POW10_INT[count - take]
            kept += take
            exponent -= take
            i += count
    if i + 16 > n:  # a long fraction ran past REACH: the rank's key and digits below are read as words
        return -1
    if data[i] == 101 or data[i] == 69:  # an exponent: the general reader
        return -1
    if _load8(data, i) != _RANK:
        return -1
    i += 8
    count, rank = _digits8(data, i)
    if count == 0 or count == 8:
        return -1
    i += count
    if i + 24 > n or _load8(data, i) != _DECODED_1 or _load8(data, i + 8) != _DECODED_2:
        return -1
    if data[i + 16] != _DECODED_COLON or data[i + 17] != _DECODED_QUOTE:
        return -1
    i += len(_DECODED)
    while True:  # to the string's closing quote, past escapes
        if i + 8 > n:
            return -1
        word = _load8(data, i)
        hits = _has_byte(word, _QUOTES) | _has_byte(word, _BACKSLASHES)
        if hits == 0:
            i += 8
            continue
        i += np.int64(_trailing_zeros(hits) >> U(3))
        if data[i] == 92:  # backslash: the byte after it is escaped
            i += 2
            continue
        i += 1
        break
    if i >= n or data[i] != 125:  # }
        return -1
    logprobs[e] = sign * (float(mantissa) / _POW10[-exponent])
    ranks[e] = rank
    return i + 1
