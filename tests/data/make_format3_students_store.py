"""How tests/data/format3-students-store was written: by logitstore at store format 3 (commit e96bfb6),
whose cross-tokenizer parts keep their student-token arrays as objects of their own, run as

    git archive e96bfb6 logitstore benchmarks/synthetic.py | tar -x -C OLD && touch OLD/benchmarks/__init__.py
    PYTHONPATH=OLD python tests/data/make_format3_students_store.py tests/data/format3-students-store

with the imports named as that commit named them (its modules were flat, `logitstore.store` and the like,
and the synthetic samples lived in benchmarks/). The samples and the writing are `logitstore.testing.students`'
`cross_batches` and `register`; `tests/test_students.py` streams the store and compares it with the same
samples written now, through the cross-tokenizer source.
"""

import sys

from logitstore.store.meta import FORMAT_VERSION
from logitstore.store.store import Store
from logitstore.testing.students import cross_batches, register

if __name__ == "__main__":
    assert FORMAT_VERSION == 3, FORMAT_VERSION
    register(Store.open(sys.argv[1], create=True), cross_batches())
