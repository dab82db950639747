"""`TrainConfig`: every option of `logitstore train`, in groups, validated on construction (errors name
the flag), before any process starts.

    data       where the teacher signal comes from and how it is packed (`DataConfig`)
    student    the model and how it runs (`StudentConfig`)
    optim      the optimizer and the batch (`OptimConfig`)
    loss       the distillation loss (`LossConfig`)
    schedule   how long, and when to evaluate, checkpoint and log (`ScheduleConfig`)
    output     the run folder and where metrics go (`OutputConfig`)
    live       live mode's teacher and data (`LiveConfig`), instead of `data.store`

`TrainConfig.from_flags(**flags)` takes the command line's flat names (`seq_len=`, `lr=`, `loss=`, ...)
and puts each in its group: the CLI's `train` is that mapping and nothing else.

This module loads no torch (nor transformers): every error a flag alone can cause is raised before the
training stack loads (~10 s of CPU here), and `tests/test_exit_codes.py` checks that order.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from logitstore.chat import TRAIN_ON
from logitstore.errors import LogitstoreError
from logitstore.sizes import DEFAULT_MEMORY_BUDGET, parse_bytes
from logitstore.sparsity import Sparsity, default_sparsity, sparsity_from_flags
from logitstore.trainer.report import check_sinks

EVAL_ONLY = "-"  # the `out` of a configuration that only evaluates (`logitstore eval`): it writes nothing


class TrainConfigError(LogitstoreError):
    """An option of `logitstore train` is out of range."""


# -- the loss (`trainer/losses.py` computes it) ------------------------------------------------------

KINDS = ("forward_kl", "topk_renorm", "reverse_kl", "jsd")


class LossConfigError(LogitstoreError, ValueError):
    """A loss option out of range or unusable with the store; the message names the flag."""


@dataclass(frozen=True)
class LossConfig:
    kind: str = "forward_kl"
    temperature: float = 1.0
    alpha: float = 0.0
    jsd_beta: float = 0.5
    uld_weight: float = 1.0  # cross-tokenizer teachers: weight of the sorted-probability (ULD) term

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LossConfigError(f"--loss must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if not is_real(self.temperature) or not 0 < self.temperature < math.inf:
            raise LossConfigError(f"--kd-temperature must be a finite number > 0; got {self.temperature!r}")
        if not is_real(self.alpha) or not 0 <= self.alpha < math.inf:
            raise LossConfigError(f"--alpha must be a finite number >= 0; got {self.alpha!r}")
        # At beta = 0 or 1 the mixture m equals q or p and the generalized JSD is identically 0.
        if not is_real(self.jsd_beta) or not 0 < self.jsd_beta < 1:
            raise LossConfigError(f"--jsd-beta must be strictly between 0 and 1; got {self.jsd_beta!r}")
        if not is_real(self.uld_weight) or not 0 <= self.uld_weight < math.inf:
            raise LossConfigError(f"--uld-weight must be a finite number >= 0; got {self.uld_weight!r}")


def is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


# -- live mode (`trainer/live.py` runs it) -------------------------------------------------------------


class LiveTeacherError(LogitstoreError):
    """The live teacher cannot start, or stopped during the run."""


@dataclass
class LiveConfig:
    """What `--live-teacher` needs: build's teacher, data and sparsity options."""

    teacher: str | None = None  # None or "default": the default teacher
    data: str | None = None
    text_column: str = "text"
    id_column: str | None = None
    max_length: int = 1024
    sparsity: Sparsity | None = None  # None: `sparsity.default_sparsity()`, as build and the CLI
    batch_tokens: int = 8192
    device: str = "auto"
    dtype: str = "auto"
    quantize: bool = True

    @classmethod
    def from_flags(
        cls,
        live_teacher: str | None,
        *,
        data=None,
        text_column=None,
        id_column=None,
        max_length=None,
        top_k=None,
        top_p=None,
        sample=None,
        temperature=None,
    ) -> LiveConfig | None:
        """`train --live-teacher` and its flags (None: not given); None without --live-teacher, where any
        of these flags is refused (with --store the build fixed them: they would be silently ignored)."""
        flags = {
            "--data": data,
            "--text-column": text_column,
            "--id-column": id_column,
            "--max-length": max_length,
            "--top-k": top_k,
            "--top-p": top_p,
            "--sample": sample,
            "--temperature": temperature,
        }
        given = [flag for flag, value in flags.items() if value is not None]
        if live_teacher is None:
            if given:
                raise LiveTeacherError(
                    f"{', '.join(given)} only apply with --live-teacher (a store's build fixed them)"
                )
            return None
        sparsity = sparsity_from_flags(
            top_k=top_k,
            top_p=top_p,
            sample=sample,
            temperature=1.0 if temperature is None else temperature,
            default=default_sparsity(),
        )
        return cls(
            teacher=live_teacher,
            data=data,
            text_column=text_column or "text",
            id_column=id_column,
            max_length=1024 if max_length is None else max_length,
            sparsity=sparsity,
        )

    def __post_init__(self) -> None:
        if self.teacher == "default":
            self.teacher = None
        if self.sparsity is None:  # the one default, as `train --live-teacher` without sparsity flags
            self.sparsity = default_sparsity()
        if self.max_length < 2:
            raise LiveTeacherError(f"--max-length must be at least 2, got {self.max_length}")


# -- several teachers (`trainer/mixing.py` mixes them) --------------------------------------------------


def parse_teacher_weights(values: list[str]) -> dict[str, float]:
    """`["A=0.7", "B=0.3"]` -> {"A": 0.7, "B": 0.3}; order kept (the first is the sample set's)."""
    out: dict[str, float] = {}
    for value in values:
        name, sep, weight = value.partition("=")
        try:
            w = float(weight)
        except ValueError:
            w = math.nan
        if not sep or not name or not math.isfinite(w) or w <= 0:
            raise TrainConfigError(f"--teacher-weight {value!r}: expected NAME=WEIGHT with a weight > 0")
        if name in out:
            raise TrainConfigError(f"--teacher-weight: teacher {name!r} given twice")
        out[name] = w
    return out


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

    @classmethod
    def for_eval(cls, *, store: str, student: str, micro_batch: int = 4, seed: int = 0, **flags) -> TrainConfig:
        """`logitstore eval`'s configuration: the held-out split of `store`, all of it, nothing written."""
        return cls.from_flags(
            store=store,
            out=EVAL_ONLY,
            student=student,
            micro_batch=micro_batch,
            seed=seed,
            eval_batches=1 << 30,
            **flags,
        )

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
