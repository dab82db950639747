"""The stream's options, `StreamSpec`: one frozen record that every layer passes on, from the Python API
(`logitstore.stream`, whose signature is made from it) through `store_stream`, the engine (`Stream`),
the recipe a DataLoader worker rebuilds a stream from, live mode (`live_stream`) and the Trainer
integration (`trainer/hf.py`); checked once, on construction.

Light on purpose (no torch, no numpy): `import logitstore` and the training configuration read it at
start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from logitstore.errors import LogitstoreError
from logitstore.text import TRAIN_ON, TrainOn

SPLITS = ("train", "eval")
OnError = Literal["raise", "skip"]
ON_ERROR: tuple[OnError, ...] = get_args(OnError)
DEFAULT_MEMORY_BUDGET = "4GiB"  # per reader process: a training node has ~1 TB for 8 ranks
READ_THREADS = 8  # parts read at once: S3 answers in 10-50 ms, so one at a time would starve decoding


class StreamConfigError(LogitstoreError, ValueError):
    """A stream that cannot be built as asked: a bad argument, an empty or too small split, a memory
    budget below two parts, or a state from another run. A `LogitstoreError` and a `ValueError`;
    `field` names the `StreamSpec` field a bad argument was given for (the message starts with it)."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class StreamSpec:
    """What a stream is asked for: the one place each stream option and its default is declared
    (`DataConfig`, `DistillationTrainer`, `StoreSource` and `MixedSource` take their defaults from here).

    Args:
        seq_len: tokens per packed row.
        micro_batch: rows per micro-batch of one rank.
        seed: seeds the data order (the permutations of parts, windows and samples).
        rank: this stream's rank; default `torch.distributed`'s when it is initialised, else 0 (`placed`).
        world_size: the ranks sharing the stream; default `torch.distributed`'s, else 1 (`placed`).
        teacher: which of a store's teachers (default: its only one).
        split: "train" (endless, epoch after epoch) or "eval" (one pass).
        eval_fraction: a sample is held out (the eval split) iff the hash of its id falls below it.
        memory_budget: bytes, or a string such as "512MB" or "2GiB" (default `DEFAULT_MEMORY_BUDGET`):
            bounds the stored data held in memory, and so the shuffle window.
        on_error: "raise" stops at a damaged sample; "skip" trains past it (as padding) and counts it.
        prefetch: batches built ahead in a thread (0: none).
        read_threads: parts read at once.
        train_on: chat data: "completion" keeps only the positions that predict the assistant's tokens,
            "prompt+completion" every position.
        reader_groups: how many groups the train split's parts are dealt to (default: the world size; a
            resumed run keeps its state's). The order depends on it and not on the world size; a world
            size that divides it (or that it divides) reads each stored byte about once per epoch.
        loader_workers: the `num_workers` of the DataLoader that will read the stream (0: none); with
            W > 1 the default `reader_groups` is world size x micro_batch x W, the multiple at which the
            W workers of a rank read disjoint parts instead of W times its parts.
    """

    seq_len: int
    micro_batch: int
    seed: int = 0
    rank: int | None = None
    world_size: int | None = None
    teacher: str | None = None
    split: str = "train"
    eval_fraction: float = 0.05
    memory_budget: int | str | None = None
    on_error: OnError = "raise"
    prefetch: int = 4
    read_threads: int = READ_THREADS
    train_on: TrainOn = "completion"
    reader_groups: int | None = None
    loader_workers: int = 0

    def __post_init__(self) -> None:
        rank, world = self.rank, self.world_size
        placed = world is None or (world >= 1 and (rank is None or 0 <= rank < world))
        checks = [  # (ok, field, what is wrong): the message starts with the field's name
            (self.seq_len >= 2, "seq_len", f"must be at least 2 (a token and the one it predicts), got {self.seq_len}"),
            (self.micro_batch >= 1, "micro_batch", f"must be at least 1, got {self.micro_batch}"),
            (placed and (rank is None or rank >= 0), "rank", f"{rank} is outside world size {world}"),
            (self.split in SPLITS, "split", f"must be one of {', '.join(SPLITS)}, got {self.split!r}"),
            (self.prefetch >= 0, "prefetch", f"must be >= 0, got {self.prefetch}"),
            (self.on_error in ON_ERROR, "on_error", f"must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}"),
            (self.train_on in TRAIN_ON, "train_on", f"must be one of {', '.join(TRAIN_ON)}, got {self.train_on!r}"),
            (0 <= self.eval_fraction <= 1, "eval_fraction", f"must be in [0, 1], got {self.eval_fraction}"),
            (
                self.reader_groups is None or self.reader_groups >= 1,
                "reader_groups",
                f"must be >= 1, got {self.reader_groups}",
            ),
            (self.loader_workers >= 0, "loader_workers", f"must be >= 0, got {self.loader_workers}"),
        ]
        for ok, name, problem in checks:
            if not ok:
                raise StreamConfigError(f"{name} {problem}", field=name)

    def default_reader_groups(self) -> int:
        """Reader groups when `reader_groups` is not given (a placed spec): the world size, times
        micro_batch x loader_workers where several DataLoader workers split each rank's steps (worker w
        takes steps w, w + W, ...: its steps take disjoint groups only when a step's rows are 1/W of a
        round of the groups or less)."""
        assert self.world_size is not None  # placed
        return self.world_size * (self.micro_batch * self.loader_workers if self.loader_workers > 1 else 1)

    def placed(self) -> StreamSpec:
        """This spec with its rank and world size given: torch.distributed's where it is initialised and
        they were not, else 0 and 1."""
        if self.rank is not None and self.world_size is not None:
            return self
        import torch.distributed as dist  # here: this module stays free of torch for start-up

        initialised = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if initialised else (0, 1)
        return dataclasses.replace(
            self,
            rank=rank if self.rank is None else self.rank,
            world_size=world if self.world_size is None else self.world_size,
        )
