"""Documents and the samples that hold them, and the rule a write meets for what a branch holds already.

A sample id names one document and one window: the document's id for a document of one window, else
`<doc id>#w<i>` for its window i = 0, 1, ... (`pipelines/plan.py` makes them; input ids that end like a
window id are refused, `WINDOW_SUFFIX`). So one document's text may be held under ids that differ from a
write's: `d0` stored, `d0#w0` and `d0#w1` written (the new text makes more windows), or the other way.

`decide` is the rule of a write that skips what is stored (`StoreWriter`, on_duplicate="skip"), one rule
for the samples the branch held when the write began and for those a concurrent writer committed
meanwhile: a sample whose document is stored with the same text (or a text of unknown source) is left
out; with other text (both source hashes known, and different) it meets `on_changed`: "error" raises
`ChangedTextError`, "skip" leaves the write's samples of that document out, "replace" keeps them and
drops every stored sample of the document they do not overwrite.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from logitstore.errors import ChangedTextError

WINDOW_SUFFIX = r"#w[0-9]+$"  # what ends a window's sample id; a document id may not end like it
_WINDOW = re.compile(WINDOW_SUFFIX)

Key = tuple[str, str]  # (teacher, sample id)


def document_ids(sample_ids: pa.Array) -> pa.Array:
    """The document id of each sample id (its window suffix removed), vectorised."""
    return pc.replace_substring_regex(sample_ids, pattern=WINDOW_SUFFIX, replacement="")


def document_id(sample_id: str) -> str:
    return _WINDOW.sub("", sample_id)


def stored_samples(key: Key, stored: Mapping[Key, str | None]) -> list[Key]:
    """The samples `stored` holds of `key`'s document: its id, and its windows' from `#w0` on. A few
    lookups per sample (windows are numbered without gaps)."""
    teacher, doc = key[0], document_id(key[1])
    held = [(teacher, doc)] if (teacher, doc) in stored else []
    i = 0
    while (teacher, f"{doc}#w{i}") in stored:  # one step per stored window of the document
        held.append((teacher, f"{doc}#w{i}"))
        i += 1
    return held


@dataclass
class Decision:
    """What a write does with its samples that meet stored ones (`decide`)."""

    left_out: set[Key] = field(default_factory=set)  # the write's samples not to stage
    changed: list[str] = field(default_factory=list)  # the write's sample ids whose document has other text
    dropped: set[Key] = field(default_factory=set)  # stored samples the write replaces under other ids


def decide(
    keys: Sequence[Key], sources: Sequence[str | None], *, stored: Mapping[Key, str | None], on_changed: str
) -> Decision:
    """The rule (module docstring) for a write's samples `keys` of text `sources` against `stored`
    ({(teacher, sample id): source hash} of what the branch holds). One step per sample."""
    out = Decision()
    first: tuple[Key, str, str] | None = None
    for key, new in zip(keys, sources):  # one step per sample
        held = stored_samples(key, stored)
        other = [stored[k] for k in held if stored[k] is not None and new is not None and stored[k] != new]
        if not other:
            if key in stored:  # the same text, or one of unknown source: stored already
                out.left_out.add(key)
            continue
        assert new is not None and other[0] is not None, "compared above"
        first = first or (key, other[0], new)
        out.changed.append(key[1])
        if on_changed == "replace":
            out.dropped.update(k for k in held if k != key)
        else:
            out.left_out.add(key)
    if first is not None and on_changed == "error":
        (teacher, sample_id), was, now = first
        raise ChangedTextError(teacher=teacher, sample_id=sample_id, stored=was, new=now, count=len(out.changed))
    return out
