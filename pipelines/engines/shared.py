"""What several engines share: the out-of-memory halving of a batch, batches by token budget, and the stop
tokens that end an answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from logitstore.format.samples import concat
from logitstore.pipelines.engines.base import EngineError

T = TypeVar("T")


def is_out_of_memory(error: BaseException) -> bool:
    """A device allocation failure (torch's own type, or a RuntimeError saying so, as CUDA kernels and
    vLLM raise it)."""
    # torch is loaded by the engine long before this runs; at the top it would cost `build` 1.5 s before
    # its input checks
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
    )


def halving_on_oom(
    run: Callable[..., T],
    sample_ids: list[str],
    tokens: Sequence[np.ndarray],
    keep: list | None,
    *,
    on_oom: Callable[[], None] = lambda: None,
    join: Callable[[list[T]], T] = concat,  # type: ignore[assignment]  # the default for T = SparseSamples
) -> T:
    """`run(sample_ids, tokens, keep)`; when it runs out of memory, `on_oom()` (free the cache) and the
    two halves of the batch are run apart, recursively, their results joined by `join` (`concat` of
    `SparseSamples` by default). One sample that does not fit is an error."""
    try:
        return run(sample_ids, tokens, keep)
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
    on_oom()
    if len(sample_ids) == 1:
        raise EngineError(
            f"sample {sample_ids[0]!r} ({len(tokens[0])} tokens) does not fit in memory even alone; "
            "lower --max-length or --batch-tokens"
        )
    half = len(sample_ids) // 2
    halves = (None, None) if keep is None else (keep[:half], keep[half:])
    return join(
        [
            halving_on_oom(run, sample_ids[:half], tokens[:half], halves[0], on_oom=on_oom, join=join),
            halving_on_oom(run, sample_ids[half:], tokens[half:], halves[1], on_oom=on_oom, join=join),
        ]
    )


def stop_token_ids(generation_config, config) -> list[int]:
    """The ids that end an answer: the generation config's `eos_token_id` (one id or a list), else the
    model config's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or ())
    return sorted({int(i) for i in ids})


def cut_at_stop(row: np.ndarray, stop_ids: Sequence[int]) -> np.ndarray:
    """An answer up to and with its first stop token (what follows is padding); whole if none."""
    row = np.asarray(row, dtype=np.int64)
    hits = np.flatnonzero(np.isin(row, np.asarray(stop_ids, dtype=np.int64)))
    return row[: hits[0] + 1] if len(hits) else row


def token_budget_batches(sorted_lengths: np.ndarray, order: np.ndarray, *, budget: int):
    """Consecutive rows of `order` (sorted longest first) whose padded size rows x longest <= budget."""
    start = 0
    while start < len(order):
        longest = sorted_lengths[start]
        rows = max(1, budget // max(int(longest), 1))
        yield order[start : start + rows]
        start += rows
