"""`TrainConfig`: every option of `logitstore train`, in groups, validated on construction (errors name
the flag), before any process starts.

    data       where the teacher signal comes from and how it is packed (`DataConfig`)
    student    the model and how it runs (`StudentConfig`)
    optim      the optimizer and the batch (`OptimConfig`)
    loss       the distillation loss (`losses.LossConfig`)
    schedule   how long, and when to evaluate, checkpoint and log (`ScheduleConfig`)
    output     the run folder and where metrics go (`OutputConfig`)
    live       live mode's teacher and data (`live.LiveConfig`), instead of `data.store`

`TrainConfig.from_flags(**flags)` takes the command line's flat names (`seq_len=`, `lr=`, `loss=`, ...)
and puts each in its group: the CLI's `train` is that mapping and nothing else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from logitstore.chat import TRAIN_ON
from logitstore.errors import LogitstoreError
from logitstore.sizes import parse_bytes
from logitstore.trainer.losses import LossConfig
from logitstore.trainer.report import check_sinks
from logitstore.trainer.spec import DEFAULT_MEMORY_BUDGET, StreamSpec

if TYPE_CHECKING:  # for the annotation only: a store run's configuration need not import live mode
    from logitstore.trainer.live import LiveConfig

EVAL_ONLY = "-"  # the `out` of a configuration that only evaluates (`logitstore eval`): it writes nothing


class TrainConfigError(LogitstoreError):
    """An option of `logitstore train` is out of range."""


def _check(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise TrainConfigError(message)


@dataclass
class DataConfig:
    store: str | None = None  # None in live mode
    version: str | None = None
    teacher: str | None = None
    # Several teachers: {name: weight} in order (the first one's samples are the run's); see mixing.py
    teacher_weights: dict[str, float] | None = None
    student_tokenizer: str | None = None  # a built-in student uses this store student tokenizer
    seq_len: int = 256
    micro_batch: int = 4  # rows of seq_len tokens per rank per micro-step
    eval_fraction: float = 0.05
    on_error: str = "raise"  # a damaged sample: "raise" stops the run, "skip" skips and counts it
    memory_budget: str = (
        DEFAULT_MEMORY_BUDGET  # stored data a rank's stream holds (bytes or "512MB"); sets the shuffle window
    )
    train_on: str = "completion"  # chat data (logitstore.chat): supervise the completion, or prompt+completion

    def __post_init__(self) -> None:
        _check(
            [
                (self.train_on in TRAIN_ON, f"--train-on must be one of {', '.join(TRAIN_ON)}"),
                (self.seq_len >= 2, "--seq-len must be at least 2"),
                (self.micro_batch >= 1, "--micro-batch must be at least 1"),
                (0 <= self.eval_fraction <= 1, "--eval-fraction must be in [0, 1] (0 holds nothing out)"),
                (self.on_error in ("raise", "skip"), "--on-error must be raise or skip"),
                (not (self.teacher_weights and self.teacher), "--teacher and --teacher-weight exclude each other"),
                (all(w > 0 for w in (self.teacher_weights or {}).values()), "--teacher-weight weights must be > 0"),
            ]
        )

        parse_bytes(self.memory_budget, name="--memory-budget")  # a typo fails here, not in every rank


@dataclass
class StudentConfig:
    student: str = "llama-tiny"
    nproc: int = 1
    seed: int = 0
    offload_optimizer: bool = False
    activation_checkpointing: bool = False  # recompute each block's activations in backward: memory for time
    compile: bool = False  # torch.compile each block's feed-forward (a compile per shape first)

    def __post_init__(self) -> None:
        _check([(self.nproc >= 1, "--nproc must be at least 1")])


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    grad_accum: int = 1
    global_batch_tokens: int | None = None  # tokens per optimizer step over all processes: sets grad_accum
    defer_grad_sync: bool = False  # with grad_accum > 1: reduce gradients once per step (holds them unsharded)

    def __post_init__(self) -> None:
        _check(
            [
                (self.lr > 0, "--lr must be positive"),
                (0 <= self.min_lr_ratio <= 1, "--min-lr-ratio must be in [0, 1]"),
                (self.warmup_steps >= 0, "--warmup-steps must be >= 0"),
                (self.grad_clip >= 0, "--grad-clip must be >= 0 (0 disables clipping)"),
                (self.grad_accum >= 1, "--grad-accum must be at least 1"),
            ]
        )


@dataclass
class ScheduleConfig:
    steps: int = 100  # the run's total; a resumed run continues to this step with the same schedule
    tokens: int | None = None  # train on this many tokens: sets steps
    eval_every: int = 0
    eval_batches: int = 8
    checkpoint_every: int = 0
    log_every: int = 1

    def __post_init__(self) -> None:
        _check(
            [
                (self.steps >= 1, "--steps must be at least 1"),
                (self.tokens is None or self.tokens >= 1, f"--tokens must be at least 1, got {self.tokens}"),
                (
                    self.eval_every >= 0 and self.checkpoint_every >= 0,
                    "--eval-every and --checkpoint-every must be >= 0",
                ),
            ]
        )


@dataclass
class OutputConfig:
    out: str = EVAL_ONLY
    resume: bool = False
    force: bool = False
    report_to: tuple[str, ...] = ()  # extra metric sinks beside metrics.jsonl: trainer/report.py's SINKS

    def __post_init__(self) -> None:
        _check([(not (self.resume and self.force), "--resume and --force exclude each other")])

        check_sinks(self.report_to)


# The flat flag names that are not their group's field names.
_RENAMED = {"loss": ("loss", "kind"), "kd_temperature": ("loss", "temperature")}
_GROUPS = {
    "data": DataConfig,
    "student": StudentConfig,
    "optim": OptimConfig,
    "loss": LossConfig,
    "schedule": ScheduleConfig,
    "output": OutputConfig,
}


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    live: LiveConfig | None = None  # `--live-teacher` instead of `--store`

    def __post_init__(self) -> None:
        """The checks and derivations across groups."""
        d = self.data
        _check(
            [
                (
                    d.eval_fraction < 1 or self.output.out == EVAL_ONLY,
                    "--eval-fraction 1 holds out every sample: nothing is left to train on",
                ),
                (
                    not (self.schedule.eval_every and d.eval_fraction == 0),
                    "--eval-every needs a held-out split: --eval-fraction > 0",
                ),
                ((self.live is None) == bool(d.store), "give exactly one of --store and --live-teacher"),
                (
                    self.live is None or not (d.teacher_weights or d.student_tokenizer or d.version),
                    "--live-teacher takes one teacher with the student's tokenizer: no --teacher-weight, "
                    "--student-tokenizer or --version",
                ),
            ]
        )
        if self.optim.global_batch_tokens is not None:  # sets grad_accum
            per_micro_step = d.seq_len * d.micro_batch * self.student.nproc
            if self.optim.global_batch_tokens <= 0 or self.optim.global_batch_tokens % per_micro_step:
                raise TrainConfigError(
                    f"--global-batch-tokens {self.optim.global_batch_tokens} is not a multiple of "
                    f"--seq-len x --micro-batch x --nproc = {per_micro_step}"
                )
            self.optim.grad_accum = self.optim.global_batch_tokens // per_micro_step
        if self.schedule.tokens is not None:  # sets steps
            self.schedule.steps = max(1, -(-self.schedule.tokens // self.tokens_per_step))

    def stream_spec(self, *, rank: int, world_size: int, split: str) -> StreamSpec:
        """The options of this run's stream of `split` for one rank."""
        d = self.data
        return StreamSpec(
            seq_len=d.seq_len,
            micro_batch=d.micro_batch,
            seed=self.student.seed,
            rank=rank,
            world_size=world_size,
            split=split,
            eval_fraction=d.eval_fraction,
            memory_budget=d.memory_budget,
            on_error=d.on_error,
            train_on=d.train_on,
        )

    @classmethod
    def from_flags(cls, *, live=None, **flags) -> TrainConfig:
        """The configuration of `logitstore train`'s flags, by their flat names (`seq_len=`, `loss=`, ...)."""
        groups: dict[str, dict] = {name: {} for name in _GROUPS}
        owner = {f.name: (name, f.name) for name, group in _GROUPS.items() for f in dataclasses.fields(group)}
        owner.update(_RENAMED)
        for flag, value in flags.items():
            if flag not in owner:
                raise TypeError(f"TrainConfig.from_flags got an unknown option {flag!r}")
            group, name = owner[flag]
            groups[group][name] = value
        return cls(**{name: group(**groups[name]) for name, group in _GROUPS.items()}, live=live)

    def with_version(self, version: str) -> TrainConfig:
        """The same run reading `version` (a resumed run reads the snapshot its run pinned)."""
        return dataclasses.replace(self, data=dataclasses.replace(self.data, version=version))

    @property
    def tokens_per_step(self) -> int:
        return self.data.seq_len * self.data.micro_batch * self.optim.grad_accum * self.student.nproc

    def run_identity(self) -> dict:
        """What must match to resume into an existing `--out` (not the step count, nor the process count),
        flat by flag name. Not `version` either: a resumed run reads the snapshot its run pinned, and
        `--version`, when given, is checked against that snapshot (a branch name names another one once
        the branch moves)."""
        skip = {
            "out",
            "steps",
            "resume",
            "force",
            "nproc",
            "log_every",
            "eval_every",
            "checkpoint_every",
            "on_error",
            "version",
            "global_batch_tokens",
            "tokens",
            "activation_checkpointing",
            "compile",
            "defer_grad_sync",
            "report_to",
        }
        flat = {}
        for name in _GROUPS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        flat["loss"], flat["kd_temperature"] = flat.pop("kind"), flat.pop("temperature")
        flat["store"], flat["live"] = self.data.store, None if self.live is None else dataclasses.asdict(self.live)
        if flat["train_on"] == "completion":  # the default is left out: runs from before the flag still resume
            del flat["train_on"]
        return {k: v for k, v in flat.items() if k not in skip}
