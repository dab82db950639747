"""logitstore: a versioned store of sparse teacher distributions for offline distillation.

The Python API in two calls (the CLI, the trainer and the benchmarks use the same ones):

    import logitstore
    view = logitstore.open("s3://bucket/distill", version="v1")        # read-only, pinned
    with logitstore.stream(view, seq_len=4096, micro_batch=8, seed=0) as batches:
        for batch in batches:                                            # PackedBatch
            ...

`logitstore.torch_dataset(view, ...)` is the same stream as a torch `IterableDataset`, and
`logitstore.trainer.hf.DistillationTrainer` trains under `transformers.Trainer` from a store.

The store and the stream load on first use: every `logitstore` command imports this package first,
and importing the store costs 1.1 s (zarr, Icechunk, pyarrow, numba), the stream 2.1 s (torch). Only
the stream's options (`StreamSpec`) load with the package.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing

# The stream's options: a dataclass without torch or numpy (a few milliseconds), so `help(logitstore.stream)`
# lists them from their one definition.
from logitstore.streaming.spec import StreamSpec


def open(uri: str, version: str | None = None):  # noqa: A001 - the API reads as logitstore.open
    """A read-only view of one version (a tag, a branch, a snapshot id; default: the tip of main)."""
    from logitstore.store.store import Store  # on first use: see the module's docstring

    return Store.open(uri).read(version)


def stream(view, **options):
    """Packed micro-batches of `seq_len` tokens from a version: an iterable of `PackedBatch` with
    `state_dict()`, `load_state_dict()` and `close()` (also a context manager). The options, with
    their defaults, are the fields of `logitstore.streaming.spec.StreamSpec`: the signature above, and
    what each means in its docstring's `Args:` ("Streaming" in docs/train.md says how they interact)."""
    from logitstore.streaming.stream import store_stream  # on first use: see the module's docstring

    return store_stream(view, StreamSpec(**options))


def torch_dataset(view, **stream_options):
    """The version as a `torch.utils.data.IterableDataset` of packed micro-batches: `stream(view, ...)`,
    which is one, with the same keywords. It shards by `torch.distributed` rank on its own, and by
    DataLoader worker when read as `DataLoader(ds, batch_size=None, num_workers=W,
    multiprocessing_context="spawn")` (the loader then yields the batches of one process, in order);
    `state_dict()`/`load_state_dict()` resume it (through workers: each batch's `data_state`). For
    `transformers.Trainer`, `logitstore.trainer.hf.DistillationTrainer` uses it."""
    return stream(view, **stream_options)


def _signature_of(spec_type) -> inspect.Signature:
    """`stream(view, *, <every option of the spec with its default>)`, for `help()` and editors."""
    hints = typing.get_type_hints(spec_type)
    options = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
            annotation=hints[f.name],
        )
        for f in dataclasses.fields(spec_type)
    ]
    return inspect.Signature([inspect.Parameter("view", inspect.Parameter.POSITIONAL_OR_KEYWORD), *options])


stream.__signature__ = _signature_of(StreamSpec)  # type: ignore[attr-defined]
