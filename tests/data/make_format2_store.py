"""How tests/data/format2-store was written: by logitstore before store format 3 (commit 5360538), run as

    git archive 5360538 logitstore benchmarks/synthetic.py | tar -x -C OLD && touch OLD/benchmarks/__init__.py
    PYTHONPATH=OLD python tests/data/make_format2_store.py tests/data/format2-store

with the imports named as that commit named them (its modules were flat, `logitstore.store` and the like,
and the synthetic samples lived in benchmarks/).

(`tests/test_stream.py` streams it and compares with the same samples written now.)
"""

import sys

import numpy as np

import logitstore
from logitstore.format import codec
from logitstore.format.sparsity import Sparsity
from logitstore.store.meta import FORMAT_VERSION, TeacherMeta
from logitstore.store.store import Store
from logitstore.testing.synthetic import random_samples

assert FORMAT_VERSION == 2, logitstore.__file__
uri = sys.argv[1]
store = Store.open(uri, create=True)
ids = [f"doc-{i:03d}" for i in range(30)]
batches = [
    random_samples(list(c), seed=i, max_tokens=60, k=8, vocab=1000) for i, c in enumerate(np.array_split(ids, 3))
]
meta = TeacherMeta(
    name="teacher-a",
    vocab_size=1000,
    content_hash="w",
    tokenizer_hash="t",
    sparsity=Sparsity.from_meta({"mode": "topk", "k": 8, "n": 8}),
)
with store.writer() as w:
    w.add_teacher(meta, code_of_id=codec.frequency_id_order(batches[0].entry_ids, vocab_size=1000))
    for s in batches:
        w.write(s, teacher="teacher-a")
    w.commit("data, written by logitstore at store format 2")
print(logitstore.__file__)
