"""`TrainConfig`: every option of `logitstore train`, in groups, validated on construction (errors name
the flag), before any process starts.

    data       where the teacher signal comes from and how it is packed (`DataConfig`)
    student    the model and how it runs (`StudentConfig`)
    optim      the optimizer and the batch (`OptimConfig`)
    loss       the distillation loss (`LossConfig`)
    schedule   how long, and when to evaluate, checkpoint and log (`ScheduleConfig`)
    output     the run folder and where metrics go (`OutputConfig`)
    live       live mode's teacher and data (`LiveConfig`, live/config.py), instead of `data.store`

Each field that is a flag of `logitstore train` (or `eval`) is declared with `options.option` (help and
panel beside it) or taken whole from the type that declares it (the stream's defaults from `StreamSpec`,
live mode's from `LiveConfig`); the CLI, `--config` and `--print-config` read them
here, and `TrainConfig.from_flags(**flags)` takes the same flat names from Python. No torch is imported:
the CLI builds its flags, and a configuration is checked, before the training stack loads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args

from logitstore.errors import LogitstoreError
from logitstore.live.config import LIVE, LiveConfig
from logitstore.options import (
    KEY,
    Flag,
    declared,
    group,
    option,
    parse_weights,
    read_file,
    refuse_failed,
    show_weights,
    to_values,
)
from logitstore.sizes import parse_bytes
from logitstore.streaming.spec import DEFAULT_MEMORY_BUDGET, ON_ERROR, OnError, StreamConfigError, StreamSpec
from logitstore.text import TRAIN_ON, TrainOn
from logitstore.trainer.trackers import check_sinks

EVAL_ONLY = "-"  # the `out` of a configuration that only evaluates (`logitstore eval`): it writes nothing
# The distillation losses: each one's definition is its entry in `losses.DIVERGENCES` (the registry, which
# imports torch; these names stay here, where the command line reads them without it).
LossName = Literal["forward_kl", "topk_renorm", "reverse_kl", "jsd"]
LOSS_NAMES: tuple[LossName, ...] = get_args(LossName)

OUTPUT, DATA, STUDENT, OPTIM, LOSS = "Output", "Data", "Student", "Optimisation", "Loss"
CHECKPOINTS = "Checkpoints and evaluation"
PANELS = (OUTPUT, DATA, STUDENT, OPTIM, LOSS, CHECKPOINTS, LIVE)  # the order `train --help` lists them


class TrainConfigError(LogitstoreError):
    """An option of `logitstore train` is out of range."""


class LossConfigError(LogitstoreError, ValueError):
    """A loss option out of range or unusable with the store; the message names the flag."""


def _check(checks: list[tuple[bool, str]]) -> None:
    refuse_failed(checks, TrainConfigError)


def is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def weights_option(name: str, *, what: str, placeholder: str, help: str) -> Any:
    """A repeatable PLACEHOLDER=WEIGHT flag of the data panel, its value {what: weight} in order."""
    flag = "--" + name.replace("_", "-")
    parse = partial(parse_weights, flag=flag, what=what, placeholder=placeholder)
    return option(None, name=name, value_type=list[str], parse=parse, show=show_weights, panel=DATA, help=help)


@dataclass
class DataConfig:
    store: str | None = option(None, panel=DATA, help="Store to train from (required, unless --live-teacher).")
    version: str | None = option(None, panel=DATA, help="Version id, tag or branch (default: main).")
    # a weighted mix of versions: {version: weight} (samples per epoch per stored sample); see streaming/version_mix.py
    version_weights: dict[str, float] | None = weights_option(
        "version_weight",
        what="version",
        placeholder="VERSION",
        help="VERSION=WEIGHT: train on several versions of the store at once, each sample of VERSION about WEIGHT times per epoch (repeatable; instead of --version; docs/train.md 'Mixing versions').",
    )
    teacher: str | None = option(None, panel=DATA, help="Teacher name, when the store holds several.")
    # Several teachers: {name: weight} in order (the first one's samples are the run's); see mixing.py
    teacher_weights: dict[str, float] | None = weights_option(
        "teacher_weight",
        what="teacher",
        placeholder="NAME",
        help="NAME=WEIGHT: learn from several teachers at once (repeatable; the first one's samples are the run's).",
    )
    student_tokenizer: str | None = option(
        None,
        panel=DATA,
        help="A built-in student uses this student tokenizer of the store (see build --student-tokenizer).",
    )
    seq_len: int = option(256, panel=DATA, help="Tokens per packed row.")
    micro_batch: int = option(4, panel=DATA, help="Rows per process per micro-step.")
    # stored data a rank's stream holds (bytes or "512MB"); sets the shuffle window
    memory_budget: str = option(
        DEFAULT_MEMORY_BUDGET,
        panel=DATA,
        help="Stored data each process's stream holds in memory (e.g. 512MB); a store larger than this is read in windows of parts, shuffled within each (docs/train.md 'Streaming').",
    )
    on_error: OnError = option(
        StreamSpec.on_error,
        choices=lambda: ON_ERROR,
        panel=DATA,
        help="A damaged sample: raise (stop) or skip (and count).",
    )
    # the order depends on it, never on the world size; a resumed run keeps its checkpoint's
    reader_groups: int | None = option(
        None,
        panel=DATA,
        help="Groups the store's parts are dealt to, each read by its own ranks (default: --nproc x nodes at the start; a resumed run keeps its own): a world size that divides it reads each stored byte about once per epoch (docs/train.md 'Many nodes').",
    )
    eval_fraction: float = option(
        StreamSpec.eval_fraction, panel=DATA, help="Share of samples held out, by sample id hash."
    )
    train_on: TrainOn = option(
        StreamSpec.train_on,
        choices=lambda: TRAIN_ON,
        panel=DATA,
        help="Chat data: supervise the completion (the assistant's tokens) or prompt+completion; plain text stores supervise every token either way.",
    )

    def __post_init__(self) -> None:
        try:  # the stream's own checks, each naming its flag
            self.stream_spec(seed=0, rank=None, world_size=None, split="train")
        except StreamConfigError as e:
            assert e.field is not None, "a StreamSpec check names its field"
            raise TrainConfigError(f"--{e.field.replace('_', '-')}{str(e)[len(e.field) :]}") from None
        _check(
            [
                (not (self.teacher_weights and self.teacher), "--teacher and --teacher-weight exclude each other"),
                (all(w > 0 for w in (self.teacher_weights or {}).values()), "--teacher-weight weights must be > 0"),
                (not (self.version_weights and self.version), "--version and --version-weight exclude each other"),
                (all(w > 0 for w in (self.version_weights or {}).values()), "--version-weight weights must be > 0"),
            ]
        )

        parse_bytes(self.memory_budget, name="--memory-budget")  # a typo fails here, not in every rank

    def stream_spec(self, *, seed: int, rank: int | None, world_size: int | None, split: str) -> StreamSpec:
        """The stream these options make (for one rank where `rank` is given)."""
        return StreamSpec(
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
            seed=seed,
            rank=rank,
            world_size=world_size,
            split=split,
            eval_fraction=self.eval_fraction,
            memory_budget=self.memory_budget,
            on_error=self.on_error,
            train_on=self.train_on,
            reader_groups=self.reader_groups,
        )


@dataclass
class StudentConfig:
    student: str = option(
        "llama-tiny",
        panel=STUDENT,
        help="Hugging Face causal-LM directory, Hub id (org/name[@rev]), or a built-in config (llama-tiny, llama-small, smollm2-135m).",
    )
    nproc: int = option(1, panel=STUDENT, help="Processes to launch (gloo on CPU, NCCL on CUDA).")
    seed: int = option(0, panel=OPTIM, help="Seed for weights and data order.")
    offload_optimizer: bool = option(
        False, panel=STUDENT, help="FSDP2 CPU offload of parameters, gradients and optimizer state."
    )
    # recompute each block's activations in backward: memory for time
    activation_checkpointing: bool = option(
        False,
        panel=STUDENT,
        help="Recompute each block's activations in backward: about one more forward per step, far less memory.",
    )
    # torch.compile each block's feed-forward (a compile per shape first)
    compile: bool = option(
        False,
        panel=STUDENT,
        help="torch.compile each block's feed-forward (compiles first; the attention is fused already).",
    )

    def __post_init__(self) -> None:
        _check([(self.nproc >= 1, "--nproc must be at least 1")])


@dataclass
class OptimConfig:
    lr: float = option(3e-3, panel=OPTIM, help="Peak learning rate.")
    min_lr_ratio: float = option(0.1, panel=OPTIM, help="Final learning rate as a fraction of --lr.")
    warmup_steps: int = option(10, panel=OPTIM, help="Linear warmup steps before the cosine decay.")
    weight_decay: float = option(0.0, panel=OPTIM, help="AdamW weight decay.")
    grad_clip: float = option(1.0, panel=OPTIM, help="Clip the gradient norm (0: off).")
    grad_accum: int = option(1, panel=OPTIM, help="Micro-steps per optimizer step.")
    # tokens per optimizer step over all processes: sets grad_accum
    global_batch_tokens: int | None = option(
        None, panel=OPTIM, help="Tokens per optimizer step over all processes; sets --grad-accum."
    )
    # with grad_accum > 1: reduce gradients once per step (holds them unsharded)
    defer_grad_sync: bool = option(
        False,
        panel=OPTIM,
        help="With --grad-accum > 1, reduce gradients once per step, not per micro-batch (holds them unsharded meanwhile).",
    )

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


@dataclass(frozen=True)
class LossConfig:
    kind: LossName = option(
        "forward_kl",
        name="loss",
        panel=LOSS,
        help="forward_kl (tail bucket), topk_renorm, reverse_kl or jsd.",
    )
    temperature: float = option(1.0, name="kd_temperature", panel=LOSS, help="Distillation temperature.")
    alpha: float = option(0.0, panel=LOSS, help="Weight of cross-entropy on the actual next token.")
    jsd_beta: float = option(0.5, panel=LOSS, help="Mixing weight of --loss jsd.")
    # cross-tokenizer teachers: weight of the sorted-probability (ULD) term
    uld_weight: float = option(
        1.0,
        panel=LOSS,
        help="Cross-tokenizer teachers: weight of the sorted-probability (ULD) term for unmapped tokens.",
    )

    def __post_init__(self) -> None:
        if self.kind not in LOSS_NAMES:
            raise LossConfigError(f"--loss must be one of {', '.join(LOSS_NAMES)}; got {self.kind!r}")
        if not is_real(self.temperature) or not 0 < self.temperature < math.inf:
            raise LossConfigError(f"--kd-temperature must be a finite number > 0; got {self.temperature!r}")
        if not is_real(self.alpha) or not 0 <= self.alpha < math.inf:
            raise LossConfigError(f"--alpha must be a finite number >= 0; got {self.alpha!r}")
        # At beta = 0 or 1 the mixture m equals q or p and the generalized JSD is identically 0.
        if not is_real(self.jsd_beta) or not 0 < self.jsd_beta < 1:
            raise LossConfigError(f"--jsd-beta must be strictly between 0 and 1; got {self.jsd_beta!r}")
        if not is_real(self.uld_weight) or not 0 <= self.uld_weight < math.inf:
            raise LossConfigError(f"--uld-weight must be a finite number >= 0; got {self.uld_weight!r}")


@dataclass
class ScheduleConfig:
    # the run's total; a resumed run continues to this step with the same schedule
    steps: int = option(100, panel=OPTIM, help="Total optimizer steps of the run (a resumed run continues to it).")
    tokens: int | None = option(None, panel=OPTIM, help="Train on this many tokens instead of --steps.")
    eval_every: int = option(0, panel=CHECKPOINTS, help="Evaluate on the held-out split every N steps (0: never).")
    eval_batches: int = 8
    checkpoint_every: int = option(0, panel=CHECKPOINTS, help="Checkpoint every N steps (0: only at the end).")
    log_every: int = option(1, panel=CHECKPOINTS, help="Read the steps' values back and print a line every N steps.")

    def __post_init__(self) -> None:
        _check(
            [
                (self.steps >= 1, "--steps must be at least 1"),
                (self.log_every >= 1, "--log-every must be at least 1"),
                (self.tokens is None or self.tokens >= 1, f"--tokens must be at least 1, got {self.tokens}"),
                (
                    self.eval_every >= 0 and self.checkpoint_every >= 0,
                    "--eval-every and --checkpoint-every must be >= 0",
                ),
            ]
        )


@dataclass
class OutputConfig:
    out: str = option(
        EVAL_ONLY,
        cli_default=None,
        required=True,
        panel=OUTPUT,
        help="Run folder: checkpoints, metrics.jsonl, final/. A new or empty folder, or one a run marked (logitstore-run.json). Required.",
    )
    resume: bool = option(
        False,
        panel=OUTPUT,
        help="Continue from the newest complete checkpoint in --out, with the configuration the run kept there, on the store snapshot it pinned (a finished run: nothing to do).",
    )
    # continue a run on another store version (on-policy rounds): its samples are new data
    new_version: bool = option(
        False,
        panel=OUTPUT,
        help="With --resume and --version: continue the run (student, optimizer, step) on this other store version, its samples as new data (the data position starts over); the run records each version it read (docs/train.md 'On-policy rounds').",
    )
    force: bool = option(
        False,
        panel=OUTPUT,
        help="Replace the run in --out: removes only what a run writes, and only in a folder a run marked.",
    )
    # extra metric sinks beside metrics.jsonl: trainer/trackers.py's SINKS
    report_to: tuple[str, ...] = option(
        (),
        panel=OUTPUT,
        help="Also send the metrics to tensorboard (OUT/tensorboard), wandb (WANDB_MODE=offline: OUT/wandb only) or mlflow (MLFLOW_TRACKING_URI); each needs its extra, e.g. pip install 'logitstore\\[wandb]' (docs/train.md 'Trackers'). Repeatable.",
    )

    def __post_init__(self) -> None:
        _check([(not (self.resume and self.force), "--resume and --force exclude each other")])
        _check([(self.resume or not self.new_version, "--new-version continues a run: it needs --resume")])

        check_sinks(self.report_to)


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
    data: DataConfig = group(DataConfig, default_factory=DataConfig)
    student: StudentConfig = group(StudentConfig, default_factory=StudentConfig)
    optim: OptimConfig = group(OptimConfig, default_factory=OptimConfig)
    loss: LossConfig = group(LossConfig, default_factory=LossConfig)
    schedule: ScheduleConfig = group(ScheduleConfig, default_factory=ScheduleConfig)
    output: OutputConfig = group(OutputConfig, default_factory=OutputConfig)
    # `--live-teacher` instead of `--store`
    live: LiveConfig | None = group(LiveConfig, default=None, parse=LiveConfig.from_values, show=LiveConfig.values_of)

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
                ((self.live is None) == bool(d.store), "give exactly one of --store and --live-teacher (or --live)"),
                (
                    self.live is None
                    or not (d.teacher_weights or d.student_tokenizer or d.version or d.version_weights),
                    "--live-teacher takes one teacher with the student's tokenizer: no --teacher-weight, "
                    "--student-tokenizer, --version or --version-weight",
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
        return self.data.stream_spec(seed=self.student.seed, rank=rank, world_size=world_size, split=split)

    @classmethod
    def from_flags(cls, *, live=None, **flags) -> TrainConfig:
        """The configuration of `logitstore train`'s flags, by their flat names (`seq_len=`, `loss=`, ...;
        also the group fields that are no flag, e.g. `eval_batches=`). Values are the fields' (a dict of
        teacher weights, a tuple of sinks), not the command line's."""
        groups: dict[str, dict] = {name: {} for name in _GROUPS}
        owner = {f.name: (name, f.name) for name, group in _GROUPS.items() for f in dataclasses.fields(group)}
        owner.update(_renamed())
        for flag, value in flags.items():
            if flag not in owner:
                raise TypeError(f"TrainConfig.from_flags got an unknown option {flag!r}")
            group, name = owner[flag]
            groups[group][name] = value
        return cls(**{name: group(**groups[name]) for name, group in _GROUPS.items()}, live=live)

    @classmethod
    def for_eval(cls, *, store: str, student: str, **flags) -> TrainConfig:
        """`logitstore eval`'s configuration: the held-out split of `store`, all of it, nothing written."""
        return cls.from_flags(store=store, out=EVAL_ONLY, student=student, eval_batches=1 << 30, **flags)

    def with_version(self, version: str | dict[str, float]) -> TrainConfig:
        """The same run reading `version`, a snapshot or a mix {snapshot: weight} (what a resumed run pinned)."""
        one, mix = (None, dict(version)) if isinstance(version, dict) else (version, None)
        data = dataclasses.replace(self.data, version=one, version_weights=mix)
        return dataclasses.replace(self, data=data)

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
            "new_version",
            "nproc",
            "log_every",
            "eval_every",
            "checkpoint_every",
            "on_error",
            "version",
            "version_weights",
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
        flat["store"], flat["live"] = self.data.store, None if self.live is None else self.live.identity()
        if flat["train_on"] == StreamSpec.train_on:  # the default left out: a run that records none resumes
            del flat["train_on"]
        return {k: v for k, v in flat.items() if k not in skip}


def _renamed() -> dict[str, tuple[str, str]]:
    """The flat flag names that are not their group's field names (`loss` is `loss.kind`); not those
    whose value is not the field's (`teacher_weight`: `teacher_weights=` takes the dict)."""
    out = {}
    for name, group_type in _GROUPS.items():
        for f in dataclasses.fields(group_type):
            flag = f.metadata.get(KEY)
            if isinstance(flag, Flag) and flag.name and flag.parse is None:
                out[flag.name] = (name, f.name)
    return out


# -- the configuration a run folder keeps -------------------------------------------------------------

RUN_CONFIG = "config.yaml"  # in --out: the configuration the run runs with (`run_folder.claim` writes it)
# Left to the command that resumes: what it does to the folder (never written to it), and the version
# (a resumed run reads the snapshot its run pinned; a branch named at its start may name another now).
PER_COMMAND = ("resume", "force", "new_version")
_NOT_KEPT = (*PER_COMMAND, "version", "version_weight")


def kept_values(cfg: TrainConfig) -> dict[str, Any]:
    """What `RUN_CONFIG` holds: the run's flags, as `--config` takes them."""
    return {k: v for k, v in to_values(cfg).items() if k not in PER_COMMAND}


def read_kept(out: str | None) -> dict[str, Any] | None:
    """The configuration the run in `out` kept (None: no run, or one that keeps none, or its
    file is gone: `missing_kept` says which), without what a resuming command decides (`_NOT_KEPT`)."""
    path = Path(out or "") / RUN_CONFIG
    if out is None or not path.is_file():
        return None
    kept = read_file(path, declared(TrainConfig), command="train")
    return {k: v for k, v in kept.items() if k not in _NOT_KEPT}


def missing_kept(out: str) -> str:
    """Why `read_kept(out)` found no configuration, in words."""
    path = Path(out) / RUN_CONFIG
    if not Path(out).is_dir():
        return "no such folder"
    if path.exists():
        return f"its {RUN_CONFIG} is not a file"
    return f"no {RUN_CONFIG} in it"
