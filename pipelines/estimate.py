"""`logitstore build --dry-run`: what a build would compute and store, and how long it would take here,
without writing anything.

It plans the build as `run_build` does (`build.plan_build`: the input checked, the teacher described, an
existing store read for what it holds already) and then:
- reads the input once without tokenizing, for its documents and size (characters; token ids for
  pre-tokenized input; message contents for chat data), then plans the build's units over the first
  documents up to `SAMPLE_SIZE`: an input within it is counted exactly, a longer one scaled by size;
- loads the teacher (one worker, in this process) and runs it on the first unit's samples up to
  `MEASURED_BATCHES` batches of `--batch-tokens`: the teacher's tokens per second, after the first batch
  (which pays one-time costs) where there are two;
- writes those samples as one part into a store in memory, as the build writes its first unit (same
  id order, codec and compression), for the bytes per token of the chosen sparsity.

With `--generate`, the sample is the prompts of one generator call (`generate.prompts_per_call`), and
the rest of the input is scaled by its prompt count: the generator answers them on this machine's engine
(its tokens per second, the mean answer's tokens) and the teacher scores those answers. With several
teachers, the later ones score the first one's sample answers (`answers.AnswersOf`, from memory), as the
build has them score the first teacher's answers.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from logitstore.format import codec
from logitstore.pipelines import inputs
from logitstore.pipelines.answers import AnswersOf, check_one_tokenizer
from logitstore.pipelines.build import BuildConfig, BuildPlan, plan_build
from logitstore.pipelines.generate import prompts_per_call
from logitstore.pipelines.workers import Unit, make_executor, write_unit
from logitstore.store.meta import DEFAULT_BRANCH
from logitstore.store.store import Store

# The first documents up to this size (characters; token ids for pre-tokenized input) are tokenized, about
# 1M tokens (seconds with a fast tokenizer); the rest of the input is scaled by its size.
SAMPLE_SIZE = 4 << 20
MEASURED_BATCHES = 2  # teacher batches timed: the second is the one without the first's warm-up


@dataclass
class BuildEstimate:
    """A dry run's numbers for one teacher (`build --dry-run --json` prints these fields)."""

    teacher: str
    documents: int  # input documents (within --limit)
    tokens: int  # teacher tokens the build would compute (not those stored already)
    samples: int
    exact: bool  # the whole input was tokenized; else tokens and samples are scaled from the first documents
    tokenized_documents: int
    already_stored: int  # samples the branch holds already: a re-run skips them
    bytes_per_token: float | None  # stored bytes per token, measured on `measured_tokens`
    stored_bytes: int  # bytes_per_token x tokens
    teacher_tokens_per_second: float  # one worker on this machine
    load_seconds: float  # the teacher's load, measured
    seconds: float  # load_seconds + tokens / teacher_tokens_per_second
    measured_tokens: int
    sparsity: dict
    # build --generate: the summary's counts, estimated for the whole input (zero without --generate)
    prompts: int = 0
    answers: int = 0  # answers to generate (not stored already)
    generated_tokens: int = 0  # answers x mean_answer_tokens
    answers_cut: int = 0
    answers_per_prompt: int = 0  # --samples-per-prompt
    mean_answer_tokens: float = 0.0  # measured on `measured_answers`; --generate N (the bound) where none were
    generator_tokens_per_second: float = 0.0  # the generator's calls on this machine's engine (its load excluded)
    generation_seconds: float = 0.0  # generated_tokens / generator_tokens_per_second (within `seconds`)
    answer_stored_bytes: int = 0  # the answers' samples in the store: answers x bytes per measured answer
    measured_answers: int = 0
    answers_of: str | None = None  # a later teacher: scores the answers of this (the first) teacher
    generation: dict | None = None  # the generation record (the build summary's `generation`)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def estimate_build(
    cfg: BuildConfig, *, log: Callable[[str], None] = lambda _: None, answers_of: AnswersOf | None = None
) -> BuildEstimate:
    """The dry run of `cfg`'s build (one teacher; with `answers_of`, a later one of a `--generate` build)."""
    return _estimate(cfg, log=log, answers_of=answers_of)[0]


def _estimate(
    cfg: BuildConfig, *, log: Callable[[str], None], answers_of: AnswersOf | None
) -> tuple[BuildEstimate, dict]:
    """The estimate, and the answers its sample generated (`AnswersOf.held`: what later teachers score)."""
    documents, head, scale = _sample(cfg)
    plan = plan_build(cfg if head == documents else dataclasses.replace(cfg, limit=head), answers_of=answers_of)
    tokens, samples, held = 0, 0, {}
    for unit in itertools.chain([plan.first] if plan.first is not None else [], plan.units):  # tokenizing only
        tokens, samples = tokens + unit.n_tokens, samples + len(unit.sample_ids)
        if cfg.generate:  # per answer, not per token
            for sid, ids, source in zip(unit.sample_ids, unit.tokens, unit.source_hashes):
                held[sid] = ((ids, unit.loss_masks[sid]), source)
    log(
        f"dry run: {tokens:,} tokens in the first {head:,} of {documents:,} {'prompts' if cfg.generate else 'documents'}"
    )
    estimate = BuildEstimate(
        teacher=plan.meta.name,
        documents=documents,
        tokens=round(tokens * scale),
        samples=round(samples * scale),
        exact=head == documents,
        tokenized_documents=head,
        already_stored=round(plan.summary.already_stored * scale),
        bytes_per_token=None,
        stored_bytes=0,
        teacher_tokens_per_second=0.0,
        load_seconds=0.0,
        seconds=0.0,
        measured_tokens=0,
        sparsity=plan.meta.sparsity.to_json(),
    )
    measured = _head(plan.first, tokens=MEASURED_BATCHES * cfg.batch_tokens) if plan.first is not None else None
    if measured is not None:
        _measure(cfg, plan, measured, estimate, log=log)
    if plan.generation is not None:
        _estimate_generation(cfg, plan, estimate, scale=scale, measured=measured, answers_of=answers_of)
    return estimate, held


def estimate_builds(
    cfg: BuildConfig, teachers: list[str | None], *, log: Callable[[str], None] = lambda _: None
) -> list[BuildEstimate]:
    """`build --dry-run` with one or several `--teacher`: one estimate per teacher. With `--generate`,
    the first teacher's sample answers are the ones the later teachers score."""
    if cfg.generate and len(teachers) > 1:
        # torch and transformers (2.7 s): only a dry run of several teachers with --generate compares tokenizers
        from logitstore.pipelines.teacher import describe_teacher

        check_one_tokenizer(teachers, [describe_teacher(t) for t in teachers])
    first, held = _estimate(dataclasses.replace(cfg, teacher=(teachers or [cfg.teacher])[0]), log=log, answers_of=None)
    answers_of = AnswersOf(first.teacher, first.generation, held) if first.generation else None
    later = [estimate_build(dataclasses.replace(cfg, teacher=t), log=log, answers_of=answers_of) for t in teachers[1:]]
    return [first, *later]


def _estimate_generation(
    cfg: BuildConfig, plan: BuildPlan, estimate: BuildEstimate, *, scale: float, measured, answers_of
) -> None:
    """The generation's part of the estimate: its counts scaled from the sample, the time at the
    measured tokens/s, and the answers' stored bytes at the measured bytes per answer."""
    summary, generated = plan.summary, plan.planned.generated
    assert generated is not None and cfg.generate is not None, "plan_build counts what --generate generates"
    estimate.generation = summary.generation
    estimate.answers_of = None if answers_of is None else answers_of.teacher
    estimate.answers_per_prompt = cfg.samples_per_prompt
    estimate.prompts = round(summary.prompts * scale)
    estimate.measured_answers = summary.answers
    if answers_of is not None:  # the first teacher's estimate counts the generation
        return
    estimate.answers, estimate.answers_cut = round(summary.answers * scale), round(summary.answers_cut * scale)
    # no answer generated (all stored): --generate N, the bound
    estimate.mean_answer_tokens = summary.generated_tokens / summary.answers if summary.answers else float(cfg.generate)
    estimate.generated_tokens = round(estimate.answers * estimate.mean_answer_tokens)
    if generated.seconds:
        estimate.generator_tokens_per_second = generated.tokens / generated.seconds
        estimate.generation_seconds = estimate.generated_tokens / estimate.generator_tokens_per_second
        estimate.seconds += estimate.generation_seconds
    if measured is not None and estimate.bytes_per_token is not None:
        per_answer = estimate.bytes_per_token * measured.n_tokens / len(measured.sample_ids)
        estimate.answer_stored_bytes = round(per_answer * estimate.answers)


def _sample(cfg: BuildConfig) -> tuple[int, int, float]:
    """(documents in the input, how many of the first ones make `SAMPLE_SIZE`, the input's size over
    theirs): one read of the input (within --limit), without tokenizing. With `--generate`: how many
    prompts one generator call answers, and the input's prompts over those."""
    count, total, head, head_size = 0, 0, 0, 0
    for doc in cfg.documents():
        count, total = count + 1, total + _size(doc)
        if head_size < SAMPLE_SIZE:
            head, head_size = count, total
    if cfg.generate:
        head = min(count, prompts_per_call(cfg))
        return count, head, count / head if head else 1.0
    return count, head, total / head_size if head_size else 1.0


def _size(doc: inputs.Document) -> int:
    if doc.token_ids is not None:
        return len(doc.token_ids)
    if doc.messages is not None:
        return sum(len(str(m.get("content") or "")) for m in doc.messages)
    return len(doc.text or "")


def _head(unit: Unit, *, tokens: int) -> Unit:
    """The unit's first samples, up to about `tokens` tokens (at least one sample)."""
    head = Unit(index=unit.index)
    for sid, ids, source in zip(unit.sample_ids, unit.tokens, unit.source_hashes):
        if head.sample_ids and head.n_tokens + len(ids) > tokens:
            break
        head.add(sid, ids, source, students=unit.students.get(sid), loss_mask=unit.loss_masks.get(sid))
    return head


def _measure(cfg: BuildConfig, plan: BuildPlan, unit: Unit, estimate: BuildEstimate, *, log) -> None:
    """Load the teacher, run it on `unit`, write the result into a store in memory; fill in the rates."""
    started = time.perf_counter()
    batches: list[tuple[float, int]] = []  # (when it ended, its tokens)
    one = dataclasses.replace(cfg, workers=1, ray_address=None)
    executor = make_executor(
        one,
        settings=plan.settings,
        on_batch=lambda n: batches.append((time.perf_counter(), n)),
        hand_over=plan.hand_over,
    )
    loaded = time.perf_counter()
    try:
        log(f"dry run: teacher loaded in {loaded - started:.1f} s; running it on {unit.n_tokens:,} tokens")
        samples = executor.compute(unit)
    finally:
        executor.close()
    if len(batches) >= 2:  # after the first batch's warm-up
        rate = sum(n for _, n in batches[1:]) / max(batches[-1][0] - batches[0][0], 1e-9)
    else:
        rate = unit.n_tokens / max(time.perf_counter() - loaded, 1e-9)
    memory = Store.open(f"memory://logitstore-dry-run-{uuid.uuid4().hex}", create=True)
    with memory.writer(branch=DEFAULT_BRANCH) as writer:  # never committed: dropped on exit
        writer.add_teacher(
            plan.meta,
            code_of_id=codec.frequency_id_order(samples.entry_ids, vocab_size=plan.meta.vocab_size),
            students=[st.registration for st in plan.students],
        )
        written = write_unit(writer.part_writer(), unit, samples, teacher=plan.meta.name)
    estimate.measured_tokens = unit.n_tokens
    estimate.bytes_per_token = written.stored_bytes / unit.n_tokens
    estimate.stored_bytes = round(estimate.bytes_per_token * estimate.tokens)
    estimate.teacher_tokens_per_second = rate
    estimate.load_seconds = loaded - started
    estimate.seconds = estimate.load_seconds + estimate.tokens / rate
