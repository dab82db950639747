"""A local file replaced whole: `replace_file` writes a temporary file beside it and renames it over the
old one, so a reader (or the next run after a crash) sees the old bytes or the new, never a mix. What
a crash leaves is a stray `.tmp-*` file beside it. Costs one fsync per file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def replace_file(target: Path, data: bytes) -> None:
    """`data` as the file `target` (its folder must exist), with the usual mode for new files."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
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
