"""A local file replaced whole: `replace_file` (bytes in memory) and `replacing` (a file written in
pieces, such as a Parquet file streamed row group by row group) write a temporary file beside it and
rename it over the old one, so a reader (or the next run after a crash) sees the old bytes or the new,
never a mix. What a crash leaves is a stray `.tmp-*` file beside it. Costs one fsync per file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def replace_file(target: Path, data: bytes) -> None:
    """`data` as the file `target` (its folder must exist), with the usual mode for new files."""
    with replacing(target) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A temporary path beside `target` (its folder must exist) for the caller to write: when the block
    ends, it is synced to disk and renamed over `target`, with the usual mode for new files; when the
    block raises (an error, Ctrl-C), it is removed and `target` is left as it was."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    os.close(fd)
    try:
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; other readers of a shared store need the usual mode
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask, read without changing it (os.umask would set it, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration):
        return 0o022
