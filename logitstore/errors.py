"""Errors a user can cause. The CLI prints these as one line and exits non-zero.

Anything that is *not* a `LogitstoreError` is a bug in logitstore and keeps its traceback.

What an error quotes is bounded here: a value from a config file by `quoted` (YAML aliases make a list
of a billion items from ten lines, and its full repr would cost as much), and the line the CLI prints
by `capped`, whatever it holds (an input row's id, a path).

The exit codes, one table for every command (docs/exit-codes.md):
"""

import reprlib

OK = 0  # the command did what was asked
DAMAGED = 1  # stored data is damaged or lost (`DamagedDataError`); rerunning will not help
USAGE_OR_OUTAGE = 2  # a user error (flags, paths, input) or a storage outage; fix, or run again later
INTERRUPTED = 130  # Ctrl-C (SIGINT), or the reader of the output went away (`| head`)

QUOTED_CHARACTERS = 200  # of one value an error message quotes
LINE_CHARACTERS = 1000  # of the line the CLI prints for an error
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxtuple, _QUOTE.maxdict = 3, 8, 8, 8
_QUOTE.maxstring = _QUOTE.maxother = QUOTED_CHARACTERS


def quoted(value: object) -> str:
    """`repr(value)` for an error message: nested and long values elided, at most `QUOTED_CHARACTERS`,
    at a cost that does not grow with the value."""
    return capped(_QUOTE.repr(value), limit=QUOTED_CHARACTERS)


def capped(text: str, *, limit: int = LINE_CHARACTERS) -> str:
    """`text`, or its start and end with the middle left out when it is longer than `limit`."""
    if len(text) <= limit:
        return text
    gap = f" ... [{len(text) - limit:,} characters left out] ... "
    head = (limit - len(gap)) * 3 // 4
    return text[:head] + gap + text[len(text) - (limit - len(gap) - head) :]


class LogitstoreError(Exception):
    """Base class for every error caused by input, configuration or environment."""

    exit_code = USAGE_OR_OUTAGE  # what the CLI exits with


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


class ChangedTextError(ConflictError):
    """A write holds a sample id that the branch holds with other text (their source hashes differ):
    stored before the write began, or committed by a concurrent writer meanwhile."""

    def __init__(self, *, teacher: str, sample_id: str, stored: str, new: str, count: int):
        self.teacher, self.sample_id, self.stored, self.new, self.count = teacher, sample_id, stored, new, count
        more = f" (and {count - 1} more)" if count > 1 else ""
        super().__init__(
            f"sample {sample_id!r} of teacher {teacher!r} is stored with other text (source hash {stored}, "
            f"now {new}){more}; pass on_changed='replace' or 'skip'"
        )


class StorageError(LogitstoreError):
    """The storage backend is unreachable, times out or refuses the credentials: an outage. Nothing is
    wrong with the data; the command can be run again (a build or a training run resumes)."""


class DamagedDataError(LogitstoreError):
    """Stored bytes fail their checksum or disagree with the index: damage that `verify` reports.
    The CLI exits 1 for it, as `verify` does when it finds damage."""

    exit_code = DAMAGED


class IncompatibleStoreError(LogitstoreError):
    """The store was written by another teacher/tokenizer, or by a newer logitstore."""
