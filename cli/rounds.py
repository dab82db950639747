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

from logitstore.errors import VersionNotFoundError
from logitstore.options import show_weights
from logitstore.pipelines.config import BuildConfig
from logitstore.store.meta import RUN_MARKER
from logitstore.trainer.config import DataConfig, TrainConfig


@dataclass(frozen=True)
class Rounds:
    """`logitstore rounds`' options, and their defaults (the command's flags take theirs from here)."""

    store: str
    out: str
    prompts: str
    rounds: int
    steps_per_round: int
    generate: int = 256
    prompt_column: str | None = None
    chat_column: str | None = None
    teacher: str | None = None
    student: str | None = None
    samples_per_prompt: int = BuildConfig.samples_per_prompt
    generation_temperature: float = BuildConfig.generation_temperature
    generation_top_p: float = BuildConfig.generation_top_p
    seed: int = 0
    max_length: int = BuildConfig.max_length
    seq_len: int = DataConfig.seq_len
    micro_batch: int = 8
    earlier_rounds_weight: float = 0.0


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
