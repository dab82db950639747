"""`logitstore rounds`: on-policy distillation as a batch, R rounds end to end (docs/train.md
"On-policy rounds").

Round r builds answers to the prompts (`build --generate`, round r, `--on-duplicate replace`: the
branch then holds this round's answers only, earlier rounds stay readable by their tags), tags the
version `round-r`, and trains on it: round 1 starts the run in OUT, every later round continues it
(`train --resume --new-version --version round-r`) to `r x --steps-per-round` steps; with
`--earlier-rounds-weight W` > 0 round r trains on a mix instead, its version at weight 1 and every
earlier round's tag at W (`train --version-weight`). Round 1's answers
are the teacher's own (sequence-level KD: there is no trained student yet); round r > 1's are the
student's of round r - 1, OUT/final. A `--student` folder of another tokenizer than the teacher's is each
build's `--student-tokenizer` too.

A round whose tag exists is not built again, and training resumes where the run is, so a killed
driver started again with the same arguments goes on from where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from logitstore.errors import LogitstoreError, VersionNotFoundError
from logitstore.options import option, show_weights
from logitstore.pipelines.config import BuildConfig
from logitstore.store.meta import RUN_MARKER
from logitstore.trainer.config import DataConfig, TrainConfig


class RoundsError(LogitstoreError):
    """An option of `logitstore rounds` out of range."""


@dataclass(frozen=True)
class Rounds:
    """`logitstore rounds`' options, declared as its flags (`options.option`), checked on construction."""

    store: str = option(
        None, required=True, help="Store of the rounds' answers; each round's version is tagged round-R."
    )
    out: str = option(
        None, required=True, help="The run folder every round trains in (OUT/final generates the next round)."
    )
    prompts: str = option(None, required=True, help="The prompts (any input build --data reads).")
    rounds: int = option(None, required=True, help="Rounds to run: build, tag, train.")
    steps_per_round: int = option(None, required=True, help="Optimizer steps each round adds to the run.")
    generate: int = option(256, help="New tokens per answer at most (build --generate).")
    prompt_column: str | None = option(None, help="Column of plain-text prompts.")
    chat_column: str | None = option(None, help="Column of conversations ending with a user turn.")
    teacher: str | None = option(None, help="The teacher that scores (and writes round 1's answers).")
    student: str | None = option(None, help="The student to train (train --student).")
    samples_per_prompt: int = option(BuildConfig.samples_per_prompt, help="Answers per prompt.")
    generation_temperature: float = option(
        BuildConfig.generation_temperature, help="Sampling temperature of the answers."
    )
    generation_top_p: float = option(BuildConfig.generation_top_p, help="Nucleus sampling of the answers.")
    seed: int = option(0, help="Round R samples with seed + R.")
    max_length: int = option(BuildConfig.max_length, help="Prompt and answer, teacher tokens at most.")
    seq_len: int = option(DataConfig.seq_len, help="train --seq-len.")
    micro_batch: int = option(8, help="train --micro-batch.")
    earlier_rounds_weight: float = option(
        0.0,
        help="Round R also trains on every earlier round's answers at this weight (train --version-weight; 0: round R's only).",
    )

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.steps_per_round < 1:
            raise RoundsError("--rounds and --steps-per-round must be at least 1")
        if not 0 <= self.earlier_rounds_weight < float("inf"):
            raise RoundsError(f"--earlier-rounds-weight must be a finite weight >= 0, got {self.earlier_rounds_weight}")


def tag_of(round_: int) -> str:
    return f"round-{round_}"


def run_rounds(r: Rounds, *, log) -> list[dict]:
    """Every round: build, tag, train. Returns each round's `{"round", "version", "build", "train"}`."""
    from logitstore.pipelines.build import run_builds
    from logitstore.store.store import Store
    from logitstore.trainer import checkpoint
    from logitstore.trainer.train import launch

    refuse_before_round_one(r)
    done = []
    students = _student_tokenizers(r)
    for n in range(1, r.rounds + 1):
        store = Store.open_if_exists(r.store)
        built = None
        if store is None or not _has_version(store, tag_of(n)):
            cfg = BuildConfig(
                store=r.store,
                data=r.prompts,
                prompt_column=r.prompt_column,
                chat_column=r.chat_column,
                generate=r.generate,
                generator=None if n == 1 else str(Path(r.out) / "final"),
                samples_per_prompt=r.samples_per_prompt,
                generation_temperature=r.generation_temperature,
                generation_top_p=r.generation_top_p,
                generation_round=n,
                seed=r.seed + n,
                max_length=r.max_length,
                on_duplicate="replace",
                student_tokenizers=students,
                message=f"on-policy round {n}",
            )
            built = run_builds(cfg, [r.teacher] if r.teacher else [None], log=log).to_json()
            Store.open(r.store).tag(tag_of(n), version=built["version"])
        flags = train_flags(r, n, resume=n > 1 or (Path(r.out) / RUN_MARKER).exists())
        on = flags.get("version") or ", ".join(show_weights(flags["version_weights"]))
        latest = checkpoint.latest(Path(r.out)) if Path(r.out).is_dir() else None
        step = 0 if latest is None else checkpoint.step_of(latest)
        if step > n * r.steps_per_round:  # a later round trains already: this one is done (a driver started again)
            log(f"rounds: round {n}: trained already (the run is at step {step})")
            trained = {"step": n * r.steps_per_round}
        else:
            log(f"rounds: round {n}: training to step {n * r.steps_per_round} on version {on}")
            trained = launch(TrainConfig.from_flags(**flags))
        done.append({"round": n, "version": Store.open(r.store).resolve(tag_of(n)), "build": built, "train": trained})
    return done


def refuse_before_round_one(r: Rounds) -> None:
    """What training would refuse only after round 1 was built and committed, said before: its flags
    (`--seq-len`, `--micro-batch`), the student's positions, and `--out` (a file, a folder that cannot be
    written or holds files of no run; taken away again when made here). A folder a run marked is the
    run's own, which a driver started again continues: training checks it."""
    from logitstore.trainer import run_folder  # the trainer's modules load torch: not at every --help
    from logitstore.trainer.train import check_student_fits

    marked = (Path(r.out) / RUN_MARKER).exists()
    cfg = TrainConfig.from_flags(**train_flags(r, 1, resume=marked))
    check_student_fits(cfg)
    if not marked:
        run_folder.unmake(run_folder.plan(cfg))


def train_flags(r: Rounds, n: int, *, resume: bool) -> dict:
    """`train`'s flags of round n: its version, or with `--earlier-rounds-weight W` > 0 the mix of its
    version at weight 1 and every earlier round's at W (`train --version-weight`)."""
    flags = dict(store=r.store, out=r.out, steps=n * r.steps_per_round, seq_len=r.seq_len)
    flags.update(micro_batch=r.micro_batch, eval_fraction=0.0)
    if r.earlier_rounds_weight > 0 and n > 1:
        flags["version_weights"] = {tag_of(n): 1.0, **{tag_of(k): r.earlier_rounds_weight for k in range(1, n)}}
    else:
        flags["version"] = tag_of(n)
    if r.student:
        flags["student"] = r.student
    if resume:
        flags.update(resume=True, new_version=True)
    return flags


def _student_tokenizers(r: Rounds) -> tuple[str, ...]:
    """`--student-tokenizer` of every round's build: a student folder whose tokenizer is not the teacher's
    (its answers, from round 2, cross tokenizers too), so training has targets aligned to it."""
    from logitstore.pipelines.teacher import describe_teacher
    from logitstore.trainer.model import student_tokenizer_hash

    if r.student is None or student_tokenizer_hash(r.student) in (None, describe_teacher(r.teacher).tokenizer_hash):
        return ()
    return (r.student,)


def _has_version(store, name: str) -> bool:
    try:
        store.resolve(name)
    except VersionNotFoundError:
        return False
    return True
