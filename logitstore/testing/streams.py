"""Streams over small synthetic stores: a store of one teacher in a few parts, the stream the tests
compare against (`stream`, seed 1), the next batches of one, and batches compared whole or row by row."""

from __future__ import annotations

import itertools
from collections.abc import Generator
from typing import cast

import numpy as np
import torch

from logitstore.format import codec
from logitstore.format.sparsity import Sparsity
from logitstore.store.meta import TeacherMeta
from logitstore.store.store import Store
from logitstore.streaming.batch import PackedBatch
from logitstore.streaming.spec import StreamSpec
from logitstore.streaming.stream import Stream, store_stream
from logitstore.testing.stores import VOCAB
from logitstore.testing.synthetic import random_samples

SEQ, MB = 32, 2


def build_store(
    uri: str,
    *,
    n: int = 60,
    parts: int = 3,
    mode: str = "topk",
    max_tokens: int = 60,
    k: int = 8,
    part_layout: str = "packed",
):
    """A store with `n` samples of one teacher written as `parts` parts; returns the pinned view.
    `part_layout="arrays"`: its parts as before store format 3, one object per array."""
    store = Store.open(uri, create=True)
    ids = [f"doc-{i:03d}" for i in range(n)]
    batches = [
        random_samples(list(chunk), seed=i, mode=mode, max_tokens=max_tokens, k=k, vocab=VOCAB)
        for i, chunk in enumerate(np.array_split(ids, parts))
    ]
    meta = TeacherMeta(
        name="teacher-a",
        vocab_size=VOCAB,
        content_hash="w",
        tokenizer_hash="t",
        sparsity=Sparsity.from_meta({"mode": mode, "k": k, "n": k}),
        part_layout=part_layout,
    )
    with store.writer() as w:
        w.add_teacher(meta, code_of_id=codec.frequency_id_order(batches[0].entry_ids, vocab_size=VOCAB))
        for samples in batches:
            w.write(samples, teacher="teacher-a")
        w.commit("data")
    return store.read()


def stream(view, **kw) -> Stream:
    args = dict(teacher=None, seq_len=SEQ, micro_batch=MB, rank=0, world_size=1, seed=1)
    return store_stream(view, StreamSpec(**{**args, **kw}))


def windowed(view, **kw) -> Stream:
    """A stream whose memory budget holds two parts: windows of one part, the smallest there are."""
    probe = stream(view, **kw)
    sizes = probe.source.part_bytes()
    assert sizes is not None
    budget = 2 * int(sizes.max())
    probe.close()
    s = stream(view, memory_budget=budget, **kw)
    assert s.window_parts == 1
    return s


def take(s: Stream, n: int) -> list[PackedBatch]:
    """The next n batches, leaving the stream's position after them."""
    it = cast(Generator[PackedBatch, None, None], iter(s))  # a generator: close() ends its reads
    out = list(itertools.islice(it, n))
    it.close()
    return out


TENSORS = (
    "input_ids",
    "position_ids",
    "document_ids",
    "positions",
    "entry_ids",
    "entry_logprobs",
    "entry_pos",
    "tail",
    "target_ids",
    "target_logprobs",
)


def assert_same(x: PackedBatch, y: PackedBatch) -> None:
    for name in TENSORS:
        assert torch.equal(getattr(x, name), getattr(y, name)), name
    assert x.n_tokens == y.n_tokens and x.segments == y.segments


def rows_of(batch: PackedBatch) -> list[tuple]:
    """Each row of a batch as (tokens, segments, supervised positions with their targets and tails),
    positions counted within the row: how batches of other micro-batch sizes are compared row by row."""
    seq = batch.input_ids.shape[1]
    positions = batch.positions.tolist()
    out = []
    for b in range(batch.input_ids.shape[0]):
        mine = [i for i, p in enumerate(positions) if p // seq == b]
        out.append(
            (
                tuple(batch.input_ids[b].tolist()),
                tuple((sid, a, flat - b * seq, n) for sid, a, flat, n in batch.segments if flat // seq == b),
                tuple((positions[i] - b * seq, int(batch.target_ids[i]), float(batch.tail[i])) for i in mine),
            )
        )
    return out
