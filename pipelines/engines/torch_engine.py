"""The torch engine: the teacher as a Hugging Face model in this process (CPU or one GPU), the default.

Samples are batched by token budget, longest first (padding stays small); the model body runs once
per batch and the output head in chunks of positions (`teacher.sparse_topk_forward`/`sampled_forward`),
so no [tokens x vocab] matrix of the whole batch is ever held. A batch that runs out of memory is
halved and run again (`halving_on_oom`). Every sparsity is exact here, sampled draws included.

`Selection` is that batching and selection over any `TeacherForward` (a body and an output head): vLLM's
hidden-state mode runs its body through the same object, so both engines batch, draw and select alike.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import numpy as np
import torch
import transformers

from logitstore.pipelines.engines import EngineError, halving_on_oom, token_budget_batches
from logitstore.pipelines.sparsify import to_samples
from logitstore.pipelines.teacher import Teacher, TeacherForward, load_teacher, sampled_forward, sparse_topk_forward
from logitstore.samples import SparseSamples, concat


def resolved_device(device: str) -> str:
    return device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def dtype_for(dtype: str, device: str) -> str:
    """`auto`: bfloat16 on a GPU, float32 on CPU (`teacher.load_teacher`'s rule)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if resolved_device(device).startswith("cuda") else "float32"


class Engine:
    name = "torch"

    @classmethod
    def samples(cls, settings) -> bool:
        return True

    @classmethod
    def check(cls, settings, spec) -> None:
        if resolved_device(settings.device).startswith("cuda") and not torch.cuda.is_available():
            raise EngineError(f"--device {settings.device}: this torch build sees no CUDA device")

    @classmethod
    def resolved_dtype(cls, settings) -> str:
        return dtype_for(settings.dtype, settings.device)

    @classmethod
    def gpus_per_worker(cls, settings) -> int:
        return 1 if resolved_device(settings.device).startswith("cuda") else 0

    @classmethod
    def version(cls) -> str:
        return f"torch {torch.__version__}, transformers {transformers.__version__}"

    def __init__(self, settings, *, lock: threading.Lock):
        self.settings = settings
        self.teacher: Teacher | None = load_teacher_once(
            settings.teacher_spec, resolved_device(settings.device), self.resolved_dtype(settings)
        )
        self.spec, self.vocab_size, self.device = self.teacher.spec, self.teacher.vocab_size, self.teacher.model.device
        self.selection: Selection | None = Selection(
            TeacherForward.of_model(self.teacher.model), settings=settings, lock=lock, device=self.device
        )

    def compute(
        self, sample_ids: list[str], tokens: list[np.ndarray], *, seed: int, keep: list | None = None, on_batch=None
    ) -> SparseSamples:
        """Longest samples first (the part's row order); `on_batch(tokens)` after every batch."""
        assert self.selection is not None, "the engine is closed"
        return self.selection.compute(sample_ids, tokens, seed=seed, keep=keep, on_batch=on_batch)

    def close(self) -> None:
        """Drops this engine's references to the teacher: its memory goes back unless `shared_teachers()`
        keeps it for the next build. Idempotent."""
        self.selection = None
        self.teacher = None
        _free_cache()


class Selection:
    """The torch engine's batches and selection over a `TeacherForward`: samples batched by token budget,
    longest first; one generator per call, seeded, so draws depend on the seed and the batches only; the
    body run under `lock` (the teacher's share), selection beside the next forward pass."""

    def __init__(self, forward: TeacherForward, *, settings, lock: threading.Lock, device: torch.device):
        self.forward, self.settings, self.lock, self.device = forward, settings, lock, device

    def compute(
        self, sample_ids: list[str], tokens: list[np.ndarray], *, seed: int, keep: list | None = None, on_batch=None
    ) -> SparseSamples:
        lengths = np.array([len(t) for t in tokens])
        order = np.argsort(-lengths, kind="stable")
        generator = None
        if self.settings.sparsity.sampled:  # one generator per call: draws depend on the seed and the batches only
            generator = torch.Generator(device=self.device).manual_seed(seed)
        run = functools.partial(self._forward, generator=generator)
        parts = []
        for rows in token_budget_batches(lengths[order], order, budget=self.settings.batch_tokens):
            parts.append(
                halving_on_oom(
                    run,
                    [sample_ids[i] for i in rows],
                    [tokens[i] for i in rows],
                    None if keep is None else [keep[i] for i in rows],
                    on_oom=_free_cache,
                )
            )
            if on_batch is not None:
                on_batch(int(lengths[rows].sum()))
        return concat(parts)

    def _forward(
        self, sample_ids: list[str], tokens: list[np.ndarray], keep: list | None, *, generator
    ) -> SparseSamples:
        sparsity = self.settings.sparsity
        lengths = np.array([len(t) for t in tokens])
        ids = torch.zeros((len(tokens), lengths.max()), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, t in enumerate(tokens):  # one copy per sample, right-padded
            ids[row, : len(t)] = torch.as_tensor(t)
            mask[row, : len(t)] = 1
        head_on = None
        if keep is not None:  # chat data: the head runs on the kept positions only
            head_on = torch.zeros((len(tokens), lengths.max() - 1), dtype=torch.bool)
            for row, k in enumerate(keep):
                head_on[row, : len(k)] = torch.from_numpy(k.astype(bool))
        with self.lock:  # the teacher's share; selection below runs beside the next forward pass
            if sparsity.sampled:
                batch = sampled_forward(
                    self.forward,
                    ids,
                    mask,
                    n=sparsity.n,
                    generator=generator,
                    temperature=sparsity.temperature,
                    keep=head_on,
                )
            else:
                batch = sparse_topk_forward(
                    self.forward, ids, mask, k=sparsity.k, temperature=sparsity.temperature, keep=head_on
                )
        return to_samples(batch, sample_ids=sample_ids, lengths=lengths, input_ids=tokens, sparsity=sparsity)


def _free_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# Inside `shared_teachers()`: the last teacher loaded, by (spec, device, dtype); None outside.
_shared: dict | None = None


@contextlib.contextmanager
def shared_teachers():
    """Builds and benchmarks inside this block share the teacher they load (teachers are read-only), so
    repeated builds in one process (the tests, a notebook, a benchmark's variants) load it once. One
    teacher at a time: it holds hundreds of MB to GBs. Outside the block every engine loads its own and
    drops it with the engine; the tests run inside one (`tests/conftest.py`)."""
    global _shared
    outer = _shared
    _shared = {} if outer is None else outer
    try:
        yield
    finally:
        _shared = outer


def load_teacher_once(spec, device: str, dtype: str):
    """The teacher, from `shared_teachers()`'s when it holds this one. `dtype` "auto": `load_teacher`'s
    rule (bfloat16 on GPU, float32 on CPU)."""
    dtype = dtype_for(dtype, device)
    key = (spec, device, dtype)
    if _shared is not None and key in _shared:
        return _shared[key]
    teacher = load_teacher(spec, device=device, dtype=getattr(torch, dtype))
    if _shared is not None:
        _shared.clear()
        _shared[key] = teacher
    return teacher
