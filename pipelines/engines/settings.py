"""`WorkerSettings`: the one type every engine and generator is built from (`engines/base.py`), made by
the build (`workers.worker_settings`) and by live mode (`live/teacher.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from logitstore.format.sparsity import Sparsity

if TYPE_CHECKING:  # torch and transformers come with it: only its type is named here
    from logitstore.pipelines.teacher_files import TeacherSpec


@dataclass(frozen=True)
class WorkerSettings:
    """What an engine is built with (`Engine.__init__`, `Generator.__init__`): the teacher, its device, dtype
    and batch budget, the sparsity the build settled on, and each engine's own options. Frozen and picklable:
    a worker process or Ray actor gets it whole."""

    teacher_spec: TeacherSpec
    device: str
    dtype: str
    sparsity: Sparsity
    batch_tokens: int
    seed: int
    engine: str = "torch"  # a name of `engines.engine_names()`
    # chat data: teacher entries for "completion" positions only, or for every one ("prompt+completion")
    entries_for: str = "prompt+completion"
    tensor_parallel: int = 1  # GPUs per engine (the vLLM engine)
    max_length: int = 1024  # the longest sample, tokens
    vllm_output: str = "hidden"  # the vLLM engine's output: final hidden states, or its prompt log-probabilities
    # the server engine: replicas, key (never in a repr), requests in flight per replica, request timeout
    server_urls: tuple[str, ...] = ()
    server_api_key: str | None = field(default=None, repr=False)
    server_concurrency: int = 64
    server_timeout: float = 600.0
    default_sparsity: bool = False  # no sparsity flag given: the engine may settle the default (the server's K)
