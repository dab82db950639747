"""The versioned store: opening, committing and reading versions, the Arrow index, metadata, the
writer and reader, verification, the report and `logitstore show`.

`from logitstore.store import Store` loads the store on first use (zarr, Icechunk, pyarrow); importing
a module of this package, such as its metadata, loads only that module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from logitstore.store.store import Store


def __getattr__(name: str) -> Any:
    if name == "Store":
        # On first use: importing the store costs ~1 s (zarr, Icechunk, pyarrow, numba).
        from logitstore.store.store import Store

        return Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Store"]
