"""Live mode: the teacher runs beside the trainer and hands its sparse distributions over through
shared memory instead of the store. Everything after the hand-over is the store path's: the same
`PackedBatch`, loss, checkpoints and metrics.

Processes. The engine (`--engine`, the build's registry) says where it runs (its `live` attribute). The
torch engine: each trainer rank starts one teacher process (spawn start method), so on a GPU node each
GPU holds its rank's student and a teacher (documented: "one teacher per rank"). The teacher loads the
model once, then answers requests: "the whole samples with these token ids" -> sparse entries, tail
and target log-probabilities (`answer`: `pipelines.workers.TeacherWorker.compute`, the build's own code).
A teacher behind a server (`--engine server`) holds no model: the rank calls the same `answer` itself
(`InRankTeacher`), and the server engine sends the requests to the replicas. `settle_engine` makes the engine's
refusals (the server's preflight) and fixes the sparsity before the run takes --out.

Data. The trainer plans the samples itself, exactly as `logitstore build` would (same reader, same
tokenizer, same windows and ids), and orders, splits, packs and shards them with the stream engine's
rules (`live/stream.py`'s `LiveSource`: sorted by id, permuted by seed, split by id hash). The batch
order is therefore a function of the sample ids and the seed only: a live run and a run on a store built from the same data and options
see the same batches. The teacher never reorders: it computes what it is asked, in request order.

Values: by default the teacher's output goes through the store's codec (`quantize=False`: raw float32),
so live and store runs see values on the same grid. The hand-over (a ring of shared-memory or CUDA IPC
buffers per teacher, acked slot by slot) and how a dead teacher or trainer is noticed: docs/architecture.md,
"Live mode's hand-over".
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import os
import queue
import threading
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from logitstore.format import codec
from logitstore.format.samples import SparseSamples, concat
from logitstore.format.sparsity import Sparsity
from logitstore.live.config import LiveConfig, LiveTeacherError
from logitstore.pipelines.config import PlanConfig
from logitstore.pipelines.engines import engine_class, engine_names
from logitstore.pipelines.engines.settings import WorkerSettings
from logitstore.pipelines.plan import check_teacher_fits, plan_units
from logitstore.pipelines.teacher import describe_teacher, resolve_teacher
from logitstore.pipelines.workers import TeacherWorker, Unit

RING_SLOTS = 2
POLL_SECONDS = 0.2


# -- the engine: settled before the run takes --out --------------------------------------------------


def teacher_settings(cfg: LiveConfig) -> WorkerSettings:
    """The build's worker settings for live mode's teacher (seed 0: sampled draws are seeded per request),
    settled where `cfg` is (`settle_engine`)."""
    return WorkerSettings(
        teacher_spec=resolve_teacher(cfg.teacher),
        device=cfg.device,
        dtype=cfg.dtype,
        sparsity=cfg.sparsity,
        batch_tokens=cfg.batch_tokens,
        seed=0,
        max_length=cfg.max_length,
        checked=cfg.checked,
        **cfg.engine_options.engine_settings(),
    )


def settle_engine(cfg: LiveConfig, *, log=None) -> LiveConfig:
    """`cfg` with its engine's refusals made (one line: for a served teacher the preflight, i.e. reachable,
    the teacher's model and tokenizer, K within the server's maximum) and its sparsity settled by the engine
    (`Engine.settle`: sampled 16 for the torch engine, top-K at the server's K, as build). Run before the
    run takes --out, so a refusal leaves nothing behind; `log` is told the engine's line (the server's K)."""
    engine = engine_class(cfg.engine_options.engine)
    if engine.live not in LIVE_TEACHERS:
        runs = [name for name in engine_names() if engine_class(name).live in LIVE_TEACHERS]
        raise LiveTeacherError(f"--engine {engine.name} does not run in live mode; live mode runs {', '.join(runs)}")
    settings = teacher_settings(cfg)
    engine.check(settings, settings.teacher_spec)
    settled, note = engine.settle(settings)
    if note and log is not None:
        log(note)
    # the run folder keeps this sparsity; this process's engines reuse what the check found
    return dataclasses.replace(cfg, sparsity=settled.stored, checked=settled.checked)


# -- planning: the samples a build would write -------------------------------------------------------


@dataclass
class LiveSamples:
    """Every sample of the data, as the build would store them, sorted by id (the store index's order)."""

    sample_ids: list[str]
    tokens: list[np.ndarray]
    n_tokens: np.ndarray
    teacher_name: str
    vocab_size: int
    tokenizer: object = field(repr=False, default=None)
    tokenizer_hash: str | None = None  # the teacher tokenizer's, which a student must share in live mode

    @property
    def fingerprint(self) -> str:
        """Stands in for the store version in checkpoints: the same data and teacher give the same value."""
        h = hashlib.blake2b(digest_size=10)
        h.update(self.teacher_name.encode())
        for sid, t in zip(self.sample_ids, self.tokens):
            h.update(sid.encode() + b"\0")
            h.update(np.ascontiguousarray(t, dtype=np.int64).tobytes())
        return f"live-{h.hexdigest()}"


def plan_live_samples(cfg: LiveConfig) -> LiveSamples:
    """The build's planning (`plan.plan_units`) with nothing stored yet, flattened and sorted by id."""
    info = describe_teacher(cfg.teacher)
    check_teacher_fits(info, sparsity=cfg.sparsity, max_length=cfg.max_length)
    plan = PlanConfig(data=cfg.data, text_column=cfg.text_column, id_column=cfg.id_column, max_length=cfg.max_length)
    ids, tokens = [], []
    for unit in plan_units(plan, info.tokenizer, vocab_size=info.vocab_size):
        ids.extend(unit.sample_ids)
        tokens.extend(unit.tokens)
    order = sorted(range(len(ids)), key=lambda i: ids[i].encode("utf-8"))  # Arrow's byte order
    return LiveSamples(
        sample_ids=[ids[i] for i in order],
        tokens=[tokens[i] for i in order],
        n_tokens=np.array([len(tokens[i]) for i in order], dtype=np.int64),
        teacher_name=info.spec.name,
        vocab_size=info.vocab_size,
        tokenizer=info.tokenizer,
        tokenizer_hash=info.tokenizer_hash,
    )


# -- the teacher process -----------------------------------------------------------------------------


def _slot_capacity(*, micro_batch: int, seq_len: int, max_length: int, width: int) -> tuple[int, int]:
    """(positions, entries) one request can need: the whole samples touching a micro-batch's rows, at
    most every row's tokens plus one sample sticking out at each end of each row."""
    positions = micro_batch * (seq_len + 2 * max_length)
    return positions, positions * width


def _allocate_ring(positions: int, entries: int, *, device: torch.device, sampled: bool) -> list[dict]:
    ring = []
    for _ in range(RING_SLOTS):
        slot = {
            "n_entries": torch.zeros(positions, dtype=torch.int32, device=device),
            "tail": torch.zeros(positions, dtype=torch.float32, device=device),
            "target_logprobs": torch.zeros(positions, dtype=torch.float32, device=device),
            "entry_ids": torch.zeros(entries, dtype=torch.int64, device=device),
            "entry_logprobs": torch.zeros(entries, dtype=torch.float32, device=device),
        }
        if sampled:
            slot["entry_counts"] = torch.zeros(entries, dtype=torch.int32, device=device)
        if device.type == "cpu":
            for t in slot.values():
                t.share_memory_()
        ring.append(slot)
    return ring


def teacher_main(cfg: LiveConfig, capacity: tuple[int, int], requests, ready, acks, parent_pid: int) -> None:
    """The teacher process: load once, export the ring once, then answer requests until told to stop
    or until the trainer's process is gone."""
    try:
        _serve(cfg, capacity, requests, ready, acks, parent_pid)
    finally:  # also when the trainer is gone and nobody else will clean up after us
        remove_process_shm(os.getpid())


def _serve(cfg: LiveConfig, capacity: tuple[int, int], requests, ready, acks, parent_pid: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    worker = TeacherWorker(teacher_settings(cfg))
    try:
        _answer(worker, cfg, capacity, requests, ready, acks, parent_pid)
    finally:
        worker.close()


def _answer(worker: TeacherWorker, cfg: LiveConfig, capacity: tuple[int, int], requests, ready, acks, parent_pid: int):
    sparsity = worker.settings.stored
    device = worker.engine.device
    ring = _allocate_ring(*capacity, device=device, sampled=sparsity.sampled)
    ready.put(("ring", ring))  # exported once; the producer keeps these tensors alive until it exits
    free = list(range(RING_SLOTS))
    while True:
        try:
            request = requests.get(timeout=POLL_SECONDS * 5)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the trainer died: nobody will read or ack
                return
            continue
        if request is None:
            return
        seq, tokens = request
        samples = answer(worker, tokens, seq=seq, quantize=cfg.quantize)
        while not free:
            free.append(acks.get())
        slot = free.pop(0)
        shapes = _write_slot(ring[slot], samples)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the bytes are there before the trainer reads
        ready.put((seq, slot, shapes))
        while True:  # take back acks that arrived meanwhile, without blocking
            try:
                free.append(acks.get_nowait())
            except queue.Empty:
                break


def answer(
    worker: TeacherWorker, tokens: list[np.ndarray], *, seq: int, quantize: bool, names: list[str] | None = None
) -> SparseSamples:
    """The teacher's sparse distributions of whole samples in request order (the build's
    `TeacherWorker.compute`), through the store's codec where `quantize` (the store's value grid, so live
    and store runs see the same values). A sample the engine leaves out (a served teacher's refusal, or one
    longer than the server takes) stops the run in one line naming it (`names`: the samples' ids): its
    batch is packed already, and training on it without its teacher signal would make a run that a store
    of the same data does not."""
    ids = [f"{seq}:{i}" for i in range(len(tokens))]
    unit = Unit(index=seq, sample_ids=ids, tokens=list(tokens), n_tokens=sum(map(len, tokens)))
    samples = worker.compute(unit)
    if unit.skips:
        missing = sorted(set(ids) - set(samples.sample_ids), key=ids.index)
        i = ids.index(missing[0])
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(unit.skips.items()))
        raise LiveTeacherError(
            f"the live teacher left out sample {(names or ids)[i]!r} ({len(tokens[i])} tokens; {reasons} in its "
            "batch): a live batch cannot go without its teacher signal, so the run stops. For a served teacher "
            "that is the server's refusal or a sample above its max_model_len (lower --max-length); fix it and "
            "continue with --resume"
        )
    samples = _in_request_order(samples, ids)
    if quantize:
        vocab, params = worker.engine.vocab_size, worker.settings.stored.grid
        order = codec.identity_order(vocab).astype(np.int64)
        enc = codec.encode(samples, params=params, code_of_id=order, vocab_size=vocab)
        samples = codec.decode(enc, params=params, id_of_code=order, n_tokens=samples.n_tokens)
    return samples


def _in_request_order(samples: SparseSamples, ids: list[str]) -> SparseSamples:
    at = {sid: i for i, sid in enumerate(samples.sample_ids)}
    return concat([samples.select(at[sid]) for sid in ids])


def _write_slot(slot: dict, samples: SparseSamples) -> dict:
    P, E = len(samples.tail), len(samples.entry_ids)
    if P > slot["tail"].shape[0] or E > slot["entry_ids"].shape[0]:
        raise LiveTeacherError(
            f"a request of {P} positions / {E} entries exceeds the ring's slot "
            f"({slot['tail'].shape[0]} / {slot['entry_ids'].shape[0]})"
        )
    values = {
        "n_entries": samples.n_entries,
        "tail": samples.tail,
        "target_logprobs": samples.target_logprobs,
        "entry_ids": samples.entry_ids,
        "entry_logprobs": samples.entry_logprobs,
    }
    if samples.entry_counts is not None:
        values["entry_counts"] = samples.entry_counts
    for name, array in values.items():
        n = len(array)
        slot[name][:n].copy_(torch.from_numpy(np.ascontiguousarray(array).astype(_NUMPY[name])))
    return {"positions": P, "entries": E}


_NUMPY = {
    "n_entries": np.int32,
    "tail": np.float32,
    "target_logprobs": np.float32,
    "entry_ids": np.int64,
    "entry_logprobs": np.float32,
    "entry_counts": np.int32,
}


# -- the trainer's side ------------------------------------------------------------------------------


class LiveTeacher:
    """The trainer's handle on its teacher process: `compute(tokens)` -> `SparseSamples`, thread-safe."""

    def __init__(self, cfg: LiveConfig, *, micro_batch: int, seq_len: int):
        assert isinstance(cfg.sparsity, Sparsity), "settle_engine settles the sparsity before the teacher starts"
        self.cfg = cfg
        ctx = mp.get_context("spawn")  # CUDA and shared tensors need spawn, never fork
        # None once closed: dropping them frees their named semaphores
        self.requests: Queue[Any] | None = ctx.Queue()
        self.ready: Queue[Any] | None = ctx.Queue()
        self.acks: Queue[Any] | None = ctx.Queue()
        capacity = _slot_capacity(
            micro_batch=micro_batch, seq_len=seq_len, max_length=cfg.max_length, width=cfg.sparsity.width
        )
        self.process = ctx.Process(
            target=teacher_main,
            name="logitstore-live-teacher",
            daemon=True,
            args=(cfg, capacity, self.requests, self.ready, self.acks, os.getpid()),
        )
        self.process.start()
        self._lock = threading.Lock()
        self._seq = 0
        kind, self.ring = self._receive()
        assert kind == "ring", kind

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None  # started in __init__
        return pid

    @property
    def transport(self) -> str:
        """ "cuda_ipc" when the teacher's ring lives on a GPU, else "shared_memory"."""
        return "cuda_ipc" if self.ring[0]["tail"].is_cuda else "shared_memory"

    def compute(self, tokens: list[np.ndarray], *, names: list[str] | None = None) -> SparseSamples:
        """The teacher's sparse distributions of whole samples, in the order given (`names`: their ids, for
        messages; the torch engine leaves no sample out)."""
        assert self.requests is not None and self.acks is not None, "the live teacher is closed"
        with self._lock:  # one request in flight per teacher; the train and eval streams share it
            self._seq += 1
            self.requests.put((self._seq, [np.asarray(t, dtype=np.int64) for t in tokens]))
            seq, slot, shapes = self._receive()
            assert seq == self._seq, (seq, self._seq)
            out = self._copy_out(self.ring[slot], shapes, tokens)
            self.acks.put(slot)  # our copies are taken; no view of the slot survives this call
            return out

    def _receive(self):
        assert self.ready is not None, "the live teacher is closed"
        while True:
            try:
                return self.ready.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self.process.is_alive():
                    raise LiveTeacherError(
                        f"the live teacher process (pid {self.process.pid}) exited with code "
                        f"{self.process.exitcode}; the run stops"
                    ) from None

    @staticmethod
    def _copy_out(slot: dict, shapes: dict, tokens: list[np.ndarray]) -> SparseSamples:
        P, E = shapes["positions"], shapes["entries"]
        take = lambda name, n: slot[name][:n].cpu().numpy().copy()
        n_tokens = np.array([len(t) for t in tokens], dtype=np.int64)
        return SparseSamples(
            sample_ids=[str(i) for i in range(len(tokens))],
            n_tokens=n_tokens,
            input_ids=np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64),
            n_entries=take("n_entries", P),
            entry_ids=take("entry_ids", E),
            entry_logprobs=take("entry_logprobs", E),
            tail=take("tail", P),
            target_logprobs=take("target_logprobs", P),
            entry_counts=take("entry_counts", E) if "entry_counts" in slot else None,
        )

    def close(self) -> None:
        """Stop the teacher and release everything: the ring's views, and the queues, whose named
        semaphores (/dev/shm/sem.mp-*) live until their last reference goes."""
        if self.requests is None or self.ready is None or self.acks is None:  # closed already (all three go at once)
            return
        if self.process.is_alive():
            self.requests.put(None)
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        self.ring = []
        for q in (self.requests, self.ready, self.acks):
            q.close()
            q.join_thread()
        self.requests = self.ready = self.acks = None
        pid = self.pid
        self.process.close()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        remove_process_shm(pid)  # the teacher is gone: whatever it left in /dev/shm is garbage


class InRankTeacher:
    """A teacher that holds no model (`--engine server`): the rank calls the engine itself, through the same
    `answer` as a teacher process, so a live batch is made as the process's is; no process, ring or
    shared memory. Thread-safe: the train and eval streams share it."""

    pid = None  # no teacher process
    transport = "in_rank"

    def __init__(self, cfg: LiveConfig, *, micro_batch: int, seq_len: int):
        self.cfg = cfg
        self.worker: TeacherWorker | None = TeacherWorker(teacher_settings(cfg))
        self._lock = threading.Lock()
        self._seq = 0

    def compute(self, tokens: list[np.ndarray], *, names: list[str] | None = None) -> SparseSamples:
        assert self.worker is not None, "the live teacher is closed"
        with self._lock:
            self._seq += 1
            return answer(self.worker, tokens, seq=self._seq, quantize=self.cfg.quantize, names=names)

    def close(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.close()


# where live mode runs an engine (its `live` attribute, `pipelines/engines/base.py`)
LIVE_TEACHERS: dict[str, type[LiveTeacher] | type[InRankTeacher]] = {"process": LiveTeacher, "rank": InRankTeacher}


def start_teacher(cfg: LiveConfig, *, micro_batch: int, seq_len: int) -> LiveTeacher | InRankTeacher:
    """Live mode's teacher for one rank, where its engine runs (`cfg`: settled, `settle_engine`)."""
    where = engine_class(cfg.engine_options.engine).live
    assert where is not None, "`settle_engine` refuses an engine that does not run in live mode"
    return LIVE_TEACHERS[where](cfg, micro_batch=micro_batch, seq_len=seq_len)


def remove_process_shm(pid: int) -> None:
    """Remove the /dev/shm files named after process `pid`: the CUDA driver's `cuda.shm.<uid>.<pid hex>.<n>`
    and PyTorch's CUDA IPC reference counters `torch_<pid>_<n>_<n>`. A process that exported CUDA
    memory leaves both behind when it exits without tearing its context down, as a spawned child
    does, and a killed one always does (seen on an H100: one 80 KB file per teacher run). Call only
    once `pid` has exited, or from `pid` itself on its way out."""
    for path in glob.glob(f"/dev/shm/cuda.shm.*.{pid:x}.*") + glob.glob(f"/dev/shm/torch_{pid}_*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
