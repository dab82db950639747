"""`WorkerSettings`: the one type every engine and generator is built from (`engines/base.py`), made by
the build (`workers.worker_settings`) and by live mode (`live/teacher.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from logitstore.format.sparsity import Sparsity, SparsityFlags
from logitstore.pipelines.engines.vllm import VllmOutput
from logitstore.text import TrainOn

if TYPE_CHECKING:  # torch and transformers come with it: only its type is named here
    from logitstore.pipelines.teacher_files import TeacherSpec


# the engines' names (the registry, `engines.ENGINES`, holds one of each) and the teacher's weights' dtypes
# (auto: bf16 on GPU, fp32 on CPU)
EngineName = Literal["torch", "vllm", "server"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[Dtype, ...] = get_args(Dtype)


@dataclass(frozen=True)
class WorkerSettings:
    """What an engine is built with (`Engine.__init__`, `Generator.__init__`): the teacher, its device, dtype
    and batch budget, the sparsity, and each engine's own options. Made with the sparsity as asked; the
    engine's `settle` returns them with the `Sparsity` it stores, and only such settings build an engine.
    Frozen and picklable: a worker process or Ray actor gets it whole."""

    teacher_spec: TeacherSpec
    device: str
    dtype: Dtype
    sparsity: Sparsity | SparsityFlags  # `SparsityRequest` until `Engine.settle`; then the `Sparsity` stored
    batch_tokens: int
    seed: int
    engine: EngineName = "torch"
    # chat data: teacher entries for "completion" positions only, or for every one ("prompt+completion")
    entries_for: TrainOn = "prompt+completion"
    tensor_parallel: int = 1  # GPUs per engine (the vLLM engine)
    max_length: int = 1024  # the longest sample, tokens
    vllm_output: VllmOutput = "hidden"  # the vLLM engine's output: final hidden states, or its prompt log-probabilities
    # the server engine: replicas, key (never in a repr), requests in flight per replica, request timeout
    server_urls: tuple[str, ...] = ()
    server_api_key: str | None = field(default=None, repr=False)
    server_concurrency: int = 64
    server_timeout: float = 600.0
    aligns_students: bool = False  # the build aligns student tokenizers: the default keeps the top-64 entries
    # what the engine's `settle` found that every engine built from these settings reuses, so the check runs
    # once per build (the server engine: its `ServedTeacher`); None before `settle`
    checked: object = field(default=None, compare=False)

    @property
    def stored(self) -> Sparsity:
        """The sparsity an engine stores: the settings are settled (`Engine.settle`)."""
        assert isinstance(self.sparsity, Sparsity), "Engine.settle runs before an engine is built"
        return self.sparsity
