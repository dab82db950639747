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
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from logitstore.ahead import read_ahead
from logitstore.errors import ChangedTextError, ConflictError, LogitstoreError
from logitstore.format import codec
from logitstore.heap import frozen_heap
from logitstore.pipelines import inputs
from logitstore.pipelines.answers import AnswersOf, StoredAnswers, check_one_tokenizer
from logitstore.pipelines.config import BuildConfig, BuildError
from logitstore.pipelines.engines import EngineError, engine_class
from logitstore.pipelines.engines.base import HandOver
from logitstore.pipelines.engines.settings import WorkerSettings
from logitstore.pipelines.generate import Generation
from logitstore.pipelines.plan import (
    Planned,
    StoredDocuments,
    StudentSide,
    changed_text,
    check_teacher_fits,
    load_student_tokenizers,
    plan_units,
)
from logitstore.pipelines.progress import Progress
from logitstore.pipelines.startup import StartupClock
from logitstore.pipelines.summary import BuildSummary, count_commit, count_skips
from logitstore.pipelines.workers import (
    LoadingExecutor,
    Unit,
    interrupted_on_sigterm,
    loads_early,
    make_executor,
    settled_settings,
    write_unit,
)
from logitstore.store.meta import DEFAULT_BRANCH, TeacherMeta
from logitstore.store.store import Store

if TYPE_CHECKING:  # teacher.py imports torch (2.7 s): run_build imports it after the input checks
    from logitstore.pipelines.teacher import TeacherInfo


@dataclass
class BuildPlan:
    """What a build knows before any teacher runs (`plan_build`): the teacher described (not loaded), its
    store metadata, the store if it exists (read, never created), and the units to compute, planned
    lazily, of which the first is read by `read_first` (so bad input has failed by then). A dry run
    (`pipelines/estimate.py`) stops here; `run_build` goes on."""

    info: TeacherInfo
    meta: TeacherMeta
    settings: WorkerSettings  # settled by the build's engine (`Engine.settle`): what every engine is built from
    store: Store | None
    stored: StoredDocuments
    students: list[StudentSide]
    summary: BuildSummary
    units: Iterator[Unit]
    first: Unit | None
    ids_from: str
    started: float
    planned: Planned  # what the planner has read so far (the progress clock reads it)
    generation: Generation | None = None  # build --generate: the generator, loaded by the planner
    # build --generate: what the generator scored for the engine in this process (a served teacher's answers)
    hand_over: HandOver | None = None
    notes: list[str] = field(default_factory=list)  # the engine's lines said at start (the server's K)

    def read_first(self) -> Unit | None:
        """Read the first unit: the input's first documents tokenized and checked (bad input fails here)."""
        self.first = next(self.units, None)
        return self.first


def plan_build(cfg: BuildConfig, *, read_first: bool = True, answers_of: AnswersOf | None = None) -> BuildPlan:
    """Check the input and the teacher and plan the units; loads no model and writes nothing. With
    `read_first`, the first unit is read too (`BuildPlan.read_first`); with `answers_of` (a later
    teacher of a `--generate` build), the answers are the first teacher's (`answers.StoredAnswers`)."""
    from logitstore.pipelines.teacher import describe_teacher  # torch and transformers: 2.7 s, after the input checks

    start = time.perf_counter()
    # The input first (exists, columns, first rows): a mistake there shows in a second, before any model
    # loads and before a store is created.
    ids_from = inputs.check_input(cfg.data, **cfg.columns)
    info = describe_teacher(cfg.teacher)
    if cfg.teacher_name is not None:
        info = dataclasses.replace(info, spec=dataclasses.replace(info.spec, name=cfg.teacher_name))
    # the one place the sparsity is settled: as asked, or the engine's default (a served teacher's K)
    engine = engine_class(cfg.engine)
    settings, note = settled_settings(cfg, teacher_spec=info.spec)
    check_teacher_fits(info, sparsity=settings.stored, max_length=cfg.max_length)
    students = load_student_tokenizers(cfg.student_tokenizers, teacher=info)
    # The store (and a new branch) is made only with the first commit: a build that fails before leaves
    # no empty store or branch behind.
    store = Store.open_if_exists(cfg.store)
    meta = info.store_meta(
        settings.stored,
        loss_mask=cfg.train_on if cfg.chat_column or cfg.generate else None,
        engine=engine.name,
        dtype=engine.resolved_dtype(settings),
        engine_version=engine.version(),
        **engine.recorded(settings, info.spec),
    )
    summary = BuildSummary(teacher=meta.name)
    stored = _stored_documents(store, cfg, meta, students)
    planned = Planned()
    hand_over = HandOver() if cfg.generate else None
    generation = None
    if cfg.generate and not answers_of:
        generation = Generation(cfg, teacher=info, settings=settings, hand_over=hand_over)
    if answers_of is not None:  # the branch's answers (and a dry run's, from memory)
        version = store.read(_base_branch(store, cfg)) if store else None
        generation = StoredAnswers(cfg, source=answers_of, version=version, counts=summary)
    if generation is not None:
        summary.generation = generation.record
        planned.generated = generation.generated
    units = plan_units(
        cfg,
        info.tokenizer,
        stored=stored,
        counts=summary,
        students=students,
        vocab_size=info.vocab_size,
        planned=planned,
        generation=generation,
    )
    plan = BuildPlan(
        info, meta, settings, store, stored, students, summary, units, None, ids_from, start, planned, generation
    )
    plan.hand_over = hand_over
    plan.notes += [note] if note else []
    if read_first:
        plan.read_first()
    return plan


def run_build(
    cfg: BuildConfig, *, log: Callable[[str], None] | None = None, answers_of: AnswersOf | None = None
) -> BuildSummary:
    """Run the whole build; returns the summary. Raises `LogitstoreError`s for user errors. With
    `answers_of`, a `--generate` build scores the answers another teacher holds (`run_builds`)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if cfg.generate and cfg.generator is None and cfg.engine == "torch" and answers_of is None:
        from logitstore.pipelines.engines.torch_engine import shared_teachers  # torch: only a torch build needs it

        with shared_teachers():  # the teacher generates and scores: one load for both
            return _run_build(cfg, log=log)
    return _run_build(cfg, log=log, answers_of=answers_of)


def _run_build(cfg: BuildConfig, *, log: Callable[[str], None], answers_of: AnswersOf | None = None) -> BuildSummary:
    startup = StartupClock()
    loading = _loading(cfg, on_batch=lambda tokens: progress.batch(tokens))
    try:
        plan = plan_build(cfg, read_first=False, answers_of=answers_of)
    except BaseException:
        if loading is not None:
            loading.leave()
        raise
    startup.mark("plan")
    log(f"build: sample ids are {plan.ids_from}")
    for note in plan.notes:
        log(f"build: {note}")
    # on its clock from here, also while the first unit's documents are read and tokenized (a long one: minutes)
    progress = Progress(cfg, log=log, planned=plan.planned)
    store = plan.store
    try:
        first = plan.read_first()  # reads and checks the input before any model is loaded
        startup.mark("first_unit")
        if first is None and plan.stored.removals:  # only documents replaced by text too short for a window
            store = _store_and_branch(store, cfg)
            with store.writer(branch=cfg.branch) as writer:
                writer.remove(plan.meta.name, plan.stored.take_removals())
                _commit(writer, cfg, plan.summary, final=True)
        if first is not None:
            store = _compute(plan, cfg, first, progress, startup, loading)
    finally:
        if loading is not None:
            loading.leave()  # nothing to compute, or an error: the teacher goes (after its load, if under way)
        progress.close()
        if plan.generation is not None:
            plan.generation.close()
    summary = plan.summary
    # Nothing to write makes nothing: no store, no branch (version None in the summary).
    summary.version = store.read(cfg.branch).snapshot_id if store and cfg.branch in store.branches() else None
    summary.seconds = time.perf_counter() - plan.started
    summary.tokens_per_second = summary.tokens / summary.seconds if summary.seconds else 0.0
    summary.bytes_per_token = summary.stored_bytes / summary.tokens if summary.tokens else None
    summary.startup_seconds = startup.to_json()
    return summary


def _loading(cfg: BuildConfig, *, on_batch: Callable[[int], None]) -> LoadingExecutor | None:
    """The teacher loading beside the planning (`workers.loads_early`), or None: it loads after it."""
    if not loads_early(cfg):
        return None
    from logitstore.pipelines.teacher import resolve_teacher  # torch and transformers: 2.7 s, loaded here anyway

    try:
        spec = resolve_teacher(cfg.teacher)
    except LogitstoreError:  # `plan_build` says so, after its checks of the input
        return None
    if cfg.teacher_name is not None:  # as `plan_build` names it: the same teacher for `shared_teachers()`
        spec = dataclasses.replace(spec, name=cfg.teacher_name)
    try:
        settings, _ = settled_settings(cfg, teacher_spec=spec)  # the torch engine's: no requests, no load
    except LogitstoreError:  # `plan_build` says so, after its checks of the input
        return None
    return LoadingExecutor(cfg, settings=settings, on_batch=on_batch)


def _compute(
    plan: BuildPlan, cfg: BuildConfig, first: Unit, progress: Progress, startup: StartupClock, loading
) -> Store:
    """Load the teacher (or take the one loaded meanwhile) and compute, write and commit every unit;
    returns the store (created if new)."""
    store, meta, summary = plan.store, plan.meta, plan.summary
    # the first batch the in-process executor reports, or the first unit other executors return
    progress.on_tokens = lambda: startup.mark("first_batch")
    with interrupted_on_sigterm():  # a SIGTERM'd build closes its engines too
        if loading is not None:
            executor = loading.take()
            assert executor.worker.settings == plan.settings, "the early load settles as the plan does"
        else:
            executor = make_executor(cfg, settings=plan.settings, on_batch=progress.batch, hand_over=plan.hand_over)
        startup.mark("teacher")
        # the heap as it is with the teacher in memory: left out of the collector's full passes
        with frozen_heap():
            planner = None
            try:
                head = [first]
                new_teacher = store is None or meta.name not in store.read(_base_branch(store, cfg)).teachers
                samples = executor.compute(first) if new_teacher else None
                # planned by a thread from here on; a new teacher's next units start on the teacher as they are
                # planned, while this thread makes the store and registers the teacher
                started = _starting(plan.units, executor, count=START_AHEAD if new_teacher else 0)
                planner = read_ahead(started, depth=PLAN_AHEAD, name="logitstore-plan", eager=True)
                store = _store_and_branch(store, cfg)
                if new_teacher and _add_teacher_with_first_unit(
                    store, cfg, meta, plan.info, first, samples, summary, students=plan.students
                ):
                    head = []
                    count_skips(summary, first)
                    progress.update(
                        tokens=first.n_tokens, samples=len(first.sample_ids), documents=first.documents_read
                    )
                # the first unit computed and written in this thread: the kernels are compiled (`InProcessExecutor.map`)
                warm = not head
                _process(store, cfg, head, planner, executor, summary, progress, stored=plan.stored, warm=warm)
                progress.finish()
            finally:
                if planner is not None:
                    planner.close()  # stops the planner thread
                executor.close()  # the engines' close() (workers.py), on success, failure and interruption
    return store


def _starting(units: Iterator[Unit], executor, *, count: int) -> Iterator[Unit]:
    """`units`, the first `count` of them started on the teacher as they are planned (`executor.start`)."""
    for i, unit in enumerate(units):
        if i < count:
            executor.start(unit)
        yield unit


def run_builds(
    cfg: BuildConfig, teachers: list[str | None], *, log: Callable[[str], None] | None = None
) -> BuildSummary:
    """`build --teacher A --teacher B ...`: one pass over the data per teacher, in order, each its own
    commits on the same branch (so a crash in B keeps A's work, and a re-run skips what is stored).
    The summary adds the teachers up; `teachers` holds each one's own summary. With `--generate`, A's
    pass generates the answers and B's scores the ones A holds (`pipelines/answers.py`): the
    generation's counts are A's."""
    from logitstore.pipelines.teacher import describe_teacher  # torch and transformers: 2.7 s, after the input checks

    if len(teachers) <= 1:
        summary = run_build(dataclasses.replace(cfg, teacher=teachers[0] if teachers else cfg.teacher), log=log)
        summary.teachers = [summary.own_json()]  # the same fields as with several teachers
        return summary
    if cfg.teacher_name is not None:
        raise BuildError(
            "--teacher-name names one teacher; with several --teacher, each is named by its folder or file"
        )
    infos = [describe_teacher(t) for t in teachers]  # every teacher loads before any work starts
    names = [info.spec.name for info in infos]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise BuildError(
            f"--teacher: several teachers are named {clash[0]!r} (the name is the model folder's or "
            "file's name); put them in folders with distinct names"
        )
    if cfg.generate:
        check_one_tokenizer(teachers, infos, student_tokenizers=cfg.student_tokenizers)
    parts = [run_build(dataclasses.replace(cfg, teacher=teachers[0]), log=log)]
    answers_of = AnswersOf(names[0], parts[0].generation) if parts[0].generation else None
    parts += [run_build(dataclasses.replace(cfg, teacher=t), log=log, answers_of=answers_of) for t in teachers[1:]]
    # the input's counts (every pass reads it) and the generation's (the first pass generates): the first's
    first = ("skipped", "no_completion", "tool_calls", "duplicates", "prompts", "answers", "generated_tokens")
    total = BuildSummary(
        teacher=",".join(names),
        version=parts[-1].version,
        teachers=[p.own_json() for p in parts],
        **{
            name: getattr(parts[0], name)
            for name in (*first, "answers_cut", "answers_retokenized", "answers_empty", "generation", "startup_seconds")
        },
    )
    added = ("samples", "tokens", "already_stored", "refused", "too_long", "changed", "seconds", "commits")
    for name in (*added, "stored_bytes", "no_answer"):
        setattr(total, name, sum(getattr(p, name) for p in parts))
    total.tokens_per_second = total.tokens / total.seconds if total.seconds else 0.0
    total.bytes_per_token = total.stored_bytes / total.tokens if total.tokens else None
    return total


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
            tokenizer_json=info.tokenizer_json,
            code_of_id=code_of_id,
            students=registrations,
        )
        writer.merge(write_unit(writer.part_writer(), unit, samples, teacher=meta.name))
        if summary.generation is not None:
            writer.record_generation(meta.name, summary.generation)
        try:
            writer.commit(cfg.message or f"build: teacher {meta.name} (first unit)")
        except ConflictError:
            if meta.name not in store.read(cfg.branch).teachers:
                raise
            _stored_documents(store, cfg, meta, students)  # the winner's teacher must be this one
            return False
    count_commit(summary, writer)
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
    warm: bool = False,
) -> None:
    try:
        _merge_units(store, cfg, head, rest, executor, summary, progress, stored=stored, warm=warm)
    except ChangedTextError as e:  # the planner met what the branch held; the writer, what a build added since
        raise BuildError(changed_text(e.sample_id, stored=e.stored, new=e.new, concurrent=True)) from None


def _merge_units(
    store, cfg, head, rest, executor, summary, progress: Progress, *, stored: StoredDocuments, warm: bool = False
) -> None:
    writer = _writer(store, cfg)
    last_commit = time.monotonic()
    units = itertools.chain(head, rest)  # `rest`: planned ahead by the planner thread, which the caller closes
    try:
        # writer_for reads `writer` when called: after a commit it is the new transaction's writer
        mapped = executor.map(units, writer_for=lambda: writer, max_in_flight=2 * cfg.workers, warm=warm)  # noqa: B023
        for written, unit in mapped:
            writer.remove(summary.teacher, unit.replaces)  # the changed documents' old windows
            writer.merge(written)  # the summary counts what each commit holds (`count_commit`)
            count_skips(summary, unit)
            progress.update(tokens=unit.n_tokens, samples=len(unit.sample_ids), documents=unit.documents_read)
            if time.monotonic() - last_commit >= cfg.commit_every:
                _commit(writer, cfg, summary, final=False)
                writer = _writer(store, cfg)
                last_commit = time.monotonic()
    except (inputs.DataError, BuildError, EngineError):
        # a bad row further on, or the teacher's server gone: the units computed before it are kept
        _commit(writer, cfg, summary, final=False)
        raise
    writer.remove(summary.teacher, stored.take_removals())  # replaced documents no later unit carried
    _commit(writer, cfg, summary, final=True)


def _writer(store: Store, cfg: BuildConfig):
    """A transaction of the build: what the branch holds with the same text is left out (a resumed or
    concurrent build of the same data), and a document it holds with other text, stored before this
    build looked or by a concurrent build since, meets `--on-duplicate` (the planner's rule for the
    former, `StoredDocuments.changed`, is the writer's for both)."""
    return store.writer(branch=cfg.branch, on_duplicate="skip", on_changed=cfg.on_duplicate)


# Units planned ahead of the teacher by a background thread. Planning reads and tokenizes documents 256
# at a time (~300k tokens, ~0.2 s here): done in the driver's thread between merges, that burst leaves a
# fast teacher idle (a GPU-speed stand-in loses ~15% of its time to it, benchmarks/build.py). A unit
# ahead holds only its tokens (~130 KB), so 32 of them cost ~4 MB.
PLAN_AHEAD = 32
# Units a new teacher's build starts computing while it registers the teacher (`InProcessExecutor.start`):
# registration (the store made, the metadata and the first unit committed) takes ~0.1 s, six units of a
# GPU-speed teacher at 1M tokens/s; their selected entries wait in memory (~2 MB a unit) to be written.
# The planner thread starts them as it plans them.
START_AHEAD = 6


def _commit(writer, cfg: BuildConfig, summary: BuildSummary, *, final: bool) -> None:
    if not writer.has_changes:
        return
    if summary.generation is not None:
        writer.record_generation(summary.teacher, summary.generation)
    message = cfg.message or f"build: teacher {summary.teacher}"
    writer.commit(message if final else f"{message} (checkpoint, {summary.samples} samples before it)")
    count_commit(summary, writer)


def _mapped_mass(samples, vocab_map: np.ndarray) -> dict:
    """The mean share of the teacher's probability per position that lands on ids with an exact
    student counterpart (stored entries only; the tail counts as unmapped)."""
    positions = len(samples.tail)
    mapped = np.exp(samples.entry_logprobs.astype(np.float64)) * (vocab_map[samples.entry_ids] >= 0)
    return {"mapped_mass": float(mapped.sum() / positions) if positions else None, "mapped_mass_positions": positions}
