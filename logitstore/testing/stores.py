"""Small stores of synthetic teacher output (`synthetic.random_samples`), written through the real
writer, and the ways tests damage them behind Icechunk's back (a flipped byte, a deleted chunk)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np
import zarr
from tokenizers import Tokenizer, models, pre_tokenizers

from logitstore.format import codec
from logitstore.format.sparsity import Sparsity
from logitstore.store.meta import TeacherMeta
from logitstore.store.store import Store
from logitstore.testing.samples import assert_samples_close
from logitstore.testing.synthetic import random_samples

VOCAB = 1000


def teacher(name="teacher-a", mode="topk", content_hash="weights-1"):
    return TeacherMeta(
        name=name,
        vocab_size=VOCAB,
        content_hash=content_hash,
        tokenizer_hash="tok-1",
        sparsity=Sparsity.from_meta({"mode": mode, "k": 8, "p": 0.9, "n": 8}),
    )


def write(store, samples, *, meta=None, message="write", branch="main", on_duplicate="error"):
    meta = meta or teacher()
    with store.writer(branch=branch, on_duplicate=on_duplicate) as w:
        w.add_teacher(meta, code_of_id=codec.frequency_id_order(samples.entry_ids, vocab_size=VOCAB))
        w.write(samples, teacher=meta.name)
        return w.commit(message)


def assert_matches(view, samples, teacher_name="teacher-a"):
    params = view.teachers[teacher_name].codec
    for i, sid in enumerate(samples.sample_ids):
        assert_samples_close(
            view.sample(sid, teacher=teacher_name),
            samples.select(i),
            bound=params.error_bound,
            bound_fine=params.error_bound_fine,
            coarse_below=params.coarse_below,
        )


def word_tokenizer_json(vocab: int = VOCAB) -> str:
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def write_store(uri: str, *, n: int = 12, seed: int = 0, part_layout: str = "packed") -> Store:
    """A store of one top-8 part of `n` samples; `part_layout="arrays"` writes it as store format 2 did."""
    store = Store.open(uri, create=True)
    samples = random_samples([f"doc-{i}" for i in range(n)], seed=seed, max_tokens=80, k=8)
    meta = TeacherMeta(
        name="teacher-a",
        vocab_size=VOCAB,
        content_hash="w",
        tokenizer_hash="t",
        sparsity=Sparsity(k=8),
        part_layout=part_layout,
    )
    with store.writer() as w:
        w.add_teacher(
            meta,
            tokenizer_json=word_tokenizer_json(),
            code_of_id=codec.frequency_id_order(samples.entry_ids, vocab_size=VOCAB),
        )
        w.write(samples, teacher="teacher-a")
        w.commit("write")
    return store


def trainer_view(uri: str, *, teachers=("teacher-a",)):
    """Four parts per teacher, so a micro-batch reads several parts (on threads) from storage."""
    store = Store.open(uri, create=True)
    ids = [f"doc-{i:03d}" for i in range(24)]
    with store.writer() as w:
        for t, name in enumerate(teachers):
            batches = [
                random_samples(list(chunk), seed=10 * t + i, max_tokens=60, vocab=VOCAB)
                for i, chunk in enumerate(np.array_split(ids, 4))
            ]
            meta = TeacherMeta(
                name=name, vocab_size=VOCAB, content_hash="w", tokenizer_hash="t", sparsity=Sparsity(k=8)
            )
            w.add_teacher(meta, code_of_id=codec.frequency_id_order(batches[0].entry_ids, vocab_size=VOCAB))
            for samples in batches:
                w.write(samples, teacher=name)
        w.commit("data")
    return store.read()


def index_of(store) -> dict[str, tuple[str, str]]:
    """sample id -> (content hash, source hash)"""
    idx = Store.open(str(store)).read().index
    return {
        s: (c, h)
        for s, c, h in zip(
            idx["sample_id"].to_pylist(), idx["content_hash"].to_pylist(), idx["source_hash"].to_pylist()
        )
    }


def stored(store) -> dict[str, str]:
    index = Store.open(str(store)).read().index
    return dict(zip(index["sample_id"].to_pylist(), index["content_hash"].to_pylist()))


def flip_chunk_of(uri: str, array_path: str) -> None:
    """Flip bytes in the chunk file that holds `array_path` (found by trying each chunk: Icechunk names
    chunk files by random ids, and a small store has few of them)."""
    for chunk in sorted(Path(uri, "chunks").iterdir()):
        data = chunk.read_bytes()
        damaged = bytearray(data)
        damaged[len(damaged) // 2] ^= 0xFF
        chunk.write_bytes(bytes(damaged))
        try:
            cast(zarr.Array, Store.open(uri).read().root[array_path])[:]
        except ValueError:
            return  # this chunk holds it; leave it damaged
        chunk.write_bytes(data)
    raise AssertionError(f"no chunk file holds {array_path}")
