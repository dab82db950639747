"""logitstore: a versioned store of sparse teacher distributions for offline distillation.

The Python API in two calls (the CLI, the trainer and the benchmarks use the same ones):

    import logitstore
    view = logitstore.open("s3://bucket/distill", version="v1")        # read-only, pinned
    with logitstore.stream(view, seq_len=4096, micro_batch=8, seed=0) as batches:
        for batch in batches:                                            # PackedBatch
            ...

`logitstore.torch_dataset(view, ...)` is the same stream as a torch `IterableDataset`, and
`logitstore.hf.DistillationTrainer` trains under `transformers.Trainer` from a store.

The store and the stream load on first use: every `logitstore` command imports this package first,
and importing the store costs 1.1 s (zarr, Icechunk, pyarrow, numba), the stream 2.1 s (torch).
"""

from __future__ import annotations


def open(uri: str, version: str | None = None):  # noqa: A001 - the API reads as logitstore.open
    """A read-only view of one version (a tag, a branch, a snapshot id; default: the tip of main)."""
    from logitstore.store import Store  # on first use: see the module's docstring

    return Store.open(uri).read(version)


def stream(
    view,
    *,
    seq_len: int,
    micro_batch: int,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    teacher: str | None = None,
    split: str = "train",
    memory_budget: int | str | None = None,
    eval_fraction: float = 0.05,
    on_error: str = "raise",
    prefetch: int = 4,
    train_on: str = "completion",
):
    """Packed micro-batches of `seq_len` tokens from a version: an iterable of `PackedBatch` with
    `state_dict()`, `load_state_dict()` and `close()` (also a context manager). `rank` and `world_size`
    default to `torch.distributed`'s when it is initialised, else 0 and 1. `memory_budget` (bytes, or
    a string such as "512MB" or "2GiB"; default `sizes.DEFAULT_MEMORY_BUDGET`, 4 GiB) bounds the
    stored data held in memory and so the shuffle window; see "Streaming" in docs/train.md. For chat
    data, `train_on="completion"` keeps only the positions that predict the assistant's tokens."""
    from logitstore.trainer.stream import store_stream  # on first use: see the module's docstring

    rank, world_size = _rank_and_world(rank, world_size)
    return store_stream(
        view,
        teacher=teacher,
        seq_len=seq_len,
        micro_batch=micro_batch,
        rank=rank,
        world_size=world_size,
        seed=seed,
        split=split,
        eval_fraction=eval_fraction,
        prefetch=prefetch,
        on_error=on_error,
        memory_budget=memory_budget,
        train_on=train_on,
    )


def torch_dataset(view, **stream_options):
    """The version as a `torch.utils.data.IterableDataset` of packed micro-batches: `stream(view, ...)`,
    which is one, with the same keywords. It shards by `torch.distributed` rank on its own, and by
    DataLoader worker when read as `DataLoader(ds, batch_size=None, num_workers=W,
    multiprocessing_context="spawn")` (the loader then yields the batches of one process, in order);
    `state_dict()`/`load_state_dict()` resume it (through workers: each batch's `data_state`). For
    `transformers.Trainer`, `logitstore.hf.DistillationTrainer` uses it."""
    return stream(view, **stream_options)


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    import torch.distributed as dist  # on first use, as the stream

    initialised = dist.is_available() and dist.is_initialized()
    default_rank, default_world = (dist.get_rank(), dist.get_world_size()) if initialised else (0, 1)
    return (default_rank if rank is None else rank), (default_world if world_size is None else world_size)
