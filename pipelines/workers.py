"""Where the teacher runs during a build: in this process, in local worker processes, or on Ray.

All three run the same `TeacherWorker.process(unit, part_writer)`: batch the unit's samples by token
budget (longest first, so padding stays small), run the teacher, select entries, write one part.
Executors only differ in where `TeacherWorker` lives and how its `WrittenPart` comes back.

The write (encode, compress, store) is off the teacher's critical path where a worker runs units in
`OVERLAP` threads (in-process, and Ray actors): the worker's compute lock is held for forward passes
only, so units' selection and writes overlap the next unit's forward passes. At most `OVERLAP` units
are in a worker at once, each written into its own Icechunk fork that the driver merges in input order.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import multiprocessing.util
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from logitstore.errors import LogitstoreError
from logitstore.format.samples import SparseSamples, StudentTokens
from logitstore.pipelines.engines import engine_class
from logitstore.pipelines.engines.base import HandOver, Settled
from logitstore.pipelines.engines.settings import WorkerSettings
from logitstore.store.writer import PartWriter, WrittenPart
from logitstore.text.chat import supervised_positions

# Units a worker holds at once, each in its own thread: one in the teacher's forward passes while up to
# two others are selected and written (a write queue of depth 2). With two, the teacher idles whenever
# a write (slowed by the planner and the other write sharing the CPU) outlasts a unit's forward pass:
# a 250k tokens/s stand-in teacher loses ~10% more of its time (benchmarks/build.py). Memory: one unit's
# entries per thread (~3 MB at sampled-16, ~12 MB at top-64).
OVERLAP = 3


@dataclass
class Unit:
    """A group of samples that is computed, written and committed together."""

    index: int
    sample_ids: list[str] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    source_hashes: list[str] = field(default_factory=list)
    n_tokens: int = 0
    documents_read: int = 0  # input documents consumed while this unit was filled (for progress)
    # per sample id: {student tokenizer name: (student ids, alignment groups [g, 4])}
    students: dict[str, dict] = field(default_factory=dict)
    # stored sample ids of documents whose text changed (`--on-duplicate replace`): removed from the
    # branch in the transaction that merges this unit, so no old window survives beside new ones
    replaces: list[str] = field(default_factory=list)
    # per sample id: uint8 [tokens], 1 for completion tokens (chat data only; `logitstore.text.chat`)
    loss_masks: dict[str, np.ndarray] = field(default_factory=dict)
    # per sample id: a generated answer's prompt as given (`generation.prompt_record`), kept with the part
    prompts: dict[str, dict] = field(default_factory=dict)
    # samples the engine could not compute, by reason (the server engine: "refused", "too_long"); counted
    skips: dict[str, int] = field(default_factory=dict)

    def add(
        self,
        sample_id: str,
        tokens: np.ndarray,
        source_hash: str,
        *,
        students: dict | None = None,
        loss_mask: np.ndarray | None = None,
        prompt: dict | None = None,
    ) -> None:
        self.sample_ids.append(sample_id)
        if loss_mask is not None:
            self.loss_masks[sample_id] = np.asarray(loss_mask, dtype=np.uint8)
        if prompt is not None:
            self.prompts[sample_id] = prompt
        self.tokens.append(np.asarray(tokens, dtype=np.int64))
        self.source_hashes.append(source_hash)
        self.n_tokens += len(tokens)
        if students:
            self.students[sample_id] = students


class TeacherWorker:
    """Holds one teacher engine (`pipelines/engines/`); turns units into written parts."""

    def __init__(self, settings: WorkerSettings, *, hand_over: HandOver | None = None):
        self.settings = settings
        self.on_batch: Callable[[int], None] | None = None  # told the tokens of each batch computed
        # One forward pass at a time (one teacher, one device): held for the forward pass alone, so
        # selection and writes (CPU) run while another thread's forward pass keeps the teacher busy.
        self._compute_lock = threading.Lock()
        self.engine = engine_class(settings.engine)(settings, lock=self._compute_lock, hand_over=hand_over)

    def process(
        self, unit: Unit, writer: PartWriter, *, computed: SparseSamples | None = None
    ) -> tuple[WrittenPart, Unit]:
        """Compute (unless `computed` already) and write one unit. Safe to call from several threads: the
        forward passes take turns on the teacher, and selection and the write run beside the other
        thread's forward passes. A unit's result does not depend on how the threads interleave (sampling
        is seeded per unit and each unit's batches run in order in its own thread)."""
        samples = computed if computed is not None else self.compute(unit)
        written = write_unit(writer, unit, samples, teacher=self.engine.spec.name)
        unit.tokens = []  # the driver needs the counts back, not the tokens
        return written, unit

    def close(self) -> None:
        """The engine's `close()`: its teacher, its processes (vLLM's engine core) go."""
        self.engine.close()

    def compute(self, unit: Unit) -> SparseSamples:
        """The unit's sparse distributions, in the engine's row order. Chat samples carry their loss
        mask; with entries for the completion only, prompt positions hold none (and the engine is told
        which positions it may skip)."""
        completion_only = bool(unit.loss_masks) and self.settings.entries_for == "completion"
        keep = [unit.loss_masks[sid][1:] for sid in unit.sample_ids] if completion_only else None
        samples = self.engine.compute(
            unit.sample_ids, unit.tokens, seed=unit_seed(self.settings.seed, unit), keep=keep, on_batch=self.on_batch
        )
        unit.skips = dict(self.engine.take_skips(unit.sample_ids))  # what the engine left out, and why
        if not unit.loss_masks:
            return samples
        samples.loss_mask = np.concatenate([unit.loss_masks[sid] for sid in samples.sample_ids])
        if completion_only:
            samples = samples.keep_positions(supervised_positions(samples.loss_mask, samples.n_tokens))
        return samples


def write_unit(writer: PartWriter, unit: Unit, samples: SparseSamples, *, teacher: str) -> WrittenPart:
    """Write a computed unit as one part, with each sample's source hash in the index (and each answer's prompt)."""
    by_id = dict(zip(unit.sample_ids, unit.source_hashes))
    students = None
    if unit.students:
        names = next(iter(unit.students.values())).keys()
        students = {
            name: StudentTokens.from_samples([unit.students[s][name] for s in samples.sample_ids]) for name in names
        }
    return writer.write(
        samples,
        teacher=teacher,
        source_hashes=[by_id[s] for s in samples.sample_ids],
        students=students,
        prompts=[unit.prompts.get(s) for s in samples.sample_ids] if unit.prompts else None,
    )


def unit_seed(seed: int, unit: Unit) -> int:
    """Sampling seed of a unit: a function of the build seed and the unit's first sample only."""
    digest = hashlib.sha256(f"{seed}:{unit.sample_ids[0]}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# -- executors -----------------------------------------------------------------------------------


class InProcessExecutor:
    """workers=1: the teacher runs in this process, in `OVERLAP` threads that take turns on it, so units'
    writes (encode, compress, store: CPU and I/O) run beside the next unit's forward passes. Each unit
    goes into its own fork of the driver's transaction: a commit between two merges never catches a
    half-written part."""

    def __init__(self, settings: WorkerSettings, *, hand_over: HandOver | None = None):
        self.worker = TeacherWorker(settings, hand_over=hand_over)
        self.pool = ThreadPoolExecutor(max_workers=OVERLAP, thread_name_prefix="logitstore-unit")
        self._ahead: dict[int, Future] = {}  # unit index -> its compute, started before `map` meets it
        # the started units' writes: beside the pool, so the units after them reach the teacher at once
        self._writes = ThreadPoolExecutor(max_workers=OVERLAP, thread_name_prefix="logitstore-write")

    def compute(self, unit: Unit) -> SparseSamples:
        return self.worker.compute(unit)

    def start(self, unit: Unit) -> None:
        """Start computing `unit` now, in a unit thread; `map` writes it when it meets it. The teacher
        works while the build registers a new teacher (store, metadata, first commit: ~0.1 s), which at
        a GPU's pace is several units."""
        self._ahead[unit.index] = self.pool.submit(self.worker.compute, unit)

    def _process(self, unit: Unit, writer: PartWriter) -> tuple[WrittenPart, Unit]:
        ahead = self._ahead.pop(unit.index, None)
        if ahead is None:
            return self.worker.process(unit, writer)
        return self.worker.process(unit, writer, computed=ahead.result())

    def map(
        self, units: Iterator[Unit], *, writer_for: Callable, max_in_flight: int, warm: bool = False
    ) -> Iterator[tuple[WrittenPart, Unit]]:
        """Each unit computed and written, in input order. `warm`: a unit was computed and written in this
        thread already (a new teacher's first unit), so the kernels are compiled."""
        units = iter(units)
        first = None if warm else next(units, None)
        if first is not None:
            # The first unit runs in this thread, so numba compiles (or loads from its cache) the selection
            # and encoding kernels here. Compiled first in a unit thread, they can make the process abort at
            # exit ("terminate called without an active exception": about 1 build in 16 with an empty numba
            # cache). It costs one unit's overlap.
            yield self._process(first, writer_for().fork())
        # One unit more than threads: a thread that finishes finds the next unit waiting. Units started ahead
        # are written in threads of their own and do not count: the teacher goes on meanwhile.
        yield from _in_order(
            units,
            lambda unit: (self._writes if unit.index in self._ahead else self.pool).submit(
                self._process, unit, writer_for().fork()
            ),
            max_in_flight=OVERLAP + 1 + len(self._ahead),
        )

    def close(self) -> None:
        # Units not started are dropped; a running one finishes (a forward pass cannot be interrupted)
        # and its fork, never merged, is discarded with the transaction. Then the engine goes.
        try:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self._writes.shutdown(wait=True, cancel_futures=True)
        finally:
            self.worker.close()


_WORKER: TeacherWorker | None = None  # one per worker process


def _init_worker(settings: WorkerSettings, devices) -> None:
    global _WORKER
    if devices is not None:  # this process's GPUs, before anything initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = devices.get()
    import torch  # 1.5 s: `build` imports this module before its input checks (the engine loads torch anyway)

    torch.set_num_threads(1)  # N processes on N cores; more threads each would oversubscribe
    _WORKER = TeacherWorker(settings)
    # The pool ends its processes by a sentinel, after which multiprocessing's exit hook first runs the
    # finalizers with an exit priority, then joins the process's children: the engine closes here, before
    # that join would wait forever on vLLM's engine core. atexit hooks never run in these processes.
    multiprocessing.util.Finalize(_WORKER, _WORKER.close, exitpriority=10)


def _worker() -> TeacherWorker:
    """This worker process's teacher, which the pool's initializer (`_init_worker`) made."""
    assert _WORKER is not None, "_init_worker runs in every worker process before its tasks"
    return _WORKER


def _process_in_worker(unit: Unit, writer: PartWriter):
    return _worker().process(unit, writer)


def _compute_in_worker(unit: Unit):
    return _worker().compute(unit)


class ProcessExecutor:
    """workers=N: N spawned processes, each with its own teacher, writing into Icechunk forks. A process
    runs its units one after another (compute, then write): with N CPU workers on N cores the writes
    overlap the other processes' forward passes, and threads in each would only compete for the cores."""

    def __init__(self, settings: WorkerSettings, *, workers: int):
        context = multiprocessing.get_context("spawn")
        devices = None
        gpus = engine_class(settings.engine).gpus_per_worker(settings)
        if gpus:  # each process its own GPUs: N engines on one GPU would each claim its memory
            devices = context.Queue()
            for group in worker_devices(workers=workers, gpus_per_worker=gpus, visible=visible_gpus()):
                devices.put(group)
        self.pool = ProcessPoolExecutor(
            max_workers=workers, mp_context=context, initializer=_init_worker, initargs=(settings, devices)
        )

    def compute(self, unit: Unit) -> SparseSamples:
        return self.pool.submit(_compute_in_worker, unit).result()

    def start(self, unit: Unit) -> None:
        """Nothing: its units are computed where they are written, in the worker processes."""

    def map(self, units, *, writer_for, max_in_flight, warm: bool = False):  # warm: in-process only
        yield from _in_order(
            units,
            lambda unit: self.pool.submit(_process_in_worker, unit, writer_for().fork()),
            max_in_flight=max_in_flight,
        )

    def close(self) -> None:
        # Each process closes its engine on its way out (`_init_worker`'s finalizer).
        self.pool.shutdown(cancel_futures=True)


def _in_order(units: Iterator[Unit], submit: Callable[[Unit], Future], *, max_in_flight: int):
    """Submit units, at most `max_in_flight` unfinished at once, and yield their results in submission
    order as they complete."""
    in_flight: deque[Future] = deque()
    for unit in units:
        in_flight.append(submit(unit))
        if len(in_flight) >= max_in_flight:
            yield from _completed(in_flight, block=True)
        yield from _completed(in_flight, block=False)
    while in_flight:
        yield from _completed(in_flight, block=True)


def _completed(in_flight: deque, *, block: bool):
    """Results in submission order: merges and progress then follow input order."""
    if block:
        wait([in_flight[0]], return_when=FIRST_COMPLETED)
    while in_flight and in_flight[0].done():
        yield in_flight.popleft().result()


class RayExecutor:
    """ray_address: one `TeacherWorker` actor per worker on an existing (or local) Ray cluster."""

    def __init__(self, settings: WorkerSettings, *, workers: int, address: str):
        try:
            import ray
        except ImportError:
            raise LogitstoreError("--ray-address needs Ray: pip install 'logitstore[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            ray.init(
                address=None if address == "local" else address,
                ignore_reinit_error=True,
                log_to_driver=False,
                include_dashboard=False,
            )
        gpus = engine_class(settings.engine).gpus_per_worker(settings)  # Ray sets each actor's visible GPUs
        # Threaded actors: `OVERLAP` calls of `process` at once per actor, so an actor's write overlaps
        # its next forward pass (the worker's compute lock keeps the forward passes one at a time).
        # ray.remote's overloads list task options only; it takes actor options (max_concurrency) as well
        remote = cast("Callable[..., Any]", ray.remote)
        actor = remote(num_gpus=gpus, num_cpus=1, max_concurrency=OVERLAP)(TeacherWorker)
        self.actors = [actor.remote(settings) for _ in range(workers)]

    def compute(self, unit: Unit) -> SparseSamples:
        return self.ray.get(self.actors[0].compute.remote(unit))

    def start(self, unit: Unit) -> None:
        """Nothing: its units are computed where they are written, in the actors."""

    def map(self, units, *, writer_for, max_in_flight, warm: bool = False):  # warm: in-process only
        from ray.util import ActorPool  # the optional [ray] extra, as in __init__

        pool = ActorPool([a for _ in range(OVERLAP) for a in self.actors])  # OVERLAP slots per actor
        for unit in units:
            pool.submit(lambda actor, args: actor.process.remote(*args), (unit, writer_for().fork()))
            while pool.has_next() and not pool.has_free():
                yield pool.get_next()
        while pool.has_next():
            yield pool.get_next()

    def close(self) -> None:
        # An actor's engine first (ray.kill ends the actor's process at once, without its finalizers).
        try:
            self.ray.get([actor.close.remote() for actor in self.actors], timeout=CLOSE_SECONDS)
        except Exception:  # an actor that died or hangs is killed below all the same
            pass
        for actor in self.actors:
            self.ray.kill(actor)


CLOSE_SECONDS = 60  # for a Ray actor to close its engine (vLLM's shutdown waits up to 15 s for its processes)


@contextlib.contextmanager
def interrupted_on_sigterm():
    """SIGTERM raises KeyboardInterrupt in the main thread while the block runs, as Ctrl-C does, so the
    executors' `close()` runs (by default SIGTERM ends Python at once, leaving vLLM's engine-core
    processes orphaned). Outside the main thread signals cannot be caught: nothing changes there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def worker_settings(cfg, *, teacher_spec) -> WorkerSettings:
    """A build's worker settings (`cfg` is a `BuildConfig`), with its sparsity as asked: its engine's
    `settle` makes the settings engines are built from (`settled_settings`)."""
    return WorkerSettings(
        teacher_spec=teacher_spec,
        device=cfg.device,
        dtype=cfg.dtype,
        sparsity=cfg.sparsity,
        batch_tokens=cfg.batch_tokens,
        seed=cfg.seed,
        entries_for=cfg.train_on,
        tensor_parallel=cfg.tensor_parallel,
        max_length=cfg.max_length,
        vllm_output=cfg.vllm_output,
        aligns_students=bool(cfg.student_tokenizers),
        **cfg.engine_settings(),
    )


def settled_settings(cfg, *, teacher_spec) -> Settled:
    """`worker_settings` checked and settled by the build's engine (`Engine.check`, `Engine.settle`)."""
    engine = engine_class(cfg.engine)
    settings = worker_settings(cfg, teacher_spec=teacher_spec)
    engine.check(settings, teacher_spec)  # e.g. vLLM missing, or no GPU: one line, before anything is written
    return engine.settle(settings)


def visible_gpus() -> list[str]:
    """The GPUs this process may use: `CUDA_VISIBLE_DEVICES`, else every device torch counts."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch  # 1.5 s: `build` imports this module before its input checks (the engine loads torch anyway)

    return [str(i) for i in range(torch.cuda.device_count())]


def worker_devices(*, workers: int, gpus_per_worker: int, visible: list[str]) -> list[str]:
    """`CUDA_VISIBLE_DEVICES` of each local worker: disjoint groups of `gpus_per_worker` GPUs."""
    if workers * gpus_per_worker > len(visible):
        raise LogitstoreError(
            f"--workers {workers} x {gpus_per_worker} GPU(s) each (--tensor-parallel) needs "
            f"{workers * gpus_per_worker} GPUs, {len(visible)} are visible"
        )
    return [",".join(visible[w * gpus_per_worker : (w + 1) * gpus_per_worker]) for w in range(workers)]


class LoadingExecutor:
    """`make_executor` in a thread of its own, started before the build plans its input, so the teacher's
    weights load while the teacher is described, the store opened and the first unit read (seconds each).
    The build takes the executor (`take`) or leaves it (`leave`: on an error before, or nothing to compute):
    one left, or loaded after being left, is closed; a build does not wait for a load it leaves."""

    def __init__(self, cfg, *, settings: WorkerSettings, on_batch: Callable[[int], None]):
        self._lock = threading.Lock()
        self._executor: Any = None
        self._error: BaseException | None = None
        self._left = False
        self._thread = threading.Thread(
            target=self._load, args=(cfg, settings, on_batch), name="logitstore-teacher-load", daemon=True
        )
        self._thread.start()

    def _load(self, cfg, settings, on_batch) -> None:
        try:
            executor = make_executor(cfg, settings=settings, on_batch=on_batch)
        except BaseException as error:  # noqa: BLE001 - raised in the build's thread by `take`
            self._error = error
            return
        with self._lock:
            left, self._executor = self._left, executor
        if left:
            self.leave()

    def take(self):
        """The executor, once loaded (the load's error, if it failed)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        with self._lock:
            executor, self._executor = self._executor, None
        return executor

    def leave(self) -> None:
        with self._lock:
            self._left = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.close()


def loads_early(cfg) -> bool:
    """Whether a build loads its teacher while it plans: the torch engine in this process (spawned workers
    start on their first unit; vLLM's and Ray's start-up wants the main thread; a server has nothing to
    load; `--generate` loads it to generate while it plans)."""
    return cfg.engine == "torch" and cfg.workers == 1 and not cfg.ray_address and not cfg.generate


def make_executor(
    cfg,
    *,
    settings: WorkerSettings,
    on_batch: Callable[[int], None] | None = None,
    hand_over: HandOver | None = None,
):
    """The executor `cfg` asks for, its engines built from `settings` (settled: `settled_settings`).
    `on_batch(tokens)` hears of every teacher batch computed in this process (the in-process executor); the
    others report units as they come back. `hand_over`: what the build's generator scored, for an engine
    in this process."""
    if cfg.ray_address:
        return RayExecutor(settings, workers=cfg.workers, address=cfg.ray_address)
    if cfg.workers == 1:
        executor = InProcessExecutor(settings, hand_over=hand_over)
        executor.worker.on_batch = on_batch
        return executor
    if cfg.store.startswith("memory://"):
        raise LogitstoreError("--workers > 1 needs a store other processes can reach; memory:// lives in one process")
    return ProcessExecutor(settings, workers=cfg.workers)
