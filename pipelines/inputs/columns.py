"""The column choice (`--text-column`, `--ids-column`, `--chat-column`, `--id-column`, `--prompt-column`),
its checks against a file's columns, and a record batch's rows as `Document`s: ids, texts and token ids
checked in vectorised passes, a bad row named by its file, row and id. docs/build.md "Input data" has the
rules.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from logitstore.format.samples import CONTROL_CHARACTERS
from logitstore.pipelines.inputs.sources import DataError, HubDataset
from logitstore.store.documents import WINDOW_SUFFIX  # reserved: an input id ending in it could be another's window
from logitstore.text.chat import as_messages, conversation_hash_text, message_problem

_INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Document:
    """One input document.

    id: from the id column (as str), else `source_hash`. text: None for pre-tokenized input.
    token_ids: int64, only for pre-tokenized input. source_hash: `text_hash(text)`, or for
    pre-tokenized input the sha256 of the int64 (little-endian) ids, first 32 hex digits.
    row: 0-based row number in the whole input, in read order.
    """

    id: str
    text: str | None
    token_ids: np.ndarray | None
    source_hash: str
    row: int
    messages: list[dict] | None = None  # chat input (--chat-column): the conversation; text is None


AUTO_ID_COLUMN = "id"  # gives the document ids, where a file has it, when no --id-column is given
AUTOMATIC = "the automatic id column"


@dataclass(frozen=True)
class ColumnChoice:
    """The effective column choice: `ids` set means pre-tokenized input and `text` is None."""

    text: str | None
    id: str | None
    ids: str | None
    id_automatic: bool = False  # `id` is AUTO_ID_COLUMN, read where a file has it
    chat: str | None = None  # the conversations' column (--chat-column): then text and ids are None
    text_option: str = "--text-column"  # the flag that named `text` (--prompt-column for prompts to answer)

    def roles(self) -> dict[str, str]:
        """Column name -> the option that named it, for the columns to read. The automatic id column is
        read where a file has it (`check_columns` drops it where not)."""
        id_option = AUTOMATIC if self.id_automatic else "--id-column"
        named = [
            (self.id, id_option),
            (self.text, self.text_option),
            (self.ids, "--ids-column"),
            (self.chat, "--chat-column"),
        ]
        out: dict[str, str] = {}
        for column, option in named:
            if column is not None:
                out.setdefault(column, option)
        return out


class BadRow(Exception):
    """A converter found a bad value at `index` of a batch; the caller adds file, row and id."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index
        self.message = message


class BadColumn(Exception):
    """A whole column has the wrong type."""


def text_hash(text: str) -> str:
    """sha256 of the text's UTF-8 bytes, first 32 hex digits: default document id and source hash."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def ids_hash(token_ids: np.ndarray) -> str:
    """sha256 of the ids as little-endian int64 bytes, first 32 hex digits (pre-tokenized input)."""
    return hashlib.sha256(np.ascontiguousarray(token_ids, dtype="<i8").tobytes()).hexdigest()[:32]


def effective_columns(
    data, *, text_column, id_column, ids_column, chat_column=None, prompt_column=None
) -> ColumnChoice:
    """Resolve the column options: ids win over text; the sample corpus has an `id` column; prompts to
    answer (`build --generate`) are read as text from their own column."""
    if prompt_column:
        return ColumnChoice(text=prompt_column, ids=None, text_option="--prompt-column", **_id_column(id_column))
    if chat_column:
        if ids_column:
            raise DataError(
                "--chat-column and --ids-column exclude each other: conversations are rendered "
                "with the teacher's chat template, so they cannot be pre-tokenized"
            )
        return ColumnChoice(text=None, ids=None, chat=chat_column, **_id_column(id_column))
    if ids_column:
        return ColumnChoice(text=None, ids=ids_column, **_id_column(id_column))
    if not text_column:
        raise DataError("no text column and no ids column: give --text-column or --ids-column")
    return ColumnChoice(text=text_column, ids=None, **_id_column(id_column))


def _id_column(id_column: str | None) -> dict:
    """None -> the automatic `id` column; "" -> content hashes; else the column named."""
    if id_column is None:
        return {"id": AUTO_ID_COLUMN, "id_automatic": True}
    return {"id": id_column or None}


def check_columns(
    path: Path | HubDataset, names: list[str], roles: dict[str, str], *, header_row: bool = False
) -> None:
    """Refuse a file without a named column; drop the automatic id column from `roles` where absent."""
    for column, option in list(roles.items()):
        if column in names:
            continue
        if option == AUTOMATIC:
            del roles[column]
            continue
        header = " (the first row is taken as the header)" if header_row else ""
        raise DataError(f"{path}: no column {column!r} ({option}); its columns are: {_names(names)}{header}")


def _names(names: list[str], *, most: int = 8, width: int = 30) -> str:
    """Column names for a one-line message: a header row of text must not fill the screen."""
    cut = [n if len(n) <= width else n[: width - 3] + "..." for n in names[:most]]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(repr(n) for n in cut) + more


def batch_documents(
    batch: pa.RecordBatch, columns: ColumnChoice, *, path: Path | HubDataset, file_row: int, row: int
) -> Iterator[Document]:
    n = batch.num_rows

    def fail(index: int, message: str, doc_ids: list[str] | None) -> DataError:
        where = f"{path}: row {file_row + index}"
        if row != file_row:
            where += f" (input row {row + index})"
        if doc_ids is not None:
            where += f", document {doc_ids[index]!r}"
        return DataError(f"{where}: {message}")

    doc_ids = None
    tokens: list[np.ndarray] | list[None]
    texts: list[str | None]
    try:
        if columns.id is not None and columns.id in batch.schema.names:  # the automatic one may be absent
            doc_ids = _id_values(_column(batch, columns.id), columns.id)
        if columns.chat is not None:
            return (yield from _conversations(batch, columns.chat, doc_ids, fail, row=row))
        if columns.ids is not None:
            tokens, texts = _ids_values(_column(batch, columns.ids), columns.ids), [None] * n
        else:
            assert columns.text is not None, "effective_columns names a text column where no ids or chat one"
            tokens, texts = [None] * n, _text_values(_column(batch, columns.text), columns.text)
    except BadRow as bad:
        raise fail(bad.index, bad.message, doc_ids) from None
    except BadColumn as bad:
        raise DataError(f"{path}: {bad}") from None
    for i in range(n):
        text, token_ids = texts[i], tokens[i]
        if token_ids is not None:
            source = ids_hash(token_ids)
        elif text is None or not text.strip():
            what = "null" if text is None else "empty or whitespace-only"
            raise fail(i, f"text column {columns.text!r} is {what}", doc_ids)
        else:
            source = text_hash(text)
        doc_id = doc_ids[i] if doc_ids is not None else source
        yield Document(id=doc_id, text=text, token_ids=token_ids, source_hash=source, row=row + i)


def _conversations(batch: pa.RecordBatch, name: str, doc_ids, fail, *, row: int) -> Iterator[Document]:
    """Chat rows of column `name`: a list of {"role", "content"} per row (or its JSON text, as CSV holds it)."""
    column = _column(batch, name)
    t = column.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or _is_text_type(t) or pa.types.is_null(t)):
        raise DataError(f"chat column {name!r} holds {t}; each row must be a list of {{'role', 'content'}} messages")
    for i, value in enumerate(column.to_pylist()):  # one step per conversation
        problem = "is null" if value is None else message_problem(value)
        if problem:
            raise fail(i, f"chat column {name!r} {problem}", doc_ids)
        messages = as_messages(value)
        source = text_hash(conversation_hash_text(messages))
        doc_id = doc_ids[i] if doc_ids is not None else source
        yield Document(id=doc_id, text=None, token_ids=None, source_hash=source, row=row + i, messages=messages)


def _column(batch: pa.RecordBatch, name: str) -> pa.Array:
    column = batch.column(batch.schema.get_field_index(name))
    # Dictionary-encoded strings (Parquet, Arrow) read like plain ones.
    return column.dictionary_decode() if pa.types.is_dictionary(column.type) else column


def _is_text_type(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_binary_type(t: pa.DataType) -> bool:
    return (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
    )


def _as_utf8(column: pa.Array, name: str) -> pa.Array:
    """The column as valid UTF-8 strings; `BadRow` at the first invalid value."""
    try:
        if _is_text_type(column.type):
            column.validate(full=True)  # pyarrow does not check UTF-8 when reading JSON, Parquet, Arrow
            return column
        return pc.cast(column, pa.string())
    except pa.ArrowInvalid:
        raise BadRow(_first_invalid_utf8(column), f"column {name!r} is not valid UTF-8") from None


def _first_invalid_utf8(column: pa.Array) -> int:
    raw = column.cast(pa.large_binary()) if _is_text_type(column.type) else column
    for i, value in enumerate(raw.to_pylist()):
        try:
            if value is not None:
                value.decode("utf-8")
        except UnicodeDecodeError:
            return i
    return 0


def _first_null(column: pa.Array) -> int:
    return _first_true(column.is_null())


# Ids refused, naming the first row that holds one: (a pattern the id matches, why).
_ID_REFUSALS = (
    (
        CONTROL_CHARACTERS,
        "has a control character (a newline, tab, NUL, ...): ls would print it raw and show could not be "
        "given it; clean the id",
    ),
    (WINDOW_SUFFIX, "ends like a window id ('#w' and digits, reserved for the windows of long documents); rename it"),
)


def _id_values(column: pa.Array, name: str) -> list[str]:
    t = column.type
    if not (_is_text_type(t) or _is_binary_type(t) or pa.types.is_integer(t) or pa.types.is_null(t)):
        raise BadColumn(f"id column {name!r} holds {t}; ids must be strings or integers")
    if column.null_count:
        raise BadRow(_first_null(column), f"id column {name!r} is null")
    values = pc.cast(column, pa.string()) if pa.types.is_integer(t) else _as_utf8(column, name)
    empty = pc.equal(pc.utf8_length(values), 0)
    if pc.any(empty).as_py():
        raise BadRow(_first_true(empty), f"id column {name!r} is an empty string")
    for pattern, why in _ID_REFUSALS:
        found = pc.match_substring_regex(values, pattern=pattern)
        if pc.any(found).as_py():
            i = _first_true(found)
            raise BadRow(i, f"id column {name!r} holds {values[i].as_py()[:80]!r}, which {why}")
    return values.to_pylist()


def _first_true(mask: pa.Array) -> int:
    return int(np.flatnonzero(mask.to_numpy(zero_copy_only=False))[0])


def _text_values(column: pa.Array, name: str) -> list[str | None]:
    t = column.type
    if pa.types.is_null(t):
        return [None] * len(column)
    if not (_is_text_type(t) or _is_binary_type(t)):
        raise BadColumn(f"text column {name!r} holds {t}, not text")
    return _as_utf8(column, name).to_pylist()


def _ids_values(column: pa.Array, name: str) -> list[np.ndarray]:
    """One int64 array per row, from a list column or (CSV) a string column."""
    t = column.type
    if column.null_count:
        raise BadRow(_first_null(column), f"ids column {name!r} is null")
    if _is_text_type(t):
        return [_parse_ids(value, i, name) for i, value in enumerate(column.to_pylist())]
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        raise BadColumn(f"ids column {name!r} holds {t}, not lists of token ids")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = _integer_values(pc.list_flatten(column), offsets, name)
    if (lengths == 0).any():
        raise BadRow(int(np.flatnonzero(lengths == 0)[0]), f"ids column {name!r} is empty")
    return [values[offsets[i] : offsets[i + 1]].copy() for i in range(len(column))]


def _integer_values(flat: pa.Array, offsets: np.ndarray, name: str) -> np.ndarray:
    """The flattened ids as int64, checked in one vectorised pass; `BadRow` names the row."""

    def bad(value_index: int, message: str) -> BadRow:
        return BadRow(int(np.searchsorted(offsets, value_index, side="right") - 1), message)

    t = flat.type
    if flat.null_count:
        raise bad(_first_null(flat), f"ids column {name!r} holds a null token id")
    if pa.types.is_null(t) or len(flat) == 0:
        return np.zeros(0, dtype=np.int64)
    if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        raise BadColumn(f"ids column {name!r} holds lists of {t}, not integers")
    values = flat.to_numpy(zero_copy_only=False)
    if pa.types.is_floating(t):
        fractional = ~np.isfinite(values) | (values != np.round(values))
        if fractional.any():
            i = int(np.flatnonzero(fractional)[0])
            raise bad(i, f"ids column {name!r} holds a non-integer token id {float(values[i])}")
    if pa.types.is_unsigned_integer(t):
        too_big = values > _INT64_MAX
        if too_big.any():
            raise bad(int(np.flatnonzero(too_big)[0]), f"ids column {name!r} holds a token id beyond int64")
    elif (values < 0).any():
        i = int(np.flatnonzero(values < 0)[0])
        raise bad(i, f"ids column {name!r} holds a negative token id {int(values[i])}")
    return values.astype(np.int64)


def _parse_ids(value: str, index: int, name: str) -> np.ndarray:
    """'1 2 3', '1,2,3' or '[1, 2, 3]' -> int64 ids (how CSV, which has no lists, holds them)."""
    parts = value.strip().removeprefix("[").removesuffix("]").replace(",", " ").split()
    if not parts:
        raise BadRow(index, f"ids column {name!r} is empty")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise BadRow(index, f"ids column {name!r} holds a non-integer token id in {value[:40]!r}") from None
    if min(ids) < 0:
        raise BadRow(index, f"ids column {name!r} holds a negative token id {min(ids)}")
    if max(ids) > _INT64_MAX:
        raise BadRow(index, f"ids column {name!r} holds a token id beyond int64")
    return np.array(ids, dtype=np.int64)
