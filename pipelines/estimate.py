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
from logitstore.pipelines.build import BuildConfig, BuildPlan, plan_build
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

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def estimate_build(cfg: BuildConfig, *, log: Callable[[str], None] = lambda _: None) -> BuildEstimate:
    """The dry run of `cfg`'s build (one teacher)."""
    documents, head, scale = _sample(cfg)
    plan = plan_build(cfg if head == documents else dataclasses.replace(cfg, limit=head))
    tokens, samples = 0, 0
    for unit in itertools.chain([plan.first] if plan.first is not None else [], plan.units):  # tokenizing only
        tokens, samples = tokens + unit.n_tokens, samples + len(unit.sample_ids)
    log(f"dry run: {tokens:,} tokens in the first {head:,} of {documents:,} documents")
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
    if plan.first is not None:
        _measure(cfg, plan, _head(plan.first, tokens=MEASURED_BATCHES * cfg.batch_tokens), estimate, log=log)
    return estimate


def estimate_builds(
    cfg: BuildConfig, teachers: list[str | None], *, log: Callable[[str], None] = lambda _: None
) -> list[BuildEstimate]:
    """`build --dry-run` with one or several `--teacher`: one estimate per teacher."""
    return [estimate_build(dataclasses.replace(cfg, teacher=t), log=log) for t in teachers or [cfg.teacher]]


def _sample(cfg: BuildConfig) -> tuple[int, int, float]:
    """(documents in the input, how many of the first ones make `SAMPLE_SIZE`, the input's size over
    theirs): one read of the input (within --limit), without tokenizing."""
    count, total, head, head_size = 0, 0, 0, 0
    for doc in cfg.documents():
        count, total = count + 1, total + _size(doc)
        if head_size < SAMPLE_SIZE:
            head, head_size = count, total
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
        one, teacher_spec=plan.info.spec, on_batch=lambda n: batches.append((time.perf_counter(), n))
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
