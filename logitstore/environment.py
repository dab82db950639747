"""The one place logitstore changes environment variables for a while: `environment(**values)`.

Process-group variables for a one-process run (`RANK`, `MASTER_PORT`, ...), the rendezvous address
spawned ranks inherit, a test's S3 endpoint: set on entry, put back as they were on exit (removed where
they were unset), so a later launch in the same process (a test, a notebook) never mistakes leftovers
for a torchrun worker's. A spawned worker process that sets `CUDA_VISIBLE_DEVICES` for its whole life
(`pipelines/workers.py`) is the one exception: nothing outlives it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
