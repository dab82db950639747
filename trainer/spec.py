"""The stream's options: their defaults, their checks, and the error a stream that cannot be built raises.
Light on purpose (no torch, no numpy): the training configuration and the Python API read it at start-up.
"""

from __future__ import annotations

from logitstore.errors import LogitstoreError

SPLITS = ("train", "eval")
ON_ERROR = ("raise", "skip")
DEFAULT_MEMORY_BUDGET = "4GiB"  # per reader process: a training node has ~1 TB for 8 ranks
READ_THREADS = 8  # parts read at once: S3 answers in 10-50 ms, so one at a time would starve decoding


class StreamConfigError(LogitstoreError, ValueError):
    """A stream that cannot be built as asked: a bad argument, an empty or too small split, a memory
    budget below two parts, or a state from another run. A `LogitstoreError` and a `ValueError`."""


def check_arguments(
    *, seq_len: int, micro_batch: int, rank: int, world_size: int, split: str, prefetch: int, on_error: str
) -> None:
    if seq_len < 2:
        raise StreamConfigError(f"seq_len must be at least 2 (a token and the one it predicts), got {seq_len}")
    if micro_batch < 1:
        raise StreamConfigError(f"micro_batch must be at least 1, got {micro_batch}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise StreamConfigError(f"rank {rank} is outside world size {world_size}")
    if split not in SPLITS:
        raise StreamConfigError(f"split must be one of {SPLITS}, got {split!r}")
    if prefetch < 0:
        raise StreamConfigError(f"prefetch must be >= 0, got {prefetch}")
    if on_error not in ON_ERROR:
        raise StreamConfigError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")


def check_eval_fraction(eval_fraction: float) -> None:
    if not 0 <= eval_fraction <= 1:
        raise StreamConfigError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
