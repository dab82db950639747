"""The build's planning: documents -> tokens -> windows -> samples -> units, with nothing computed yet.

`plan_units` reads the input (`inputs.read_documents`), tokenizes each batch of documents with the
teacher's tokenizer (and every student tokenizer, aligned to it: `align.py`; chat data through the
chat template: `logitstore.text.chat`), cuts each document into windows (`window`) and groups their
samples into units of about `unit_tokens` tokens in input order, leaving out units the branch already
holds (`StoredDocuments`). The build driver (`build.py`) runs a teacher over the units and writes them;
live mode (`live/teacher.py`) plans the same samples and hands them to a teacher beside the trainer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from logitstore.format.sparsity import Sparsity, SparsityFlags
from logitstore.pipelines import align, inputs
from logitstore.pipelines.config import BuildError, PlanConfig
from logitstore.pipelines.workers import Unit
from logitstore.store.documents import document_id, document_ids
from logitstore.store.meta import StudentTokenizer
from logitstore.text import chat
from logitstore.text.tokenizer_io import json_hash, load_tokenizer, parse_tokenizer_spec, tokenizer_json

if TYPE_CHECKING:
    from logitstore.pipelines.generate import Generated, Generation


class PlanCounts(Protocol):
    """What planning leaves out, counted as it reads (the build's `BuildSummary` reports these)."""

    skipped: int
    no_completion: int
    tool_calls: int
    duplicates: int
    already_stored: int
    changed: int


class _Uncounted:
    """Counts nobody reads (live mode plans without a summary)."""

    skipped = no_completion = tool_calls = duplicates = already_stored = changed = 0
    prompts = answers = generated_tokens = answers_cut = answers_retokenized = answers_empty = 0


def window(token_ids: np.ndarray, *, max_length: int) -> list[np.ndarray]:
    """Cut a document's tokens into the windows the teacher sees, at most `max_length` tokens each.

    A document of <= max_length tokens is one window, itself. A longer one is cut into windows of
    max_length tokens starting every max_length - 1 tokens, so consecutive windows share exactly one
    token and every next-token transition (t -> t+1) is predicted in exactly one window. The model's
    context restarts at each window: the first predictions of a later window see at most a short
    context. The last window may be shorter, but always holds at least 2 tokens (a 1-token tail would
    hold no transition that the previous window does not already predict). Windows are views into
    `token_ids`. Raises `inputs.DataError` if max_length < 2 (a window must hold a transition).
    """
    if max_length < 2:
        raise inputs.DataError(f"--max-length must be at least 2 tokens, got {max_length}")
    token_ids = np.asarray(token_ids)
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
    n = len(token_ids)
    if n <= max_length:
        return [token_ids]
    # Window k predicts transitions k*(L-1) .. k*(L-1)+L-2; starts stop before the last token so
    # the final window always holds at least one transition.
    starts = np.arange(0, n - 1, max_length - 1)
    return [token_ids[s : s + max_length] for s in starts]


def window_ids(doc_id: str, n_windows: int) -> list[str]:
    """Sample ids of a document's windows: the document id itself for one window, else
    `<doc_id>#w<i>` for window i = 0 .. n_windows-1. Document ids that end like a window id are
    refused on input (`documents.WINDOW_SUFFIX`), so a sample id names one document and one window."""
    if n_windows < 1:
        raise ValueError(f"n_windows must be >= 1, got {n_windows}")
    if n_windows == 1:
        return [doc_id]
    return [f"{doc_id}#w{i}" for i in range(n_windows)]


def check_teacher_fits(info, *, sparsity: Sparsity | SparsityFlags, max_length: int) -> None:
    """Options that the teacher's config alone can refuse, before anything is read or loaded (a sparsity
    left to the engine's default, not settled yet, has nothing to refuse)."""
    if isinstance(sparsity, Sparsity) and not sparsity.sampled and sparsity.k > info.vocab_size:
        raise BuildError(f"--top-k {sparsity.k} is larger than the teacher's vocabulary ({info.vocab_size})")
    if info.max_positions is not None and max_length > info.max_positions:
        raise BuildError(
            f"--max-length {max_length} exceeds the teacher's context of {info.max_positions} "
            f"tokens (its config's max_position_embeddings); use at most {info.max_positions}"
        )


@dataclass
class StoredDocuments:
    """What the branch already holds of one teacher, by document: a rerun skips what is stored, and
    notices a document whose text changed under the same id (its source hash differs)."""

    sample_ids: set[str] = field(default_factory=set)
    source_of: dict[str, str | None] = field(default_factory=dict)  # document id -> its windows' source hash
    ids_of: dict[str, list[str]] = field(default_factory=dict)  # document id -> its stored sample ids
    # stored sample ids of replaced documents (`forget`) that no unit carries yet: the next unit planned
    # takes them (`take_removals`), so they are removed with it; what is left at the input's end (a
    # document whose new text yields no window) the driver removes in its last commit
    removals: list[str] = field(default_factory=list)

    MIXED = ""  # a document whose stored windows disagree on their source hash

    @classmethod
    def from_index(cls, index: pa.Table, *, teacher: str) -> StoredDocuments:
        rows = index.filter(pc.equal(index["teacher"], teacher))
        sample_ids = rows["sample_id"].to_pylist()
        documents = document_ids(rows["sample_id"]).to_pylist()
        out = cls(sample_ids=set(sample_ids))
        for sid, doc, source in zip(sample_ids, documents, rows["source_hash"].to_pylist()):  # per sample, once
            out.ids_of.setdefault(doc, []).append(sid)
            if out.source_of.setdefault(doc, source) != source:
                out.source_of[doc] = cls.MIXED
        return out

    def changed(self, doc) -> bool:
        """Stored under `doc.id` with other text. A source hash the store does not know (samples written
        through the library without one) counts as unchanged."""
        stored = self.source_of.get(doc.id)
        return stored is not None and stored != doc.source_hash

    def forget(self, doc_id: str) -> None:
        """Treat the document as not stored; its stored sample ids join the `removals`."""
        ids = self.ids_of.pop(doc_id, [])
        self.sample_ids.difference_update(ids)
        self.source_of.pop(doc_id, None)
        self.removals += ids

    def take_removals(self) -> list[str]:
        taken, self.removals = self.removals, []
        return taken


def plan_units(
    cfg: PlanConfig,
    tokenizer,
    *,
    stored: StoredDocuments | None = None,
    counts: PlanCounts | None = None,
    students: Sequence[StudentSide] = (),
    vocab_size: int | None = None,
    planned: Planned | None = None,
    generation: Generation | None = None,
) -> Iterator[Unit]:
    """Units of about `unit_tokens` tokens in input order, skipping units already stored. A long
    document's windows fill as many units as they need, so commits keep coming. What was left out is
    counted in `counts` (the build's summary); `planned` counts the documents read and the tokens of
    their windows still to compute, as they are read (the build's progress). With `generation`, the
    documents are prompts and the samples their generated answers (`_plan_answers`)."""
    stored = stored if stored is not None else StoredDocuments()
    summary = counts if counts is not None else _Uncounted()
    planned = planned if planned is not None else Planned()
    if generation is not None:
        generation.carry_as_text(tokenizer, students)
        yield from _plan_answers(cfg, tokenizer, generation, stored=stored, summary=summary, planned=planned)
        return
    pending = Unit(index=0)
    seen: set[str] = set()
    drop_tool_calls = bool(cfg.chat_column) and not chat.renders_tool_calls(tokenizer)
    for doc_batch in _batched(cfg.documents(), 256, max_chars=TOKENIZE_CHARS, start=16):
        if drop_tool_calls:  # their calls would vanish from an empty reply: skipped and counted instead
            kept = [doc for doc in doc_batch if not chat.has_tool_calls(doc.messages)]
            summary.tool_calls += len(doc_batch) - len(kept)
            pending.documents_read += len(doc_batch) - len(kept)
            planned.documents += len(doc_batch) - len(kept)
            doc_batch = kept
            if not doc_batch:
                continue
        if cfg.chat_column:
            tokenized = _tokenize_chat(tokenizer, doc_batch, students)
        elif students:
            tokenized = _tokenize_aligned(tokenizer, doc_batch, students)
        else:
            tokenized = _tokenize(tokenizer, doc_batch)
        for doc, (token_ids, alignments, loss_mask) in zip(doc_batch, tokenized):
            pending.documents_read += 1
            planned.documents += 1
            if doc.id in seen:
                summary.duplicates += 1
                continue
            seen.add(doc.id)
            if loss_mask is not None and not loss_mask[1:].any():
                summary.no_completion += 1
                continue
            _check_token_ids(doc, token_ids, vocab_size=vocab_size)
            if stored.changed(doc):
                summary.changed += 1
                if cfg.on_duplicate == "skip":
                    continue
                _replace(doc, stored, cfg)
            windows = window(token_ids, max_length=cfg.max_length) if len(token_ids) >= 2 else []
            if not windows:
                summary.skipped += 1
                continue
            starts = np.arange(len(windows)) * (cfg.max_length - 1)  # window's stride
            planned.tokens += sum(len(w) for w in windows)  # one step per window, as below
            for sid, win, start in zip(window_ids(doc.id, len(windows)), windows, starts.tolist()):
                pending.add(
                    sid,
                    win,
                    doc.source_hash,
                    students=_window_students(alignments, t_start=start, t_stop=start + len(win)),
                    loss_mask=None if loss_mask is None else loss_mask[start : start + len(win)],
                )
                if pending.n_tokens >= cfg.unit_tokens:
                    yield from _unless_stored(pending, stored, summary, planned)
                    pending = Unit(index=pending.index + 1)
    if pending.sample_ids:
        yield from _unless_stored(pending, stored, summary, planned)


def _plan_answers(
    cfg: PlanConfig, tokenizer, generation: Generation, *, stored: StoredDocuments, summary, planned: Planned
) -> Iterator[Unit]:
    """Units of generated answers: each prompt's answer documents (`PROMPTID/gN`) are checked against
    the store (stored: skipped; stored by another generation: `--on-duplicate`) before any is
    generated, then the rest are generated and planned as one-window samples (with each student
    tokenizer's side, where the build has any: `retokenize`)."""
    pending = Unit(index=0)
    seen: set[str] = set()
    for doc_batch in _batched(cfg.documents(), generation.prompts_per_call, max_chars=TOKENIZE_CHARS):
        pending.documents_read += len(doc_batch)
        planned.documents += len(doc_batch)
        wanted = []
        for doc, prompt in zip(doc_batch, generation.prompt_tokens(tokenizer, doc_batch)):
            if doc.id in seen:
                summary.duplicates += 1
                continue
            seen.add(doc.id)
            summary.prompts += 1
            for answer in generation.answer_documents(doc):
                if stored.changed(answer):
                    summary.changed += 1
                    if cfg.on_duplicate == "skip":
                        continue
                    _replace(answer, stored, cfg)
                elif answer.id in stored.sample_ids:
                    summary.already_stored += 1
                    continue
                wanted.append((answer, prompt))
        for answer, tokens, mask, students in generation.answer(wanted, counts=summary):
            planned.tokens += len(tokens)
            pending.add(
                answer.id,
                tokens,
                answer.source_hash,
                students=students,
                loss_mask=mask,
                prompt=generation.prompt_of(answer),
            )
            if pending.n_tokens >= cfg.unit_tokens:
                yield from _unless_stored(pending, stored, summary, planned)
                pending = Unit(index=pending.index + 1)
    if pending.sample_ids:
        yield from _unless_stored(pending, stored, summary, planned)


def _replace(doc, stored: StoredDocuments, cfg: PlanConfig) -> None:
    """A document stored with other text: its stored ids queued for removal (--on-duplicate replace), or the error."""
    if cfg.on_duplicate == "replace":
        stored.forget(doc.id)
        return
    raise BuildError(changed_text(doc.id, stored=stored.source_of[doc.id], new=doc.source_hash, row=doc.row))


def changed_text(
    sample_id: str, *, stored: str | None, new: str | None, row: int | None = None, concurrent: bool = False
) -> str:
    """The one line for a document stored under its id with other text (`sample_id`: the document's id or
    one of its windows'): found in the branch when the build planned it, or (`concurrent`) in what
    another build committed while this one ran."""
    doc = document_id(sample_id)
    where = "" if row is None else f" (input row {row})"
    when = ", by another build while this one ran" if concurrent else ""
    return (
        f"document {doc!r}{where} is stored with other text{when} (source hash {stored or 'windows of mixed sources'}, "
        f"now {new}); pass --on-duplicate replace to recompute it, or skip to keep the stored one"
    )


def _check_token_ids(doc, token_ids: np.ndarray, *, vocab_size: int | None) -> None:
    """Pre-tokenized ids must be the teacher's: checked here, with the row, before any model loads."""
    if vocab_size is not None and doc.token_ids is not None and len(token_ids) and int(token_ids.max()) >= vocab_size:
        raise BuildError(
            f"document {doc.id!r} (input row {doc.row}): token id {int(token_ids.max())} is beyond the "
            f"teacher's vocabulary ({vocab_size} ids)"
        )


def _unless_stored(unit: Unit, stored: StoredDocuments, summary: PlanCounts, planned: Planned) -> Iterator[Unit]:
    """The unit, unless the branch holds all of its samples; it carries the removals queued so far. A
    unit skipped here counts as already stored; of a unit computed, the writer leaves out (and counts)
    what the branch holds by the time it is merged (`StoreWriter`'s on_duplicate="skip")."""
    known = sum(sid in stored.sample_ids for sid in unit.sample_ids)
    if known == len(unit.sample_ids):
        summary.already_stored += known
        planned.tokens -= unit.n_tokens  # stored: nothing to compute
    else:
        unit.replaces = stored.take_removals()
        yield unit


# A document tokenized: the teacher's ids, per student tokenizer its alignment, and (chat data) the loss mask.
_Tokenized = tuple[np.ndarray, dict, np.ndarray | None]


def _tokenize(tokenizer, docs: list) -> list[_Tokenized]:
    texts = [d.text for d in docs if d.token_ids is None]
    encoded = iter(encode_ids(tokenizer, texts)) if texts else iter(())
    return [
        (np.asarray(d.token_ids if d.token_ids is not None else next(encoded), dtype=np.int64), {}, None) for d in docs
    ]


def encode_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts)["input_ids"]`, the same ids: through the Rust tokenizer's `encode_batch_fast`
    where `tokenizer` is a fast one set as `__call__` would set it (no truncation, no padding, special
    tokens as its `split_special_tokens` says). It tracks no offsets and makes no Python object per token:
    ~30% less of the build's planning time, which runs beside the teacher on the host's cores."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not _set_as_call_sets(tokenizer, backend):
        return tokenizer(texts)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=True)]


def _set_as_call_sets(tokenizer, backend) -> bool:
    return (
        hasattr(backend, "encode_batch_fast")
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))
    )


def _tokenize_chat(tokenizer, docs: list, students: Sequence[StudentSide] = ()) -> list[_Tokenized]:
    """Conversations rendered by the teacher's chat template: ids and the loss mask (`logitstore.text.chat`),
    and per student tokenizer its ids, the groups and its own mask of the same spans: a student token
    is supervised iff its bytes lie inside an assistant span."""
    rendered = []
    for doc in docs:  # one template render per turn of each conversation
        try:
            rendered.append(chat.render(tokenizer, doc.messages))
        except chat.ChatError as e:
            raise BuildError(f"document {doc.id!r} (input row {doc.row}): {e}") from None
    texts = [text for text, _ in rendered]
    encoded = align.encode_with_byte_ends(tokenizer, texts, add_special_tokens=False)
    per_student = [align.encode_with_byte_ends(st.tokenizer, texts, add_special_tokens=False) for st in students]
    out: list[_Tokenized] = []
    for i, ((ids, ends), (text, spans)) in enumerate(zip(encoded, rendered)):
        byte_spans = chat.byte_spans(text, spans)
        alignments = {}
        for st, student_encoded in zip(students, per_student):
            s_ids, s_ends = student_encoded[i]
            alignments[st.registration.name] = (
                s_ids,
                align.align_groups(ends, s_ends),
                chat.token_mask(s_ends, byte_spans),
            )
        out.append((ids, alignments, chat.token_mask(ends, byte_spans)))
    return out


# -- student tokenizers: cross-tokenizer alignment -----------------------------------------------------


@dataclass
class StudentSide:
    """A student tokenizer of this build: the tokenizer, and what the store registers for it."""

    tokenizer: object
    registration: StudentTokenizer


def load_student_tokenizers(specs: tuple[str, ...], *, teacher) -> list[StudentSide]:
    """Parse and load every `--student-tokenizer [NAME=]TOK`, and map the teacher's vocabulary onto each."""
    out: list[StudentSide] = []
    for spec in specs:
        name, path = parse_tokenizer_spec(spec)
        if name in [s.registration.name for s in out]:
            raise BuildError(f"--student-tokenizer: two tokenizers are named {name!r}; name them with NAME=TOK")
        tokenizer = load_tokenizer(path)
        vmap = align.vocab_map(teacher.tokenizer, tokenizer, teacher_vocab_size=teacher.vocab_size)
        text = tokenizer_json(tokenizer)
        registration = StudentTokenizer(
            name=name,
            tokenizer_hash=json_hash(text),
            vocab_size=len(tokenizer),
            tokenizer_json=text,
            vocab_map=vmap,
        )
        out.append(StudentSide(tokenizer=tokenizer, registration=registration))
    return out


def _tokenize_aligned(tokenizer, docs: list, students: Sequence[StudentSide]) -> list[_Tokenized]:
    """Teacher ids of each document, and per student tokenizer its ids and the whole document's groups."""
    texts = [d.text for d in docs]
    teacher = align.encode_with_byte_ends(tokenizer, texts)
    per_student = [align.encode_with_byte_ends(st.tokenizer, texts) for st in students]
    out: list[_Tokenized] = []
    for i, (t_ids, t_ends) in enumerate(teacher):
        alignments = {}
        for st, encoded in zip(students, per_student):
            s_ids, s_ends = encoded[i]
            alignments[st.registration.name] = (s_ids, align.align_groups(t_ends, s_ends))
        out.append((t_ids, alignments, None))
    return out


def _window_students(alignments: dict, *, t_start: int, t_stop: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each student's ids and groups for the window of teacher tokens [t_start, t_stop)."""
    out = {}
    for name, (s_ids, groups, *mask) in alignments.items():  # chat data: a third element, the student's mask
        window, s_start, s_stop = align.window_groups(groups, t_start=t_start, t_stop=t_stop)
        out[name] = (s_ids[s_start:s_stop], window, *(m[s_start:s_stop] for m in mask))
    return out


def _batched(documents: Iterator, size: int, *, max_chars: int, start: int | None = None) -> Iterator[list]:
    """Batches of at most `size` documents and, past their first, `max_chars` characters: what one
    tokenizer call holds in memory. A document longer than `MAX_DOCUMENT_CHARS` is refused here. With
    `start`, the first batch holds at most `start` documents and each next one twice as many, up to `size`:
    the first unit is read without tokenizing ahead of it (the build's start-up)."""
    batch: list = []
    chars = 0
    limit = size if start is None else min(start, size)
    for doc in documents:
        n = _chars(doc)
        if n > MAX_DOCUMENT_CHARS:
            raise BuildError(
                f"document {doc.id!r} (input row {doc.row}) has {n:,} characters, more than the "
                f"{MAX_DOCUMENT_CHARS:,} one document may have (tokenizing it whole takes ~{n * 90 / 1e9:.1f} GB); "
                "split it into several documents"
            )
        if batch and (len(batch) == limit or chars + n > max_chars):
            yield batch
            batch, chars, limit = [], 0, min(2 * limit, size)
        batch.append(doc)
        chars += n
    if batch:
        yield batch


def _chars(doc) -> int:
    if doc.text is not None:
        return len(doc.text)
    return sum(len(m.get("content") or "") for m in doc.messages or ())  # pre-tokenized input: 0


# What a fast tokenizer holds while it tokenizes: ~90 bytes per character (a 42 MB one-line document takes
# 3.8 GB RSS). A tokenizer call gets at most TOKENIZE_CHARS characters (~0.4 GB), one
# document at most MAX_DOCUMENT_CHARS (~1.4 GB, with its windows: ~4 bytes per character as ids).
TOKENIZE_CHARS = 4_000_000
MAX_DOCUMENT_CHARS = 16_000_000


@dataclass
class Planned:
    """What the planner has read so far: documents, and the tokens of their windows still to compute.
    Written by the planner thread, read by the progress clock (plain ints: no lock needed)."""

    documents: int = 0
    tokens: int = 0
    generated: Generated | None = None  # build --generate: the answers' tokens and the seconds they took
