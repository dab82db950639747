"""Teacher engines: what runs the teacher's forward passes in a build (and in live mode).

An engine is one module in this folder, `<name>_engine.py`, defining `Engine`, a class with:

    name: str               what `--engine` calls it (the module's name without `_engine`)
    samples(settings) -> bool   classmethod; whether, so configured, it stores sampled entries (`--sample N`)
                            exactly; the default sparsity is top-64 where it cannot
    check(settings, spec)   classmethod; refuses, in one line, what cannot run here (missing package,
                            no GPU, an unsupported sparsity or model format) before anything is written
    resolved_dtype(settings) -> str     classmethod; the dtype `--dtype auto` means for this engine
    version() -> str        classmethod; the engine's package version, recorded in the teacher's metadata
    Engine(settings, lock=) loads the teacher; `lock` is held around forward passes only
    .spec, .vocab_size      the teacher's `TeacherSpec` and output width
    .compute(sample_ids, tokens, *, seed, keep, on_batch) -> SparseSamples
                            sparse distributions of whole samples (`keep`: per sample, the positions
                            whose entries are kept, or None for all; an engine may compute more)
    .close()                gives back what the engine holds (the torch engine its teacher, vLLM its
                            engine-core processes); idempotent. Every executor calls it on success, failure
                            and interruption (`pipelines/workers.py`): a process left behind would keep a
                            GPU's memory, or hang the build's exit waiting for it

An engine that can also write answers (`build --generate`, `pipelines/generate.py`) defines `Generator`
beside it, a class with:

    Generator(settings, spec=, shares_teacher=)  loads the generator `spec` (a `TeacherSpec`) with the
                            build's device, dtype, batch budget; `shares_teacher`: it is the teacher,
                            whose loaded weights it may share with the engine
    .stop_ids: list[int]    the tokens that end an answer (the model's generation config)
    .generate(prompts, seeds, *, max_new_tokens, temperature, top_p) -> list[np.ndarray]
                            each prompt's answer: at most max_new_tokens ids, ending with a stop token
                            unless cut; `seeds`: one 32-bit seed per prompt, which alone decides its draws
    .close()                as the engine's

Optional, where an engine has them (the server engine):

    settled(settings, spec) -> (Sparsity, note | None)  classmethod, after `check`: the sparsity the build
                            stores (the server's K where no sparsity flag was given) and a line said at start
    recorded(settings, spec) -> dict    classmethod: more of `TeacherMeta`'s fields to record (`server`)
    .take_skips(sample_ids) -> Counter  samples it left out of `compute`, by reason (counted in the summary)

Where live mode (`train --live-teacher`, `trainer/live.py`) runs an engine, as a class attribute `live`:
"process" (a teacher process beside each trainer rank, handing over by shared memory or CUDA IPC: the
torch engine) or "rank" (the rank calls it itself: the server engine, which holds no model). An engine
without it is refused in live mode.

So adding an engine is one new file: the registry finds modules by name (`engine_names`) and imports
one only when asked for it (`engine_class`), which keeps `logitstore --help` from importing vLLM.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence

import numpy as np

from logitstore.errors import LogitstoreError
from logitstore.format.samples import SparseSamples, concat

SUFFIX = "_engine"
VLLM_OUTPUTS = (
    "hidden",
    "logprobs",
)  # `--vllm-output`: the vLLM engine's final hidden states, or its prompt log-probabilities


class EngineError(LogitstoreError):
    """An engine that does not exist, or cannot run this build here."""


def engine_names() -> list[str]:
    """The engines `--engine` accepts: one per `<name>_engine.py` module in this folder."""
    return sorted(m.name.removesuffix(SUFFIX) for m in pkgutil.iter_modules(__path__) if m.name.endswith(SUFFIX))


def engine_class(name: str):
    """The `Engine` class of engine `name`."""
    if name not in engine_names():
        raise EngineError(f"--engine must be one of {', '.join(engine_names())}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}{SUFFIX}").Engine


def generator_class(name: str):
    """The `Generator` class of engine `name`: what writes answers for `build --generate`."""
    module = importlib.import_module(f"{__name__}.{engine_class(name).name}{SUFFIX}")
    if not hasattr(module, "Generator"):
        raise EngineError(f"--engine {name} cannot generate answers (--generate); use --engine torch or vllm")
    return module.Generator


def is_out_of_memory(error: BaseException) -> bool:
    """A device allocation failure (torch's own type, or a RuntimeError saying so, as CUDA kernels and
    vLLM raise it)."""
    # torch is loaded by the engine long before this runs; at the top it would cost `build` 1.5 s before
    # its input checks
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
    )


def halving_on_oom(
    run: Callable[..., SparseSamples],
    sample_ids: list[str],
    tokens: Sequence[np.ndarray],
    keep: list | None,
    *,
    on_oom: Callable[[], None] = lambda: None,
) -> SparseSamples:
    """`run(sample_ids, tokens, keep)`; when it runs out of memory, `on_oom()` (free the cache) and the
    two halves of the batch are run apart, recursively. One sample that does not fit is an error."""
    try:
        return run(sample_ids, tokens, keep)
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
    on_oom()
    if len(sample_ids) == 1:
        raise EngineError(
            f"sample {sample_ids[0]!r} ({len(tokens[0])} tokens) does not fit in memory even alone; "
            "lower --max-length or --batch-tokens"
        )
    half = len(sample_ids) // 2
    halves = (None, None) if keep is None else (keep[:half], keep[half:])
    return concat(
        [
            halving_on_oom(run, sample_ids[:half], tokens[:half], halves[0], on_oom=on_oom),
            halving_on_oom(run, sample_ids[half:], tokens[half:], halves[1], on_oom=on_oom),
        ]
    )


def stop_token_ids(generation_config, config) -> list[int]:
    """The ids that end an answer: the generation config's `eos_token_id` (one id or a list), else the
    model config's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or ())
    return sorted({int(i) for i in ids})


def cut_at_stop(row: np.ndarray, stop_ids: Sequence[int]) -> np.ndarray:
    """An answer up to and with its first stop token (what follows is padding); whole if none."""
    row = np.asarray(row, dtype=np.int64)
    hits = np.flatnonzero(np.isin(row, np.asarray(stop_ids, dtype=np.int64)))
    return row[: hits[0] + 1] if len(hits) else row


def token_budget_batches(sorted_lengths: np.ndarray, order: np.ndarray, *, budget: int):
    """Consecutive rows of `order` (sorted longest first) whose padded size rows x longest <= budget."""
    start = 0
    while start < len(order):
        longest = sorted_lengths[start]
        rows = max(1, budget // max(int(longest), 1))
        yield order[start : start + rows]
        start += rows
