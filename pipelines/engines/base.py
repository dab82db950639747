"""The engine interface: `Engine`, what runs the teacher's forward passes in a build (and in live mode), and
`Generator`, what writes answers for `build --generate`.

Every engine subclasses `Engine` (`TorchEngine`, `VllmEngine`, `ServerEngine`) and every generator
`Generator`, so mypy checks each against its protocol, and the registry (`engines/__init__.py`) returns them
as these types. The hooks only some engines need (`live`, `settle`, `recorded`, `take_skips`) are part of
`Engine` with the defaults an engine without them means: the build calls them on every engine. docs/build.md
"Engines" has the contract in full.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import numpy as np

from logitstore.errors import LogitstoreError
from logitstore.format.sparsity import default_sparsity, settle

if TYPE_CHECKING:  # only their types are named here (a TeacherSpec's module loads torch)
    from logitstore.format.samples import SparseSamples
    from logitstore.pipelines.engines.settings import WorkerSettings
    from logitstore.pipelines.teacher_files import TeacherSpec


class EngineError(LogitstoreError):
    """An engine that does not exist, or cannot run this build here."""


class Settled(NamedTuple):
    """What `Engine.settle` returns."""

    settings: WorkerSettings  # with the `Sparsity` the engine stores, and what its check found (`checked`)
    note: str | None = None  # a line the build starts with (the server's K)


class HandOver:
    """What a build's generator hands its engine where the teacher generates its own answers in this process
    (`build --generate`, one worker): answers scored in their generating request (the served teacher's),
    by the digest of prompt + answer tokens, until the engine's `compute` takes them instead of asking
    again. The build's plan owns one and passes it to both (`BuildPlan.hand_over`); what is never taken
    (a sample already stored, a dry run) goes with the plan."""

    def __init__(self) -> None:
        self._arrays: dict[bytes, dict] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(tokens) -> bytes:
        return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).digest()

    def put(self, tokens, arrays: dict) -> None:
        with self._lock:
            self._arrays[self.key(tokens)] = arrays

    def take(self, tokens) -> dict | None:
        with self._lock:
            return self._arrays.pop(self.key(tokens), None)


class Engine(Protocol):
    """A teacher engine, built from settled `WorkerSettings` (`settle`); `spec` is the teacher's `TeacherSpec`.
    The build calls `check`, then `settle`, then builds engines from the settled settings."""

    name: ClassVar[str]  # what `--engine` calls it
    # where live mode (`train --live-teacher`) runs it: "process" (a teacher process beside each rank, handing
    # over by shared memory or CUDA IPC), "rank" (the rank calls it itself: it holds no model), None: refused
    live: ClassVar[str | None] = None
    spec: TeacherSpec
    vocab_size: int  # the teacher's output width
    device: Any = None  # the `torch.device` its tensors are on (live mode's "process" hands them over); None: none

    @classmethod
    def samples(cls, settings: WorkerSettings) -> bool:
        """Whether, so configured, it stores sampled entries (`--sample N`) exactly; the default sparsity is
        top-64 where it cannot."""
        ...

    @classmethod
    def check(cls, settings: WorkerSettings, spec: TeacherSpec) -> None:
        """Refuses, in one line, what cannot run here (a missing package, no GPU, an unsupported sparsity or
        model format) before anything is written."""
        ...

    @classmethod
    def resolved_dtype(cls, settings: WorkerSettings) -> str:
        """The dtype `--dtype auto` means for this engine."""
        ...

    @classmethod
    def gpus_per_worker(cls, settings: WorkerSettings) -> int:
        """The GPUs one worker of this engine takes (0: none)."""
        ...

    @classmethod
    def version(cls) -> str:
        """The engine's packages and versions, recorded in the teacher's metadata."""
        ...

    @classmethod
    def settle(cls, settings: WorkerSettings) -> Settled:
        """After `check`: the settings with the sparsity the build stores, the one place a sparsity is
        settled. Asked exactly, the sparsity stays; asked for the default (no --top-k/--top-p/--sample),
        `default_sparsity`: sampled 16, or top-64 where the engine cannot draw or student tokenizers are
        aligned."""
        default = default_sparsity(student_tokenizers=settings.aligns_students, engine_samples=cls.samples(settings))
        return Settled(dataclasses.replace(settings, sparsity=settle(settings.sparsity, default=default)))

    @classmethod
    def recorded(cls, settings: WorkerSettings, spec: TeacherSpec) -> dict:
        """More of `TeacherMeta`'s fields to record (none by default)."""
        return {}

    def __init__(self, settings: WorkerSettings, *, lock: threading.Lock, hand_over: HandOver | None = None) -> None:
        """Loads the teacher; `lock` is held around forward passes only; `hand_over`: what the build's
        generator scored already (`HandOver`), where it shares the teacher with this engine."""
        ...

    def compute(
        self,
        sample_ids: list[str],
        tokens: list[np.ndarray],
        *,
        seed: int,
        keep: list | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> SparseSamples:
        """Sparse distributions of whole samples (`keep`: per sample, the positions whose entries are kept, or
        None for all; an engine may compute more); `on_batch(tokens)` after each batch."""
        ...

    def take_skips(self, sample_ids: list[str]) -> Counter:
        """The samples of these that `compute` left out, by reason (none by default)."""
        return Counter()

    def close(self) -> None:
        """Gives back what the engine holds (a teacher, engine-core processes); idempotent. Every executor
        calls it on success, failure and interruption: a process left behind would keep a GPU's memory, or
        hang the build's exit waiting for it."""
        ...


class Generator(Protocol):
    """What writes answers (`build --generate`, `pipelines/generate.py`)."""

    stop_ids: list[int]  # the tokens that end an answer (the model's generation config)

    def __init__(
        self, settings: WorkerSettings, *, spec: TeacherSpec, shares_teacher: bool, hand_over: HandOver | None = None
    ) -> None:
        """Loads the generator `spec` with the build's device, dtype and batch budget; `shares_teacher`: it is
        the teacher, whose loaded weights (or server) it may share with the engine in this process, and
        `hand_over` what it scores for that engine (`HandOver`)."""
        ...

    def generate(
        self, prompts: list[np.ndarray], seeds: list[int], *, max_new_tokens: int, temperature: float, top_p: float
    ) -> list[np.ndarray]:
        """Each prompt's answer: at most `max_new_tokens` ids, ending with a stop token unless cut; `seeds`: one
        32-bit seed per prompt, which alone decides its draws."""
        ...

    def close(self) -> None:
        """As `Engine.close`."""
        ...
