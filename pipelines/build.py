"""Stage one: `logitstore build` runs a teacher over a dataset and commits its sparse distributions.

The driver (this process) streams documents, tokenizes and windows them, and groups the samples into
*units* of about `unit_tokens` tokens in input order. A unit is the unit of everything: one worker
computes it (sorting its samples by length and batching them by token budget), writes it as one part,
and it becomes visible in one commit. Units depend only on the input, never on the worker count, so
the stored bytes are identical for 1, 2 or N workers and for a resumed build.

Resuming: a unit whose samples are all in the branch already is skipped before any teacher work, so
re-running a killed build with the same arguments recomputes nothing committed and duplicates nothing.
The driver commits every `commit_every` seconds, so a crash loses at most that much work.

Workers: in-process (`workers=1`), local processes (`workers=N`, spawn), or Ray actors
(`ray_address`), each holding one teacher. Remote workers write into Icechunk forks that the driver
merges; in-process writes go straight into the driver's transaction.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from logitstore import align, chat, codec
from logitstore.ahead import read_ahead
from logitstore.data import SAMPLE_CHAT
from logitstore.errors import ConflictError, LogitstoreError
from logitstore.location import Location
from logitstore.pipelines import inputs
from logitstore.pipelines.engines import engine_class
from logitstore.pipelines.workers import Unit, make_executor, worker_settings, write_unit
from logitstore.sparsity import Sparsity, default_sparsity
from logitstore.store import DEFAULT_BRANCH, NAME, Store, StudentTokenizer, TeacherMeta
from logitstore.tokenizer_io import load_tokenizer, parse_tokenizer_spec, tokenizer_hash

DEFAULT_STORE = "logitstore-store"
DTYPES = ("auto", "float32", "bfloat16", "float16")  # the teacher's weights; auto: bf16 on GPU, fp32 on CPU
ON_DUPLICATE = ("error", "replace", "skip")  # a document stored before under its id, with other text


class BuildError(LogitstoreError):
    """A build cannot start or continue: bad options, or a teacher that does not fit the store."""


@dataclass
class BuildConfig:
    """Everything `logitstore build` takes. Validated on construction; errors name the flag."""

    store: str = DEFAULT_STORE
    teacher: str | None = None
    data: str | inputs.HubDataset | None = None  # a path, or a datasets name (`inputs.dataset_source`)
    text_column: str = "text"
    id_column: str | None = None
    ids_column: str | None = None
    max_length: int = 1024
    sparsity: Sparsity | None = None  # None: default_sparsity() (sampled 16; top-64 with student tokenizers or vLLM)
    batch_tokens: int = 8192
    device: str = "auto"
    dtype: str = "auto"
    workers: int = 1
    ray_address: str | None = None
    message: str | None = None
    branch: str = DEFAULT_BRANCH
    commit_every: float = 300.0
    unit_tokens: int = 16384  # tokens per unit: the grain of work, of parts and of resuming
    seed: int = 0
    engine: str = "torch"  # a teacher engine (`pipelines/engines/`)
    tensor_parallel: int = 1  # GPUs per engine (the vLLM engine)
    teacher_name: str | None = None  # the name the teacher is stored under; default: its folder's or file's
    progress: bool = True
    student_tokenizers: tuple[str, ...] = ()  # "[NAME=]TOK" each: align every sample to these too
    on_duplicate: str = "error"  # a document stored with other text: error, replace (recompute) or skip (keep)
    limit: int | None = None  # read only the input's first N documents: a quick trial of a large input
    chat_column: str | None = None  # conversations ({"role", "content"} lists), rendered by the chat template
    train_on: str = "completion"  # chat data: teacher entries for the completion only, or prompt+completion

    def __post_init__(self) -> None:
        if self.data is None and self.chat_column:  # the shipped chat sample, as the text sample corpus for text
            self.data = str(SAMPLE_CHAT)
        Location.parse(self.store)  # a --store that cannot be one (a file, a bad scheme): refused before anything loads
        engine = engine_class(self.engine)  # an unknown --engine is refused here, naming the engines
        if self.sparsity is None:  # the library and the CLI share one default
            self.sparsity = default_sparsity(
                student_tokenizers=bool(self.student_tokenizers), engine_samples=engine.samples
            )
        checks = [
            (
                not (self.student_tokenizers and self.ids_column),
                "--student-tokenizer needs text to align; it cannot be used with --ids-column (pre-tokenized input)",
            ),
            (self.max_length >= 2, f"--max-length must be at least 2, got {self.max_length}"),
            (self.batch_tokens >= 2, f"--batch-tokens must be at least 2, got {self.batch_tokens}"),
            (self.workers >= 1, f"--workers must be at least 1, got {self.workers}"),
            (self.commit_every > 0, f"--commit-every must be positive, got {self.commit_every}"),
            (self.unit_tokens >= 1, f"--unit-tokens must be at least 1, got {self.unit_tokens}"),
            (self.limit is None or self.limit >= 1, f"--limit must be at least 1, got {self.limit}"),
            (
                self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"),
                f"--device must be auto, cpu or cuda[:N], got {self.device!r}",
            ),
            (self.tensor_parallel >= 1, f"--tensor-parallel must be at least 1, got {self.tensor_parallel}"),
            (
                self.teacher_name is None or NAME.fullmatch(self.teacher_name) is not None,
                f"--teacher-name {self.teacher_name!r}: use letters, digits, '.', '_' and '-' (at most 128)",
            ),
            (self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
            (
                self.on_duplicate in ON_DUPLICATE,
                f"--on-duplicate must be one of {', '.join(ON_DUPLICATE)}, got {self.on_duplicate!r}",
            ),
            (
                self.train_on in chat.TRAIN_ON,
                f"--train-on must be one of {', '.join(chat.TRAIN_ON)}, got {self.train_on!r}",
            ),
            (
                self.chat_column is not None or self.train_on == "completion",
                "--train-on applies to chat data (--chat-column); a plain text store supervises every token",
            ),
            (
                not (self.chat_column and self.ids_column),
                "--chat-column and --ids-column exclude each other: conversations are rendered by the chat template",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise BuildError(message)


@dataclass
class BuildSummary:
    """The `--json` summary. `samples`/`tokens` count what this run wrote."""

    samples: int = 0
    tokens: int = 0
    skipped: int = 0  # documents too short to predict anything (< 2 tokens)
    no_completion: int = 0  # conversations whose rendering holds no assistant token (skipped)
    tool_calls: int = 0  # conversations with tool calls that the teacher's chat template does not render (skipped)
    duplicates: int = 0  # documents whose id appeared earlier in the input
    already_stored: int = 0  # samples committed by an earlier (interrupted) run of the build
    changed: int = 0  # documents stored before with other text: replaced or kept, by --on-duplicate
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    bytes_per_token: float | None = None
    version: str | None = None  # the branch's version after the build; None: nothing stored, nothing made
    teacher: str = ""
    commits: int = 0
    stored_bytes: int = 0  # compressed bytes of the parts this run wrote
    teachers: list = field(default_factory=list)  # each teacher's own summary (one with one --teacher)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def own_json(self) -> dict:
        """One teacher's part of a build's `teachers` list: its summary less that list."""
        return {k: v for k, v in self.to_json().items() if k != "teachers"}


def run_build(cfg: BuildConfig, *, log: Callable[[str], None] | None = None) -> BuildSummary:
    """Run the whole build; returns the summary. Raises `LogitstoreError`s for user errors."""
    from logitstore.pipelines.teacher import describe_teacher  # torch and transformers: 2.7 s, after the input checks

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    start = time.perf_counter()
    # The input first (exists, columns, first rows): a mistake there shows in a second, before any model
    # loads and before a store is created.
    ids_from = inputs.check_input(
        cfg.data,
        text_column=cfg.text_column,
        id_column=cfg.id_column,
        ids_column=cfg.ids_column,
        chat_column=cfg.chat_column,
    )
    info = describe_teacher(cfg.teacher)
    if cfg.teacher_name is not None:
        info = dataclasses.replace(info, spec=dataclasses.replace(info.spec, name=cfg.teacher_name))
    check_teacher_fits(cfg, info)
    engine, settings = engine_class(cfg.engine), worker_settings(cfg, teacher_spec=info.spec)
    engine.check(settings, info.spec)  # e.g. vLLM missing, or no GPU: one line, before anything is written
    students = load_student_tokenizers(cfg.student_tokenizers, teacher=info)
    # The store (and a new branch) is made only with the first commit: a build that fails before leaves
    # no empty store or branch behind.
    store = Store.open_if_exists(cfg.store)
    sparsity = _sparsity(cfg)
    meta = info.store_meta(
        sparsity,
        loss_mask=cfg.train_on if cfg.chat_column else None,
        engine=engine.name,
        dtype=engine.resolved_dtype(settings),
        engine_version=engine.version(),
    )
    summary = BuildSummary(teacher=meta.name)
    stored = _stored_documents(store, cfg, meta, students)
    planned = Planned()
    units = plan_units(
        cfg,
        info.tokenizer,
        stored=stored,
        summary=summary,
        students=students,
        vocab_size=info.vocab_size,
        planned=planned,
    )
    log(f"build: sample ids are {ids_from}")
    progress = Progress(cfg, log=log, planned=planned)  # on its clock from here, also while the input is tokenized
    try:
        first = next(units, None)  # reads and checks the input before any model is loaded
        if first is None and stored.removals:  # only documents replaced by text too short for a window
            with _store_and_branch(store, cfg).writer(branch=cfg.branch) as writer:
                writer.remove(meta.name, stored.take_removals())
                _commit(writer, cfg, summary, final=True)
        if first is not None:
            store = _compute(
                store, cfg, first, units, summary, progress, meta=meta, info=info, students=students, stored=stored
            )
    finally:
        progress.close()
    # Nothing to write makes nothing: no store, no branch (version None in the summary).
    summary.version = store.read(cfg.branch).snapshot_id if store and cfg.branch in store.branches() else None
    summary.seconds = time.perf_counter() - start
    summary.tokens_per_second = summary.tokens / summary.seconds if summary.seconds else 0.0
    summary.bytes_per_token = summary.stored_bytes / summary.tokens if summary.tokens else None
    return summary


def _compute(
    store, cfg, first: Unit, units: Iterator[Unit], summary, progress, *, meta, info, students, stored
) -> Store:
    """Load the teacher and compute, write and commit every unit; returns the store (created if new)."""
    executor = make_executor(cfg, teacher_spec=info.spec, on_batch=progress.batch)
    try:
        head = [first]
        new_teacher = store is None or meta.name not in store.read(_base_branch(store, cfg)).teachers
        samples = executor.compute(first) if new_teacher else None
        store = _store_and_branch(store, cfg)
        if new_teacher and _add_teacher_with_first_unit(
            store, cfg, meta, info, first, samples, summary, students=students
        ):
            head = []
            progress.update(tokens=first.n_tokens, samples=len(first.sample_ids), documents=first.documents_read)
        _process(store, cfg, head, units, executor, summary, progress, stored=stored)
        progress.finish()
    finally:
        executor.close()
    return store


def run_builds(
    cfg: BuildConfig, teachers: list[str | None], *, log: Callable[[str], None] | None = None
) -> BuildSummary:
    """`build --teacher A --teacher B ...`: one pass over the data per teacher, in order, each its own
    commits on the same branch (so a crash in B keeps A's work, and a re-run skips what is stored).
    The summary adds the teachers up; `teachers` holds each one's own summary."""
    from logitstore.pipelines.teacher import describe_teacher  # torch and transformers: 2.7 s, after the input checks

    if len(teachers) <= 1:
        summary = run_build(dataclasses.replace(cfg, teacher=teachers[0] if teachers else cfg.teacher), log=log)
        summary.teachers = [summary.own_json()]  # the same fields as with several teachers
        return summary
    if cfg.teacher_name is not None:
        raise BuildError(
            "--teacher-name names one teacher; with several --teacher, each is named by its folder or file"
        )
    names = [describe_teacher(t).spec.name for t in teachers]  # every teacher loads before any work starts
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise BuildError(
            f"--teacher: several teachers are named {clash[0]!r} (the name is the model folder's or "
            "file's name); put them in folders with distinct names"
        )
    parts = [run_build(dataclasses.replace(cfg, teacher=t), log=log) for t in teachers]
    total = BuildSummary(
        teacher=",".join(names),
        skipped=parts[0].skipped,
        no_completion=parts[0].no_completion,
        tool_calls=parts[0].tool_calls,
        duplicates=parts[0].duplicates,
        version=parts[-1].version,
        teachers=[p.own_json() for p in parts],
    )
    for p in parts:
        total.samples += p.samples
        total.tokens += p.tokens
        total.already_stored += p.already_stored
        total.changed += p.changed
        total.seconds += p.seconds
        total.commits += p.commits
        total.stored_bytes += p.stored_bytes
    total.tokens_per_second = total.tokens / total.seconds if total.seconds else 0.0
    total.bytes_per_token = total.stored_bytes / total.tokens if total.tokens else None
    return total


def check_teacher_fits(cfg: BuildConfig, info) -> None:
    """Options that the teacher's config alone can refuse, before anything is read or loaded."""
    sparsity = _sparsity(cfg)
    if not sparsity.sampled and sparsity.k > info.vocab_size:
        raise BuildError(f"--top-k {sparsity.k} is larger than the teacher's vocabulary ({info.vocab_size})")
    if info.max_positions is not None and cfg.max_length > info.max_positions:
        raise BuildError(
            f"--max-length {cfg.max_length} exceeds the teacher's context of {info.max_positions} "
            f"tokens (its config's max_position_embeddings); use at most {info.max_positions}"
        )


def _sparsity(cfg: BuildConfig) -> Sparsity:
    """The build's sparsity: None in a `BuildConfig` only asks for the default, which construction fills in."""
    assert cfg.sparsity is not None, "BuildConfig.__post_init__ sets the default sparsity"
    return cfg.sparsity


def _store_and_branch(store: Store | None, cfg: BuildConfig) -> Store:
    """The store, created if missing, with the build's branch (a new one starts from main)."""
    store = store or Store.open(cfg.store, create=True)
    if cfg.branch not in store.branches():
        store.create_branch(cfg.branch)
    return store


def _base_branch(store: Store, cfg: BuildConfig) -> str:
    """The build's branch, or main where the branch is not made yet (it will start from main)."""
    return cfg.branch if cfg.branch in store.branches() else DEFAULT_BRANCH


def _stored_documents(
    store: Store | None, cfg: BuildConfig, meta: TeacherMeta, students: list[StudentSide]
) -> StoredDocuments:
    """What the branch holds of this teacher (a branch not made yet: what main holds, which it will
    start from), after checking that the stored teacher is this one."""
    if store is None:
        return StoredDocuments()
    with store.writer(branch=_base_branch(store, cfg), on_duplicate="skip") as writer:
        if meta.name in writer.teachers:
            # only checks: refuses a different teacher, tokenizer, sparsity or set of student tokenizers
            writer.add_teacher(meta, students=[st.registration for st in students])
        return StoredDocuments.from_index(store.read_index(writer.base_snapshot), teacher=meta.name)


def _add_teacher_with_first_unit(
    store: Store,
    cfg: BuildConfig,
    meta: TeacherMeta,
    info,
    unit: Unit,
    samples,
    summary: BuildSummary,
    *,
    students: list[StudentSide],
) -> bool:
    """Register the teacher and write the first unit in one commit. The codec's id order and the
    mapped share of each student tokenizer come from the teacher's entries on that unit, so they cost
    no extra forward pass; forks, which cannot create the shared teacher group, start after this commit.

    Returns False when a concurrent build registered the teacher first: then this build goes on as a
    resumed one (the first unit is computed again against the winner's id order, and what the winner
    stored is skipped)."""
    assert not unit.replaces, "a teacher new to the branch has no stored documents to replace"
    code_of_id = codec.frequency_id_order(samples.entry_ids, vocab_size=meta.vocab_size)
    registrations = [
        dataclasses.replace(st.registration, **_mapped_mass(samples, st.registration.vocab_map)) for st in students
    ]
    with store.writer(branch=cfg.branch) as writer:
        if meta.name in writer.teachers:  # registered by a concurrent build since this one looked
            writer.add_teacher(meta, students=[st.registration for st in students])  # only checks it is this one
            return False
        writer.add_teacher(
            meta,
            tokenizer_json=info.tokenizer.backend_tokenizer.to_str(),
            code_of_id=code_of_id,
            students=registrations,
        )
        writer.merge(write_unit(writer.part_writer(), unit, samples, teacher=meta.name))
        try:
            writer.commit(cfg.message or f"build: teacher {meta.name} (first unit)")
        except ConflictError:
            if meta.name not in store.read(cfg.branch).teachers:
                raise
            _stored_documents(store, cfg, meta, students)  # the winner's teacher must be this one
            return False
    _count_commit(summary, writer)
    return True


def _process(
    store,
    cfg,
    head: list[Unit],
    rest: Iterator[Unit],
    executor,
    summary,
    progress: Progress,
    *,
    stored: StoredDocuments,
) -> None:
    writer = store.writer(branch=cfg.branch, on_duplicate="skip")
    last_commit = time.monotonic()
    units = read_ahead(itertools.chain(head, rest), depth=PLAN_AHEAD, name="logitstore-plan")
    try:
        # writer_for reads `writer` when called: after a commit it is the new transaction's writer
        for written, unit in executor.map(units, writer_for=lambda: writer, max_in_flight=2 * cfg.workers):  # noqa: B023
            writer.remove(summary.teacher, unit.replaces)  # the changed documents' old windows
            writer.merge(written)  # the summary counts what each commit holds (`_count_commit`)
            progress.update(tokens=unit.n_tokens, samples=len(unit.sample_ids), documents=unit.documents_read)
            if time.monotonic() - last_commit >= cfg.commit_every:
                _commit(writer, cfg, summary, final=False)
                writer = store.writer(branch=cfg.branch, on_duplicate="skip")
                last_commit = time.monotonic()
    except (inputs.DataError, BuildError):
        _commit(writer, cfg, summary, final=False)  # a bad row further on keeps the units computed before it
        raise
    finally:
        units.close()  # stops the planner thread
    writer.remove(summary.teacher, stored.take_removals())  # replaced documents no later unit carried
    _commit(writer, cfg, summary, final=True)


# Units planned ahead of the teacher by a background thread. Planning reads and tokenizes documents 256
# at a time (~300k tokens, ~0.2 s here): done in the driver's thread between merges, that burst left a
# fast teacher idle (a GPU-speed stand-in lost ~15% of its time to it, benchmarks/build.py). A unit
# ahead holds only its tokens (~130 KB), so 32 of them cost ~4 MB.
PLAN_AHEAD = 32


def _commit(writer, cfg: BuildConfig, summary: BuildSummary, *, final: bool) -> None:
    if not writer.has_changes:
        return
    message = cfg.message or f"build: teacher {summary.teacher}"
    writer.commit(message if final else f"{message} (checkpoint, {summary.samples} samples before it)")
    _count_commit(summary, writer)


def _count_commit(summary: BuildSummary, writer) -> None:
    """The summary counts what the commits hold: samples a concurrent build of the same data committed
    first were dropped at the rebase and count as already stored, and a commit left with nothing to
    hold was not made."""
    result = writer.result
    summary.samples += result.samples
    summary.tokens += result.tokens
    summary.stored_bytes += result.stored_bytes
    summary.already_stored += result.dropped
    summary.commits += result.committed


# -- planning: documents -> samples -> units ---------------------------------------------------


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

    MIXED = ""  # a document whose stored windows disagree (left by builds before source hashes were compared)

    @classmethod
    def from_index(cls, index: pa.Table, *, teacher: str) -> StoredDocuments:
        rows = index.filter(pc.equal(index["teacher"], teacher))
        sample_ids = rows["sample_id"].to_pylist()
        documents = inputs.document_ids(rows["sample_id"]).to_pylist()
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
    cfg: BuildConfig,
    tokenizer,
    *,
    stored: StoredDocuments | None = None,
    summary: BuildSummary,
    students: Sequence[StudentSide] = (),
    vocab_size: int | None = None,
    planned: Planned | None = None,
) -> Iterator[Unit]:
    """Units of about `unit_tokens` tokens in input order, skipping units already stored. A long
    document's windows fill as many units as they need, so commits keep coming. `planned` counts the
    documents read and the tokens of their windows still to compute, as they are read (progress)."""
    stored = stored if stored is not None else StoredDocuments()
    planned = planned if planned is not None else Planned()
    pending = Unit(index=0)
    seen: set[str] = set()
    documents = inputs.read_documents(
        cfg.data,
        text_column=cfg.text_column,
        id_column=cfg.id_column,
        ids_column=cfg.ids_column,
        chat_column=cfg.chat_column,
    )
    drop_tool_calls = bool(cfg.chat_column) and not chat.renders_tool_calls(tokenizer)
    for doc_batch in _batched(itertools.islice(documents, cfg.limit), 256, max_chars=TOKENIZE_CHARS):
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
            windows = inputs.window(token_ids, max_length=cfg.max_length) if len(token_ids) >= 2 else []
            if not windows:
                summary.skipped += 1
                continue
            starts = np.arange(len(windows)) * (cfg.max_length - 1)  # inputs.window's stride
            planned.tokens += sum(len(w) for w in windows)  # one step per window, as below
            for sid, win, start in zip(inputs.window_ids(doc.id, len(windows)), windows, starts.tolist()):
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


def _replace(doc, stored: StoredDocuments, cfg: BuildConfig) -> None:
    """A document stored with other text: its stored ids queued for removal (--on-duplicate replace), or the error."""
    if cfg.on_duplicate == "replace":
        stored.forget(doc.id)
        return
    was = stored.source_of[doc.id] or "windows of mixed sources"
    raise BuildError(
        f"document {doc.id!r} (input row {doc.row}) is stored with other text (source hash {was}, "
        f"now {doc.source_hash}); pass --on-duplicate replace to recompute it, or skip to keep the stored one"
    )


def _check_token_ids(doc, token_ids: np.ndarray, *, vocab_size: int | None) -> None:
    """Pre-tokenized ids must be the teacher's: checked here, with the row, before any model loads."""
    if vocab_size is not None and doc.token_ids is not None and len(token_ids) and int(token_ids.max()) >= vocab_size:
        raise BuildError(
            f"document {doc.id!r} (input row {doc.row}): token id {int(token_ids.max())} is beyond the "
            f"teacher's vocabulary ({vocab_size} ids)"
        )


def _unless_stored(unit: Unit, stored: StoredDocuments, summary: BuildSummary, planned: Planned) -> Iterator[Unit]:
    """The unit, unless the branch holds all of its samples; it carries the removals queued so far."""
    known = sum(sid in stored.sample_ids for sid in unit.sample_ids)
    summary.already_stored += known
    if known == len(unit.sample_ids):
        planned.tokens -= unit.n_tokens  # stored: nothing to compute
    if known < len(unit.sample_ids):
        unit.replaces = stored.take_removals()
        yield unit


# A document tokenized: the teacher's ids, per student tokenizer its alignment, and (chat data) the loss mask.
_Tokenized = tuple[np.ndarray, dict, np.ndarray | None]


def _tokenize(tokenizer, docs: list) -> list[_Tokenized]:
    texts = [d.text for d in docs if d.token_ids is None]
    encoded = iter(tokenizer(texts)["input_ids"]) if texts else iter(())
    return [
        (np.asarray(d.token_ids if d.token_ids is not None else next(encoded), dtype=np.int64), {}, None) for d in docs
    ]


def _tokenize_chat(tokenizer, docs: list, students: Sequence[StudentSide] = ()) -> list[_Tokenized]:
    """Conversations rendered by the teacher's chat template: ids and the loss mask (`logitstore.chat`),
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


# -- student tokenizers: cross-tokenizer alignment at build time -----------------------------------


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
        registration = StudentTokenizer(
            name=name,
            tokenizer_hash=tokenizer_hash(tokenizer),
            vocab_size=len(tokenizer),
            tokenizer_json=tokenizer.backend_tokenizer.to_str(),
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


def _mapped_mass(samples, vocab_map: np.ndarray) -> dict:
    """The mean share of the teacher's probability per position that lands on ids with an exact
    student counterpart (stored entries only; the tail counts as unmapped)."""
    positions = len(samples.tail)
    mapped = np.exp(samples.entry_logprobs.astype(np.float64)) * (vocab_map[samples.entry_ids] >= 0)
    return {"mapped_mass": float(mapped.sum() / positions) if positions else None, "mapped_mass_positions": positions}


def _batched(documents: Iterator, size: int, *, max_chars: int) -> Iterator[list]:
    """Batches of at most `size` documents and, past their first, `max_chars` characters: what one
    tokenizer call holds in memory. A document longer than `MAX_DOCUMENT_CHARS` is refused here."""
    batch: list = []
    chars = 0
    for doc in documents:
        n = _chars(doc)
        if n > MAX_DOCUMENT_CHARS:
            raise BuildError(
                f"document {doc.id!r} (input row {doc.row}) has {n:,} characters, more than the "
                f"{MAX_DOCUMENT_CHARS:,} one document may have (tokenizing it whole takes ~{n * 90 / 1e9:.1f} GB); "
                "split it into several documents"
            )
        if batch and (len(batch) == size or chars + n > max_chars):
            yield batch
            batch, chars = [], 0
        batch.append(doc)
        chars += n
    if batch:
        yield batch


def _chars(doc) -> int:
    if doc.text is not None:
        return len(doc.text)
    return sum(len(m.get("content") or "") for m in doc.messages or ())  # pre-tokenized input: 0


# What a fast tokenizer holds while it tokenizes: ~90 bytes per character here (a 42 MB one-line document
# reached 3.8 GB RSS, issue 29). A tokenizer call gets at most TOKENIZE_CHARS characters (~0.4 GB), one
# document at most MAX_DOCUMENT_CHARS (~1.4 GB, with its windows: ~4 bytes per character as ids).
TOKENIZE_CHARS = 4_000_000
MAX_DOCUMENT_CHARS = 16_000_000


@dataclass
class Planned:
    """What the planner has read so far: documents, and the tokens of their windows still to compute.
    Written by the planner thread, read by the progress clock (plain ints: no lock needed)."""

    documents: int = 0
    tokens: int = 0


# -- progress ------------------------------------------------------------------------------------


class Progress:
    """Build progress in tokens: a tqdm bar on a terminal, else a line every `every` seconds on a clock
    (logs, CI, a pipe; also while the input is read and tokenized, before the teacher computes), one at
    the first teacher batch, and a last line at the end.

    Tokens are counted as the teacher computes them (`batch`, from the in-process executor's workers,
    so the first line comes with the first batch) or, for executors in other processes, as units are
    merged (`update`). The ETA is the remaining tokens over the measured tokens/s; the tokens to compute
    are estimated from the planner's count (`Planned`: the windows of the documents read so far, less
    what is stored) times the input's document count over the documents read, when that count is cheap
    to know. A long document counts whole as soon as it is tokenized.
    """

    def __init__(
        self, cfg: BuildConfig, *, log: Callable[[str], None], every: float = 10.0, planned: Planned | None = None
    ):
        self.log, self.every = log, every
        self.enabled = cfg.progress
        self.planned = planned if planned is not None else Planned()
        self.total_documents = inputs.count_documents(cfg.data) if cfg.progress else None
        if self.total_documents is not None and cfg.limit is not None:
            self.total_documents = min(self.total_documents, cfg.limit)
        self.start = time.monotonic()
        self.last: float | None = None  # when the last line was printed; None: no line yet
        self.computed = self.tokens = self.samples = self.documents = 0
        self._lock = threading.Lock()  # the teacher's threads report batches, the clock ticks
        self.bar = None
        if self.enabled and sys.stderr.isatty():
            self.bar = tqdm(total=None, unit="tok", unit_scale=True, desc="build", dynamic_ncols=True)
        self._stop = threading.Event()
        self._clock = threading.Thread(target=self._tick, name="logitstore-progress", daemon=True)
        if self.enabled and every > 0:
            self._clock.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            with self._lock:
                self._report()

    def batch(self, tokens: int) -> None:
        """The teacher computed `tokens` more tokens (any thread)."""
        with self._lock:
            first = self.computed == 0
            self.computed += tokens
            self._report(now=first)

    def update(self, *, tokens: int, samples: int, documents: int) -> None:
        """A unit was merged: its tokens count now if no batch reported them."""
        with self._lock:
            self.tokens += tokens
            self.samples += samples
            self.documents += documents
            self._report()

    def _done(self) -> int:
        return max(self.computed, self.tokens)

    def _total(self) -> int | None:
        read, tokens = self.planned.documents, self.planned.tokens
        if not self.total_documents or not read:
            return None
        return max(self._done(), tokens, int(tokens / read * self.total_documents))

    def _report(self, *, final: bool = False, now: bool = False) -> None:
        if not self.enabled:
            return
        clock = time.monotonic()
        rate = self._done() / max(clock - self.start, 1e-9)
        if self.bar is not None:
            self.bar.total = self._done() if final else self._total()
            self.bar.n = self._done()
            self.bar.set_postfix(samples=self.samples, refresh=False)
            self.bar.refresh()
            return
        due = clock - (self.last if self.last is not None else self.start) >= self.every
        if final or now or due:
            self.last = clock
            self.log(self._line(final=final, rate=rate))

    def _line(self, *, final: bool, rate: float) -> str:
        """Tokens computed (of the estimate), samples written so far, documents read so far."""
        total = None if final else self._total()
        eta = "" if total is None or not rate else f", ETA {(total - self._done()) / rate / 60:.1f} min"
        of = f" of ~{total:,}" if total else ""
        documents = max(self.documents, self.planned.documents)
        waiting = ""
        if not final and not self._done():
            waiting = (
                "; the teacher's first batch is not done yet" if documents else "; reading and tokenizing the input"
            )
        return (
            f"build: {self._done():,}{of} tokens, {self.samples:,} samples written, {documents:,} documents read, "
            f"{rate:,.0f} tokens/s{eta}{waiting}"
        )

    def finish(self) -> None:
        """The build is done: the bar to 100%, or a last line with the totals."""
        with self._lock:
            self._report(final=True)

    def close(self) -> None:
        self._stop.set()
        if self._clock.is_alive():
            self._clock.join()
        if self.bar is not None:
            self.bar.close()


def summary_json(summary: BuildSummary) -> str:
    return json.dumps(summary.to_json(), indent=2)
