"""The engine interface: `Engine`, what runs the teacher's forward passes in a build (and in live mode), and
`Generator`, what writes answers for `build --generate`.

Every engine subclasses `Engine` (`TorchEngine`, `VllmEngine`, `ServerEngine`) and every generator
`Generator`, so mypy checks each against its protocol, and the registry (`engines/__init__.py`) returns them
as these types. The hooks only some engines need (`live`, `settled`, `recorded`, `take_skips`) are part of
`Engine` with the defaults an engine without them means: the build calls them on every engine. docs/build.md
"Engines" has the contract in full.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from logitstore.errors import LogitstoreError

if TYPE_CHECKING:  # only their types are named here (a TeacherSpec's module loads torch)
    from logitstore.format.samples import SparseSamples
    from logitstore.format.sparsity import Sparsity
    from logitstore.pipelines.engines.settings import WorkerSettings
    from logitstore.pipelines.teacher_files import TeacherSpec


class EngineError(LogitstoreError):
    """An engine that does not exist, or cannot run this build here."""


class Engine(Protocol):
    """A teacher engine, built from a `WorkerSettings`; `spec` is the teacher's `TeacherSpec`. `samples` alone
    is also asked with a `BuildConfig` (its default sparsity is settled before a teacher is resolved)."""

    name: ClassVar[str]  # what `--engine` calls it
    # where live mode (`train --live-teacher`) runs it: "process" (a teacher process beside each rank, handing
    # over by shared memory or CUDA IPC), "rank" (the rank calls it itself: it holds no model), None: refused
    live: ClassVar[str | None] = None
    spec: TeacherSpec
    vocab_size: int  # the teacher's output width
    device: Any = None  # the `torch.device` its tensors are on (live mode's "process" hands them over); None: none

    @classmethod
    def samples(cls, settings: Any) -> bool:
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
    def settled(cls, settings: WorkerSettings, spec: TeacherSpec) -> tuple[Sparsity, str | None]:
        """After `check`: the sparsity the build stores, and a line the build starts with (None: no line)."""
        return settings.sparsity, None

    @classmethod
    def recorded(cls, settings: WorkerSettings, spec: TeacherSpec) -> dict:
        """More of `TeacherMeta`'s fields to record (none by default)."""
        return {}

    def __init__(self, settings: WorkerSettings, *, lock: threading.Lock) -> None:
        """Loads the teacher; `lock` is held around forward passes only."""
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

    def __init__(self, settings: WorkerSettings, *, spec: TeacherSpec, shares_teacher: bool) -> None:
        """Loads the generator `spec` with the build's device, dtype and batch budget; `shares_teacher`: it is
        the teacher, whose loaded weights (or server) it may share with the engine in this process."""
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
