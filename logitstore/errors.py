"""Errors a user can cause. The CLI prints these as one line and exits non-zero.

Anything that is *not* a `LogitstoreError` is a bug in logitstore and keeps its traceback.
"""


class LogitstoreError(Exception):
    """Base class for every error caused by input, configuration or environment."""


class StoreNotFoundError(LogitstoreError):
    """The location holds no logitstore store."""


class VersionNotFoundError(LogitstoreError):
    """A version id, tag or branch that the store does not have."""


class SampleNotFoundError(LogitstoreError):
    """A sample id that the version does not hold."""


class InvalidSampleError(LogitstoreError):
    """Sample arrays of the wrong shape, dtype or value range."""


class DuplicateSampleError(LogitstoreError):
    """A sample id written twice for one teacher."""


class ConflictError(LogitstoreError):
    """Another writer committed to the branch first and the two changes cannot be merged."""


class StorageError(LogitstoreError):
    """The storage backend is unreachable, refuses the credentials, or returned damaged data."""


class IncompatibleStoreError(LogitstoreError):
    """The store was written by another teacher/tokenizer, or by a newer logitstore."""
