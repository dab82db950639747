"""Cross-tokenizer stores of synthetic teacher output: one teacher with the student tokenizer "s",
whose student tokens follow the teacher's 1:1 for the first half of a sample and two to one after it
(`tests/data/make_format3_students_store.py` wrote the format-3 store of the same samples)."""

from __future__ import annotations

import numpy as np

from logitstore.format import codec
from logitstore.format.samples import SparseSamples, StudentTokens, row_offsets
from logitstore.format.sparsity import Sparsity
from logitstore.store.meta import StudentTokenizer, TeacherMeta
from logitstore.store.store import Store
from logitstore.testing.synthetic import random_samples

VOCAB, STUDENT_VOCAB = 1000, 500


TEACHER, STUDENT = "teacher-a", "s"


def student_side(samples: SparseSamples) -> StudentTokens:
    """Synthetic student tokens: each sample's first half 1:1 with the teacher's tokens, then every two
    teacher tokens as one student token (chains)."""
    offsets = row_offsets(samples.n_tokens)
    out = []
    for i in range(len(samples)):  # a few dozen samples
        ids = samples.input_ids[offsets[i] : offsets[i + 1]].astype(np.int64)
        n = len(ids)
        t0 = np.concatenate([np.arange(n // 2), np.arange(n // 2, n, 2)])
        t1 = np.concatenate([t0[1:], [n]])
        s = np.arange(len(t0))
        out.append((ids[t0] % STUDENT_VOCAB, np.stack([t0, t1, s, s + 1], axis=1)))
    return StudentTokens.from_samples(out)


def cross_batches(*, n: int = 24, parts: int = 3) -> list[tuple[SparseSamples, StudentTokens]]:
    """`parts` parts of `n` samples, each with its student tokens."""
    ids = [f"doc-{i:03d}" for i in range(n)]
    batches = [
        random_samples(list(c), seed=i, max_tokens=60, k=8, vocab=VOCAB)
        for i, c in enumerate(np.array_split(ids, parts))
    ]
    return [(b, student_side(b)) for b in batches]


def register(store: Store, batches, **meta_fields) -> None:
    """Register the teacher and its student tokenizer (`meta_fields`: e.g. part_layout), then write the parts."""
    meta = TeacherMeta(
        name=TEACHER,
        vocab_size=VOCAB,
        content_hash="w",
        tokenizer_hash="t",
        sparsity=Sparsity.from_meta({"mode": "topk", "k": 8, "n": 8}),
        **meta_fields,
    )
    student = StudentTokenizer(
        name=STUDENT,
        tokenizer_hash="student-t",
        vocab_size=STUDENT_VOCAB,
        tokenizer_json="{}",
        vocab_map=np.where(np.arange(VOCAB) < STUDENT_VOCAB, np.arange(VOCAB), -1).astype(np.int32),
    )
    order = codec.frequency_id_order(batches[0][0].entry_ids, vocab_size=VOCAB)
    with store.writer() as w:
        w.add_teacher(meta, code_of_id=order, students=[student])
        for samples, students in batches:
            w.write(samples, teacher=TEACHER, students={STUDENT: students})
        w.commit("cross-tokenizer data")


def cross_store(uri: str, *, n: int = 24, parts: int = 3, **meta_fields):
    """A store of one cross-tokenizer teacher (student tokenizer "s"), written now; the pinned view."""
    store = Store.open(uri, create=True)
    register(store, cross_batches(n=n, parts=parts), **meta_fields)
    return store.read()
