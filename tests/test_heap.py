"""`logitstore.heap.frozen_heap`: what the collector tracked before a long job is left out of its passes
for the job, nested jobs included, and given back after the outermost."""

import gc

from logitstore.heap import frozen_heap


def test_the_heap_is_frozen_inside_the_outermost_block_only():
    assert gc.get_freeze_count() == 0
    kept = [object() for _ in range(10)]  # tracked containers: a list
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with frozen_heap():  # a build inside a multi-teacher build
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen, "the inner block leaves the outer's heap frozen"
        assert not any(obj is kept for obj in gc.get_objects()), "frozen objects are out of the collector's view"
    assert gc.get_freeze_count() == 0
    assert any(obj is kept for obj in gc.get_objects())
