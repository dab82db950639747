"""How long one storage request may take and how often it is tried: `StorageLimits`, the one place that
sets Icechunk's S3 client, boto3 (the indexes, `blobs.py`) and logitstore's own deadline on every
storage call (`bounded.py`), from `LOGITSTORE_STORAGE_TIMEOUT`, `_RETRIES` and `_BACKOFF`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import icechunk

from logitstore.errors import LogitstoreError


@dataclass(frozen=True)
class StorageLimits:
    """How long one storage request may take and how often it is tried: the one place that sets
    Icechunk's S3 client, boto3 (the indexes) and logitstore's own deadline on every storage call
    (`bounded.py`). Defaults suit real S3: a stalled or lost endpoint fails within two minutes."""

    timeout_s: float = 20.0  # LOGITSTORE_STORAGE_TIMEOUT: one attempt of one request, seconds
    retries: int = 3  # LOGITSTORE_STORAGE_RETRIES: attempts after a failed one
    backoff_s: float = 5.0  # LOGITSTORE_STORAGE_BACKOFF: the longest wait between two attempts, seconds

    @classmethod
    def from_env(cls) -> StorageLimits:
        return cls(
            timeout_s=_env_number("LOGITSTORE_STORAGE_TIMEOUT", cls.timeout_s, minimum=0.1),
            retries=int(_env_number("LOGITSTORE_STORAGE_RETRIES", cls.retries, minimum=0, integer=True)),
            backoff_s=_env_number("LOGITSTORE_STORAGE_BACKOFF", cls.backoff_s, minimum=0.0),
        )

    @property
    def attempts(self) -> int:
        return self.retries + 1

    @property
    def deadline_s(self) -> float:
        """The longest one storage call may take: every attempt timing out, the longest wait between."""
        return self.attempts * self.timeout_s + self.retries * self.backoff_s

    def describe(self) -> str:
        return (
            f"LOGITSTORE_STORAGE_TIMEOUT={self.timeout_s:g} s, LOGITSTORE_STORAGE_RETRIES={self.retries}, "
            f"LOGITSTORE_STORAGE_BACKOFF={self.backoff_s:g} s"
        )

    def icechunk_config(self) -> icechunk.RepositoryConfig:
        retries = icechunk.StorageRetriesSettings(
            max_tries=self.attempts,
            initial_backoff_ms=int(min(0.2, self.backoff_s) * 1000),
            max_backoff_ms=int(self.backoff_s * 1000),
        )
        return icechunk.RepositoryConfig(storage=icechunk.StorageSettings(retries=retries))

    def botocore_config(self):
        import botocore.config  # only S3 stores need it (see S3Blobs)

        # botocore's standard mode waits up to 20 s between attempts; it has no setting for that
        return botocore.config.Config(
            connect_timeout=self.timeout_s,
            read_timeout=self.timeout_s,
            retries={"total_max_attempts": self.attempts, "mode": "standard"},
        )


def _env_number(name: str, default: float, *, minimum: float, integer: bool = False) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < minimum:
        kind = "a whole number" if integer else "a number of seconds"
        raise LogitstoreError(f"{name}={raw!r}: must be {kind} >= {minimum:g} (unset for the default, {default:g})")
    return value
