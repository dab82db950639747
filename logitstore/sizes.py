"""Byte sizes as people write them: `parse_bytes("32MB")`, `parse_bytes("2GiB")`, `parse_bytes(4096)`.

One parser for every size option (`--memory-budget` in the trainer and the benchmarks, the
`memory_budget=` of `logitstore.stream`). Decimal units (kB, MB, GB, TB) count powers of 1000, binary
ones (KiB, MiB, GiB, TiB) powers of 1024; case does not matter and a space may stand before the unit.
"""

from __future__ import annotations

import re

from logitstore.errors import LogitstoreError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


class SizeError(LogitstoreError, ValueError):
    """A size that does not parse, or is not positive."""


def parse_bytes(value: int | str, *, name: str = "size") -> int:
    """Bytes in `value`: an int, or a number with an optional unit. `name` starts the error message
    (e.g. "--memory-budget")."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SizeError(f"{name} must be a number of bytes or a string like '512MB' or '2GiB', got {value!r}")
    number: float
    if isinstance(value, int):
        number, unit = value, ""
    else:
        match = _SIZE.fullmatch(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise SizeError(
                f"{name} {value!r}: write a number and a unit, e.g. 512MB or 2GiB "
                "(units: kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * _UNITS[unit])
    if size < 1:
        raise SizeError(f"{name} must be positive, got {value!r}")
    return size


def format_bytes(size: int) -> str:
    """`format_bytes(3 << 30)` -> '3.0 GiB': for messages."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


# The stored data a rank's stream holds at once (`--memory-budget`): per reader process, as a training
# node has ~1 TB for 8 ranks. Here, not in trainer/stream.py, so the configuration checks load no torch.
DEFAULT_MEMORY_BUDGET = "4GiB"
