"""`TrainConfig`: every option of `logitstore train`, validated on construction (errors name the flag)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from logitstore.errors import LogitstoreError
from logitstore.trainer.stream import DEFAULT_MEMORY_BUDGET


EVAL_ONLY = "-"  # the `out` of a configuration that only evaluates (`logitstore eval`): it writes nothing


class TrainConfigError(LogitstoreError):
    """An option of `logitstore train` is out of range."""


@dataclass
class TrainConfig:
    store: str | None  # None in live mode
    out: str
    student: str = "llama-tiny"
    version: str | None = None
    teacher: str | None = None
    # Several teachers: {name: weight} in order (the first one's samples are the run's); see teachers.py
    teacher_weights: dict[str, float] | None = None
    student_tokenizer: str | None = None  # a built-in student uses this store student tokenizer
    uld_weight: float = 1.0  # cross-tokenizer teachers: weight of the sorted-probability (ULD) term
    nproc: int = 1
    steps: int = 100  # the run's total; a resumed run continues to this step with the same schedule
    seq_len: int = 256
    micro_batch: int = 4  # rows of seq_len tokens per rank per micro-step
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    loss: str = "forward_kl"
    kd_temperature: float = 1.0
    alpha: float = 0.0
    jsd_beta: float = 0.5
    eval_every: int = 0
    eval_fraction: float = 0.05
    eval_batches: int = 8
    checkpoint_every: int = 0
    resume: bool = False
    force: bool = False
    offload_optimizer: bool = False
    on_error: str = "raise"  # a damaged sample: "raise" stops the run, "skip" skips and counts it
    memory_budget: str = DEFAULT_MEMORY_BUDGET  # stored data a rank's stream holds (bytes or "512MB"); sets the shuffle window
    log_every: int = 1
    live: object = None  # trainer.live.LiveConfig: `--live-teacher` instead of `--store`

    def __post_init__(self) -> None:
        checks = [
            (self.nproc >= 1, "--nproc must be at least 1"),
            (self.steps >= 1, "--steps must be at least 1"),
            (self.seq_len >= 2, "--seq-len must be at least 2"),
            (self.micro_batch >= 1, "--micro-batch must be at least 1"),
            (self.grad_accum >= 1, "--grad-accum must be at least 1"),
            (self.lr > 0, "--lr must be positive"),
            (0 <= self.min_lr_ratio <= 1, "--min-lr-ratio must be in [0, 1]"),
            (self.warmup_steps >= 0, "--warmup-steps must be >= 0"),
            (self.grad_clip >= 0, "--grad-clip must be >= 0 (0 disables clipping)"),
            (0 <= self.eval_fraction <= 1, "--eval-fraction must be in [0, 1] (0 holds nothing out)"),
            (self.eval_fraction < 1 or self.out == EVAL_ONLY,
             "--eval-fraction 1 holds out every sample: nothing is left to train on"),
            (not (self.eval_every and self.eval_fraction == 0), "--eval-every needs a held-out split: --eval-fraction > 0"),
            (self.eval_every >= 0 and self.checkpoint_every >= 0, "--eval-every and --checkpoint-every must be >= 0"),
            (self.on_error in ("raise", "skip"), "--on-error must be raise or skip"),
            (not (self.resume and self.force), "--resume and --force exclude each other"),
            (self.uld_weight >= 0, "--uld-weight must be >= 0"),
            ((self.live is None) == bool(self.store), "give exactly one of --store and --live-teacher"),
            (self.live is None or not (self.teacher_weights or self.student_tokenizer or self.version),
             "--live-teacher takes one teacher with the student's tokenizer: no --teacher-weight, "
             "--student-tokenizer or --version"),
            (not (self.teacher_weights and self.teacher), "--teacher and --teacher-weight exclude each other"),
            (all(w > 0 for w in (self.teacher_weights or {}).values()), "--teacher-weight weights must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise TrainConfigError(message)
        from logitstore.sizes import parse_bytes

        parse_bytes(self.memory_budget, name="--memory-budget")  # a typo fails here, not in every rank

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.grad_accum * self.nproc

    def run_identity(self) -> dict:
        """What must match to resume into an existing `--out` (not the step count, nor the process count).
        Not `version` either: a resumed run reads the snapshot its run pinned, and `--version`, when
        given, is checked against that snapshot (a branch name names another one once the branch moves)."""
        skip = {"out", "steps", "resume", "force", "nproc", "log_every", "eval_every", "checkpoint_every", "on_error",
                "version"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
