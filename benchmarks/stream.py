"""Streaming throughput of `logitstore.stream`: write, read, decode floor and read amplification, in one run.

Writes a synthetic store through the real writer (`StoreWriter`, one `write` per part of ~16k tokens,
the build's unit, a commit every N parts), then reads it back through the public API only
(`logitstore.open`, `logitstore.stream`), with no model in the loop:

  write_tokens_per_second   encode + write + commit through `StoreWriter` (data generation excluded)
  read_tokens_per_second    one whole epoch from storage, the memory budget at most 1/10 of the store
  decode_tokens_per_second  the same batches from a stream holding the whole store, after a warm-up
                            pass: decode + pack only, the floor any reader pays (best of 3 passes)
  read_amplification        bytes fetched from storage during the epoch / the store's compressed bytes
                            (`view.info()["stored_bytes"]`), scaled to one epoch; `requests` beside it
  first_batch_seconds       from creating the stream to its first batch

Bytes and requests are counted by a Zarr `WrapperStore` under `view.root`: every array read goes through
it (Icechunk's own manifest and snapshot fetches do not, and are not counted). With `--store s3://bucket/prefix` the store lives on a moto S3 server that this script starts
on 127.0.0.1 in its own process (so it does not share the reader's GIL) and stops at exit. With
`--workers N`, N reader processes each read their own rows (rank i of world size N) at the same time;
tokens/s are summed over ranks and divided by the slowest rank's time.

    python benchmarks/stream.py                                    # 2M tokens, sampled-16, vocab 49,152, local
    python benchmarks/stream.py --mode topk --k 64 --vocab 151936
    python benchmarks/stream.py --store s3://bench/stream --json --out benchmarks/results/stream-s3-sampled16-packed-part.json
    python benchmarks/stream.py --smoke --json                     # toy size, seconds (--quick: the same)
    python benchmarks/stream.py --store s3://bench/stream --latency-ms 50   # 50 ms before every S3 request

With `--latency-ms MS` (S3 only) the readers reach moto through a proxy in a process of its own
(`logitstore/testing/faultproxy.py`) that holds every request MS milliseconds before passing it on: object storage's
first-byte latency, which moto on loopback lacks; the write goes to moto directly. `--part-layout arrays`
writes parts one object per array (store format 2's layout), to measure one reader on both layouts.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs
import numpy as np
import zarr
from zarr.storage import WrapperStore

import logitstore
from logitstore.format.samples import SparseSamples
from logitstore.format.sparsity import Sparsity
from logitstore.pipelines.workers import OVERLAP
from logitstore.sizes import format_bytes, parse_bytes
from logitstore.store.meta import TeacherMeta
from logitstore.store.store import Store

TEACHER = "bench"
# The reader's targets, on a 2-core machine with one reader process.
TARGETS = {
    "read_local": 1_000_000,
    "read_s3": 500_000,
    "read_amplification": 1.3,
    "read_vs_decode": 0.30,
    "write": 500_000,
}
FLOOR_REPEATS = 3  # timed passes of the decode floor, best kept (a pass of 2M tokens takes ~1-3 s)
STORE_TO_BUDGET = 10  # the read is measured on a store at least this many times the memory budget
# The smoke run has the full run's proportions: ~64 small parts, so the budget (store / 10) still holds a
# few of them, as at 2M tokens (a reader may need the part it reads and the next in its budget).
SMOKE = {
    "tokens": 65_536,
    "sample_len": 512,
    "part_tokens": 1024,
    "commit_every": 32,
    "seq_len": 1024,
    "micro_batch": 4,
}


# -- synthetic teacher output ----------------------------------------------------------------------


class SyntheticTeacher:
    """Realistic sparse next-token distributions at millions of tokens, vectorised over positions.

    Each position has a Zipf-like distribution over the whole vocabulary: the token of probability rank r
    (1-based) has p(r) = integral of x^-s over [r - 1/2, r + 1/2], normalised over [1/2, V + 1/2]. The
    exponent s is drawn per position (1.1 + an exponential of mean 1), so some positions are flat
    (top-64 mass ~0.75) and most are peaked (mean top-1 probability ~0.55, mean top-64 mass ~0.9,
    roughly a small LM's). Everything has a closed form: top-k log-probabilities, the exact tail mass
    beyond them, and draws by inverse CDF; nothing touches a [positions x vocab] matrix, which at 2M
    positions x 152k tokens could not exist. Which token sits at each rank differs per position: distinct
    ids drawn from a global Zipf(1) unigram (frequent tokens recur across positions, as they do in a real
    teacher's top-k, which is what the codec's frequency renumbering and zstd see), in random rank order.
    The next input token is drawn from the position's own distribution, so target log-probabilities are
    consistent with the entries (a stored token's target log-probability is its entry's).
    """

    def __init__(self, *, vocab: int, mode: str, k: int, seed: int = 0):
        self.vocab, self.mode, self.width = vocab, mode, k  # width: entries (top-k) or draws (sampled)
        self.rng = np.random.default_rng(seed)
        self.token_of_frequency = self.rng.permutation(vocab)  # the unigram's frequency rank -> token id
        # A pool of within-row shuffles: drawing one per row is a gather; an argsort per row would cost
        # a P x k sort for nothing the codec could tell apart.
        self._shuffles = np.argsort(self.rng.random((1024, k)), axis=1)

    def samples(self, sample_ids: list[str], lengths: np.ndarray) -> SparseSamples:
        rng, V, m = self.rng, self.vocab, self.width
        lengths = np.asarray(lengths, dtype=np.int64)
        P = int((lengths - 1).sum())
        s = np.minimum(1.1 + rng.exponential(1.0, P), 8.0)[:, None]  # [P, 1] Zipf exponent per position
        z = _g(0.5, s) - _g(V + 0.5, s)  # [P, 1] normaliser
        valid = np.ones((P, m), dtype=bool)
        if self.mode == "topk":
            ranks = np.broadcast_to(np.arange(1, m + 1), (P, m))
            edges = _g(np.arange(m + 1) + 0.5, s)  # [P, m + 1]: ranks 1..m share their edges
            logp = np.log(edges[:, :-1] - edges[:, 1:]) - np.log(z)  # [P, m] float64
            tail = (edges[:, -1:] - _g(V + 0.5, s)) / z  # the exact mass beyond rank m
        else:
            ranks = np.sort(self._draw_ranks(rng.random((P, m)), s, z), axis=1)
            valid[:, 1:] = ranks[:, 1:] != ranks[:, :-1]  # first draw of each distinct rank
            logp = _log_p(ranks, s, z)
            tail = 1.0 - np.where(valid, np.exp(logp), 0.0).sum(axis=1, keepdims=True)
        tokens = self._distinct_tokens(P, m)  # [P, m] the token at each rank slot
        target_ids, target_logp = self._targets(ranks, tokens, logp, valid, s, z)

        # Input ids: each sample's first token from the unigram, then the targets of its positions.
        first = np.zeros(int(lengths.sum()), dtype=bool)
        first[np.concatenate([[0], np.cumsum(lengths)[:-1]])] = True
        input_ids = np.empty(len(first), dtype=np.int64)
        input_ids[first] = self.token_of_frequency[self._unigram((len(lengths),), V - 1)]
        input_ids[~first] = target_ids

        counts = None
        if self.mode == "sampled":  # draws per distinct rank: run lengths of the sorted draws, row-major
            starts = np.flatnonzero(valid.reshape(-1))
            counts = np.diff(np.append(starts, P * m)).astype(np.int64)
        return SparseSamples(
            sample_ids=list(sample_ids),
            n_tokens=lengths,
            input_ids=input_ids,
            n_entries=valid.sum(axis=1).astype(np.int64),
            entry_ids=tokens[valid].astype(np.int64),  # row-major: rank order, most probable first
            entry_logprobs=logp[valid].astype(np.float32),
            tail=np.clip(tail[:, 0], 0.0, 1.0).astype(np.float32),
            target_logprobs=target_logp.astype(np.float32),
            entry_counts=counts,
        )

    def _draw_ranks(self, u: np.ndarray, s: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Ranks drawn from each row's distribution (inverse CDF of the continuous power law, rounded)."""
        x = ((_g(0.5, s) - u * z) * (s - 1.0)) ** (-1.0 / (s - 1.0))
        return np.clip(np.floor(x + 0.5), 1, self.vocab).astype(np.int64)

    def _unigram(self, shape: tuple, high: int) -> np.ndarray:
        """Frequency ranks in [0, high] from a Zipf(1) unigram (log-uniform)."""
        return (np.exp(self.rng.random(shape) * math.log(high + 1)) - 1).astype(np.int64).clip(0, high)

    def _distinct_tokens(self, P: int, m: int) -> np.ndarray:
        """[P, m] distinct token ids per row, frequent tokens favoured, in random order within the row."""
        f = np.sort(self._unigram((P, m), self.vocab - m), axis=1)
        # Make each sorted row strictly increasing: f'[j] = j + max_{i<=j}(f[i] - i) is the smallest
        # increasing sequence >= f, and stays <= V - 1 because f <= V - m.
        j = np.arange(m)
        f = np.maximum.accumulate(f - j, axis=1) + j
        shuffled = np.take_along_axis(f, self._shuffles[self.rng.integers(0, len(self._shuffles), P)], axis=1)
        return self.token_of_frequency[shuffled]

    def _targets(self, ranks, tokens, logp, valid, s, z) -> tuple[np.ndarray, np.ndarray]:
        """Next token per position, drawn from its distribution, and its log-probability."""
        P = len(ranks)
        r = self._draw_ranks(self.rng.random((P, 1)), s, z)  # [P, 1]
        rows = np.arange(P)
        hit = (ranks == r) & valid  # the drawn rank is a stored entry: that entry's token
        stored, col = hit.any(axis=1), hit.argmax(axis=1)
        target = np.where(stored, tokens[rows, col], 0)
        target_logp = _log_p(r, s, z)[:, 0]
        # Otherwise a token outside the row's entries; one that happens to be an entry takes its
        # log-probability, so a token never has two.
        fresh = self.token_of_frequency[self._unigram((P,), self.vocab - 1)]
        clash = (tokens == fresh[:, None]) & valid
        clashed, clash_col = clash.any(axis=1), clash.argmax(axis=1)
        target = np.where(stored, target, fresh)
        target_logp = np.where(~stored & clashed, logp[rows, clash_col], target_logp)
        return target, target_logp


def _g(x, s):
    """G(x) = x^(1-s) / (s-1): minus the antiderivative of x^-s, decreasing in x."""
    return np.power(x, 1.0 - s) / (s - 1.0)


def _log_p(ranks, s, z):
    return np.log(_g(ranks - 0.5, s) - _g(ranks + 0.5, s)) - np.log(z)


def sample_lengths(*, tokens: int, sample_len: int, seed: int) -> np.ndarray:
    """Window lengths as a build cuts them: most samples a full window, some a document's shorter end."""
    rng = np.random.default_rng([seed, 1])
    n = tokens // sample_len * 2 + 16
    lengths = np.where(rng.random(n) < 0.8, sample_len, rng.integers(max(2, sample_len // 16), sample_len + 1, n))
    ends = np.cumsum(lengths)
    return lengths[: int(np.searchsorted(ends, tokens)) + 1]


def plan_parts(lengths: np.ndarray, *, part_tokens: int) -> list[np.ndarray]:
    """Consecutive samples grouped into parts of at least `part_tokens` tokens (the build's units)."""
    parts, start, total = [], 0, 0
    for i, n in enumerate(lengths.tolist()):  # per sample, not per token
        total += n
        if total >= part_tokens:
            parts.append(np.arange(start, i + 1))
            start, total = i + 1, 0
    if start < len(lengths):
        parts.append(np.arange(start, len(lengths)))
    return parts


def frequency_order(entry_ids: np.ndarray, vocab: int) -> np.ndarray:
    """code_of_id by frequency in the first part, as the build sets it from its first unit."""
    counts = np.bincount(entry_ids, minlength=vocab)
    code_of_id = np.empty(vocab, dtype=np.uint32)
    code_of_id[np.lexsort((np.arange(vocab), -counts))] = np.arange(vocab, dtype=np.uint32)
    return code_of_id


def sparsity(args) -> Sparsity:
    return Sparsity(k=args.k) if args.mode == "topk" else Sparsity(mode="sampled", n=args.k)


# -- writing -----------------------------------------------------------------------------------------


# Parts a build's process writes at once: its unit threads but the one in the teacher's forward pass.
WRITER_THREADS = OVERLAP - 1


def write_store(uri: str, args, log) -> dict:
    """Write the synthetic store; time encode + write + commit only (generation excluded)."""
    teacher = SyntheticTeacher(vocab=args.vocab, mode=args.mode, k=args.k, seed=args.seed)
    lengths = sample_lengths(tokens=args.tokens, sample_len=args.sample_len, seed=args.seed)
    parts = plan_parts(lengths, part_tokens=args.part_tokens)
    meta = TeacherMeta(
        name=TEACHER,
        vocab_size=args.vocab,
        content_hash="synthetic",
        tokenizer_hash="synthetic",
        sparsity=sparsity(args),
        part_layout=args.part_layout,
    )
    _warm_up_writer(teacher, meta)  # numba's first compile and lazy imports are not write throughput
    store = Store.open(uri, create=True)
    seconds, generate_seconds, entries = 0.0, 0.0, 0
    # As a build's process writes: `writer_threads` parts at once (its unit threads but the one in the forward
    # pass), each through the transaction's part writer, merged into the transaction by this thread in order.
    with ThreadPoolExecutor(max_workers=args.writer_threads, thread_name_prefix="stream-bench-write") as pool:
        for c in range(0, len(parts), args.commit_every):
            group = parts[c : c + args.commit_every]
            start = time.perf_counter()  # the synthetic teacher's samples, outside the timing
            batch = [teacher.samples([f"doc{r:08d}#w0" for r in rows.tolist()], lengths[rows]) for rows in group]
            generate_seconds += time.perf_counter() - start
            if c == 0:
                batch[0].validate(vocab_size=args.vocab)  # the writer validates again, inside the timing
                _check_distributions(batch[0])
            entries += sum(len(samples.entry_ids) for samples in batch)
            start = time.perf_counter()
            with store.writer() as writer:
                if c == 0:
                    writer.add_teacher(meta, code_of_id=frequency_order(batch[0].entry_ids, args.vocab))
                write = functools.partial(writer.part_writer().write, teacher=TEACHER)
                for written in pool.map(write, batch):
                    writer.merge(written)
                writer.commit(f"stream benchmark: parts {c}..{c + len(group) - 1}")
            seconds += time.perf_counter() - start
            log(f"  wrote {min(c + args.commit_every, len(parts))}/{len(parts)} parts")
    tokens = int(lengths.sum())
    return {
        "tokens": tokens,
        "samples": len(lengths),
        "parts": len(parts),
        "write_seconds": seconds,
        "generate_seconds": generate_seconds,
        "entries_per_position": entries / (tokens - len(lengths)),
        "write_tokens_per_second": tokens / seconds,
        "writer_threads": args.writer_threads,
    }


def write_synthetic(uri: str, **shapes) -> dict:
    """`write_store` quietly, with this script's defaults for every option `shapes` leaves out: the synthetic
    store other benchmarks measure on (train_scaling.py, stream_loader.py)."""
    args = parse_args([])
    vars(args).update(shapes)
    return write_store(uri, args, log=lambda _: None)


def _warm_up_writer(teacher: SyntheticTeacher, meta: TeacherMeta) -> None:
    store = Store.open(f"memory://stream-bench-warm-up-{time.time_ns()}", create=True)
    samples = teacher.samples(["warm-up-a", "warm-up-b"], np.array([64, 32]))
    with store.writer() as w:
        w.add_teacher(meta, code_of_id=frequency_order(samples.entry_ids, meta.vocab_size))
        w.write(samples, teacher=meta.name)
        w.commit("warm-up")


def _check_distributions(s: SparseSamples) -> None:
    """What `validate` does not check: each position's entries plus tail are one distribution."""
    position = np.repeat(np.arange(len(s.n_entries)), s.n_entries)
    mass = np.bincount(position, weights=np.exp(s.entry_logprobs.astype(np.float64)), minlength=len(s.n_entries))
    assert np.allclose(mass + s.tail, 1.0, atol=1e-4), "entries and tail must sum to 1"
    assert (s.n_entries >= 1).all() and (s.target_logprobs <= 0).all()


# -- reading -----------------------------------------------------------------------------------------


class Counts:
    def __init__(self):
        self.requests = 0
        self.bytes = 0


class CountingStore(WrapperStore):
    """Counts requests and bytes returned (what an object store bills); shares its `Counts` with the
    copies Zarr makes of it (`with_read_only`)."""

    def __init__(self, store, counts: Counts | None = None):
        super().__init__(store)
        self.counts = counts if counts is not None else Counts()

    def _with_store(self, store):
        return type(self)(store, self.counts)

    async def get(self, key, prototype, byte_range=None):
        buf = await self._store.get(key, prototype, byte_range)
        self.counts.requests += 1
        self.counts.bytes += 0 if buf is None else len(buf)
        return buf

    async def get_partial_values(self, prototype, key_ranges):
        bufs = await self._store.get_partial_values(prototype, key_ranges)
        self.counts.requests += len(bufs)
        self.counts.bytes += sum(0 if b is None else len(b) for b in bufs)
        return bufs


def open_counted(uri: str, version: str) -> tuple[object, Counts]:
    """A fresh view (no caches shared with any other) whose reads all go through a byte counter."""
    view = logitstore.open(uri, version)
    counter = CountingStore(view.root.store)
    view.root = zarr.open_group(counter, mode="r")
    return view, counter.counts


@dataclass
class ReadJob:
    uri: str
    version: str
    tokens: int  # tokens in the store (the whole split: eval_fraction 0)
    seq_len: int
    micro_batch: int
    memory_budget: int
    floor_budget: int
    rank: int
    world_size: int
    max_seconds: float
    reader_groups: int | None = None  # --world-size: the stream's default (the world size) unless given
    prefetch: int = 4  # the stream's default

    def stream(self, view, budget: int):
        return logitstore.stream(
            view,
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
            seed=0,
            rank=self.rank,
            world_size=self.world_size,
            memory_budget=budget,
            eval_fraction=0.0,
            reader_groups=self.reader_groups,
            prefetch=self.prefetch,
        )

    @property
    def steps(self) -> int:
        """Micro-batches per epoch for each rank (the stream's contract: rows // (world x micro_batch))."""
        return self.tokens // self.seq_len // (self.world_size * self.micro_batch)


def warm_up_reader(job: ReadJob) -> None:
    """Lazy imports (torch, the trainer) and numba's first decode: paid once per process, not per epoch.
    Its own view, so nothing it caches helps the measured reads."""
    view = logitstore.open(job.uri, job.version)
    with job.stream(view, job.memory_budget) as batches:
        next(iter(batches))


def read_epoch(job: ReadJob) -> dict:
    """One epoch of this rank from storage, memory budget `job.memory_budget`."""
    view, counts = open_counted(job.uri, job.version)
    tokens = batches = 0
    first = None
    start = time.perf_counter()
    stream = job.stream(view, job.memory_budget)
    steps = getattr(stream, "steps_per_epoch", job.steps)
    with stream:
        for batch in stream:
            if first is None:
                first = time.perf_counter() - start
            tokens += batch.n_tokens
            batches += 1
            if batches >= steps or time.perf_counter() - start > job.max_seconds:
                break
        seconds = time.perf_counter() - start
        fetched, requests = counts.bytes, counts.requests  # before close: later prefetch is not this epoch's
    return {
        "rank": job.rank,
        "tokens": tokens,
        "batches": batches,
        "steps_per_epoch": steps,
        "seconds": seconds,
        "first_batch_seconds": first,
        "bytes_fetched": fetched,
        "requests": requests,
    }


def decode_floor(job: ReadJob, batches: int, barrier) -> dict:
    """The same `batches` again from memory: a stream whose budget holds the whole store reads them once
    (the warm-up pass, which fills its cache), is rewound to its start, and is timed over them again."""
    view, counts = open_counted(job.uri, job.version)
    stream = job.stream(view, job.floor_budget)
    with stream:
        start_state = stream.state_dict()
        start = time.perf_counter()
        _take(stream, batches)
        warm_up = time.perf_counter() - start
        before = counts.bytes
        seconds = math.inf
        for _ in range(FLOOR_REPEATS):  # the best pass: a floor, and one pass is short and noisy
            stream.load_state_dict(start_state)
            barrier.wait()  # every rank ready: the timed pass starts together
            start = time.perf_counter()
            tokens = _take(stream, batches)
            seconds = min(seconds, time.perf_counter() - start)
        refetched = counts.bytes - before
    return {
        "rank": job.rank,
        "tokens": tokens,
        "seconds": seconds,
        "warm_up_seconds": warm_up,
        "bytes_fetched_when_cached": refetched,
    }


def _take(stream, n: int) -> int:
    tokens = 0
    for i, batch in enumerate(stream):
        tokens += batch.n_tokens
        if i + 1 >= n:
            break
    return tokens


def rank_main(job: ReadJob, barrier, results) -> None:
    """One reader process (or the main process with --workers 1): warm up, then read, then the floor;
    the timed phases start together on every rank."""
    try:
        warm_up_reader(job)
        barrier.wait()
        read = read_epoch(job)
        results.put(("read", read))
        results.put(("floor", decode_floor(job, read["batches"], barrier)))
    except BaseException as e:
        barrier.abort()
        results.put(("error", f"rank {job.rank}: {type(e).__name__}: {e}"))
        raise


class _NoBarrier:
    def wait(self):
        pass

    def abort(self):
        pass


def run_readers(jobs: list[ReadJob], log) -> tuple[list[dict], list[dict]]:
    """(per-rank reads, per-rank floors). Ranks start each timed phase together, so the slowest rank's
    seconds are the phase's wall time."""
    if len(jobs) == 1:
        import queue

        results = queue.Queue()
        rank_main(jobs[0], _NoBarrier(), results)
        got = [results.get() for _ in range(2)]
        return [got[0][1]], [got[1][1]]
    # spawn, not fork: Icechunk's Tokio runtime and the prefetch threads do not survive a fork
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(jobs) + 1), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(job, barrier, results), daemon=True) for job in jobs]
    for p in procs:
        p.start()
    try:
        try:
            barrier.wait()  # every rank warmed up: the read starts now
            reads = _collect(results, "read", procs)
            log(f"  read done on {len(jobs)} ranks; decode floor next")
            for _ in range(FLOOR_REPEATS):
                barrier.wait()  # every rank has its cache filled: a timed decode pass starts now
            floors = _collect(results, "floor", procs)
        except threading.BrokenBarrierError:  # a rank failed and aborted the barrier: say why
            _collect(results, "error", procs)
            raise
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return sorted(reads, key=lambda r: r["rank"]), sorted(floors, key=lambda r: r["rank"])


def _collect(results, kind: str, procs) -> list[dict]:
    """One `kind` result per rank; a rank's error (or a rank that died without one) raises."""
    import queue

    out = []
    while len(out) < len(procs):
        try:
            got_kind, value = results.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a reader process died: exit codes {[p.exitcode for p in procs]}") from None
            continue
        if got_kind == "error":
            raise RuntimeError(value)
        if kind == "error":  # looking for the failure: results that came before it do not matter
            continue
        assert got_kind == kind, (got_kind, kind)
        out.append(value)
    return out


# -- storage ---------------------------------------------------------------------------------------


@contextmanager
def store_location(store: str | None):
    """The URI to write to: a temporary folder (removed at exit), a new local folder (kept), or an
    s3:// location on a moto server started here (stopped at exit)."""
    if store is None:
        tmp = tempfile.mkdtemp(prefix="logitstore-stream-bench-")
        try:
            yield str(Path(tmp) / "store"), "local"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    if store.startswith("s3://"):
        with moto_server() as endpoint:
            import boto3

            bucket = store[len("s3://") :].split("/", 1)[0]
            from botocore.exceptions import ClientError

            try:
                boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
            except ClientError as e:
                raise SystemExit(f"--store {store}: cannot create bucket {bucket!r}: {e}") from None
            yield store, "s3 (moto on 127.0.0.1, own process)"
        return
    path = Path(store)
    if path.exists() and any(path.iterdir()):
        raise SystemExit(f"--store {store}: the folder exists and is not empty; give a new location")
    yield str(path), "local"


@contextmanager
def moto_server():
    """moto's S3 server in a subprocess on loopback; AWS_* variables point this process (and the reader
    processes it spawns) at it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    saved = {
        k: os.environ.get(k)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
    }
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"moto's S3 server did not start on port {port}") from None
                time.sleep(0.1)
        os.environ.update(
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_REGION="us-east-1",
            AWS_ENDPOINT_URL=endpoint,
        )
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def latency_proxy(latency_ms: float | None, log):
    """With `--latency-ms`: a proxy (`logitstore/testing/faultproxy.py`, its own process) between the readers and
    moto that holds each request `latency_ms` before passing it on; AWS_ENDPOINT_URL points this process
    and the reader processes it spawns at it while the block runs. Without: nothing."""
    if not latency_ms:
        yield
        return
    upstream = urlparse(os.environ["AWS_ENDPOINT_URL"])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "logitstore.testing.faultproxy",
            f"{upstream.hostname}:{upstream.port}",
            "--latency-ms",
            str(latency_ms),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None  # PIPEs
    endpoint = proc.stdout.readline().strip()
    if not endpoint.startswith("http://"):
        raise SystemExit(f"the latency proxy did not start (exit code {proc.poll()})")
    log(f"  reading through a proxy at {endpoint}: {latency_ms:g} ms before every request")
    saved = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        yield
    finally:
        os.environ["AWS_ENDPOINT_URL"] = saved
        proc.stdin.close()  # the proxy's signal to stop
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- --world-size: a cluster's ranks, simulated in this process ----------------------------------------


def world_run(args, *, base: ReadJob, view, info: dict, log) -> dict:
    """One epoch of each of `--world-size` ranks, read one rank after another in this process (64 reader
    processes would not fit 2 cores), each through its own counted view: `cluster_read_amplification`
    is the bytes all ranks fetched over the stored bytes (per epoch), `read_tokens_per_second` each
    rank's own rate (its tokens over its time; ranks do not compete for the CPU, as they would not on
    their own nodes). The memory budget defaults to the store / 10, raised to two parts per reader group
    where that is more (a group's window needs at least one part)."""
    stored, world = int(info["stored_bytes"]), args.world_size
    groups = args.reader_groups or world
    budget = (
        parse_bytes(args.memory_budget, name="--memory-budget")
        if args.memory_budget
        else max(stored // STORE_TO_BUDGET, _two_parts_per_group(view, groups))
    )
    jobs = [
        dataclasses.replace(base, memory_budget=budget, rank=r, world_size=world, reader_groups=groups, prefetch=0)
        for r in range(world)  # prefetch 0: batches built ahead would read the next epoch's parts into this one's count
    ]
    log(
        f"reading one epoch as {world} ranks in turn, {groups} reader groups: seq_len {args.seq_len} x "
        f"micro_batch {args.micro_batch}, memory budget {format_bytes(budget)} per rank"
    )
    warm_up_reader(jobs[0])
    reads = [read_epoch(job) for job in jobs]  # one rank after another
    fraction = sum(r["batches"] for r in reads) / sum(r["steps_per_epoch"] for r in reads)
    fetched = sum(r["bytes_fetched"] for r in reads)
    rates = [r["tokens"] / r["seconds"] for r in reads]
    return {
        "benchmark": "benchmarks/stream.py --world-size",
        "label": args.label,
        "shapes": {
            "tokens": int(info["tokens"]),
            "parts": len(set(view.index["part"].to_pylist())),
            "part_tokens": args.part_tokens,
            "sample_len": args.sample_len,
            "mode": args.mode,
            "k": args.k,
            "vocab": args.vocab,
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "memory_budget": budget,
        },
        "world_size": world,
        "reader_groups": groups,
        "stored_bytes": stored,
        "bytes_fetched": fetched,
        "cluster_read_amplification": fetched / (stored * fraction),
        "read_tokens_per_second": rates,
        "read_tokens_per_second_min": min(rates),
        "read_tokens_per_second_median": float(np.median(rates)),
        "epoch_fraction": fraction,
        "target_cluster_read_amplification": TARGETS["read_amplification"],
        "ranks": reads,
        "notes": [
            "ranks read one after another in one process, each through its own view and byte counter",
            "cluster_read_amplification: bytes fetched by all ranks / the store's stored bytes, per epoch "
            "(scaled when --max-read-seconds cut the epoch); Icechunk's manifest fetches are not counted",
        ],
    }


def _two_parts_per_group(view, groups: int) -> int:
    """A budget that holds two parts for each reader group, in the stream's measure (decoded bytes held):
    probed from a stream of the version."""
    probe = logitstore.stream(view, seq_len=2, micro_batch=1, eval_fraction=0.0)
    try:
        return 2 * groups * int(probe.source.part_bytes().max())
    finally:
        probe.close()


# -- the run -----------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2_000_000, help="tokens to write (default 2M)")
    p.add_argument("--vocab", type=int, default=49_152, help="teacher vocabulary (49,152 SmolLM2; 151,936 Qwen)")
    p.add_argument("--sample-len", type=int, default=1024, help="tokens per sample (window); some are shorter")
    p.add_argument("--mode", choices=("topk", "sampled"), default="sampled")
    p.add_argument("--k", type=int, default=16, help="entries per position (topk) or draws (sampled)")
    p.add_argument("--part-tokens", type=int, default=16_384, help="tokens per part (the build's unit_tokens)")
    p.add_argument("--commit-every", type=int, default=32, help="parts per commit")
    p.add_argument(
        "--writer-threads",
        type=int,
        default=WRITER_THREADS,
        help=f"parts written at once (default {WRITER_THREADS}: a build's process has {OVERLAP} unit threads, one "
        "of them in the teacher's forward pass while the others select and write)",
    )
    p.add_argument(
        "--store",
        help="a new local folder, or s3://bucket/prefix on a moto server started here (default: a temporary folder)",
    )
    p.add_argument("--memory-budget", help=f"the reader's memory budget (default: the store / {STORE_TO_BUDGET})")
    p.add_argument(
        "--allow-small-store",
        action="store_true",
        help=f"measure even if the store is less than {STORE_TO_BUDGET}x the memory budget",
    )
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--workers", type=int, default=1, help="reader processes, each a rank of world size N")
    p.add_argument(
        "--world-size",
        type=int,
        help="simulate W ranks in this process, one after another: cluster_read_amplification and each rank's "
        "read_tokens_per_second (instead of the one-reader measurements)",
    )
    p.add_argument("--reader-groups", type=int, help="with --world-size: the stream's reader groups (default: W)")
    p.add_argument(
        "--max-read-seconds",
        type=float,
        default=300.0,
        help="stop the epoch after this long and report the fraction read (epoch_fraction)",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="S3 only: hold every read request this long (a proxy in front of moto), as distant object storage does",
    )
    p.add_argument(
        "--part-layout",
        choices=("packed", "arrays"),
        default="packed",
        help="how parts are stored: packed (one object per part, store format 3) or arrays (one per array, before)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout (summary on stderr)")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--label", help="free text recorded in the JSON (e.g. which engine was measured)")
    args = smoke.parse_args(p, argv, sizes=SMOKE, aliases=("--quick",))
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.latency_ms < 0 or (args.latency_ms and not (args.store or "").startswith("s3://")):
        p.error("--latency-ms needs --store s3://... (a proxy in front of moto) and is at least 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.load_at_start = round(os.getloadavg()[0], 2)  # the machine is shared: say how busy it was
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    shape = f"{args.mode}-{args.k}" if args.mode == "sampled" else f"top-{args.k}"
    with store_location(args.store) as (uri, backend):
        log(f"writing {args.tokens:,} tokens ({shape}, vocab {args.vocab:,}) to {uri} [{backend}]")
        written = write_store(uri, args, log)
        view = logitstore.open(uri)
        info = view.info()
        stored = int(info["stored_bytes"])
        budget = (
            parse_bytes(args.memory_budget, name="--memory-budget") if args.memory_budget else stored // STORE_TO_BUDGET
        )
        if stored < STORE_TO_BUDGET * budget and not args.allow_small_store:
            raise SystemExit(
                f"the store ({format_bytes(stored)}) is less than {STORE_TO_BUDGET}x the memory budget "
                f"({format_bytes(budget)}): write more --tokens, lower --memory-budget, or pass "
                "--allow-small-store"
            )
        entries = int(view.index["n_entries"].to_numpy().sum()) if "n_entries" in view.index.column_names else None
        jobs = [
            ReadJob(
                uri=uri,
                version=view.snapshot_id,
                tokens=int(info["tokens"]),
                seq_len=args.seq_len,
                micro_batch=args.micro_batch,
                memory_budget=budget,
                floor_budget=_floor_budget(int(info["tokens"]), entries or info["tokens"] * args.k),
                rank=r,
                world_size=args.workers,
                max_seconds=args.max_read_seconds,
            )
            for r in range(args.workers)
        ]
        if args.world_size:  # W ranks in this process instead of the one-reader measurements
            result = world_run(args, base=jobs[0], view=view, info=info, log=log)
            return _report(args, result, log, f"cluster read amplification {result['cluster_read_amplification']:.3f}")
        log(
            f"reading one epoch: seq_len {args.seq_len} x micro_batch {args.micro_batch}, {args.workers} reader "
            f"process(es), memory budget {format_bytes(budget)} (the store is {stored / budget:.1f}x)"
        )
        with latency_proxy(args.latency_ms, log):
            reads, floors = run_readers(jobs, log)
        if args.latency_ms:
            backend += f", {args.latency_ms:g} ms per request (proxy)"
    result = summarise(args, written, info, budget, jobs, reads, floors, backend, shape)
    return _report(args, result, log, summary_text(result))


def _report(args, result: dict, log, summary: str) -> dict:
    """Log the summary line; print the JSON (`--json`) and write it (`--out`)."""
    log(summary)
    if args.json:
        print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _floor_budget(tokens: int, entries: int) -> int:
    """Room for the whole store twice over even decoded (int64 ids, float32 values), so a stream with
    this budget keeps everything in memory whatever form it caches."""
    decoded = tokens * 32 + entries * 24
    return 2 * decoded + (256 << 20)


def summarise(args, written, info, budget, jobs, reads, floors, backend, shape) -> dict:
    stored = int(info["stored_bytes"])
    read_tokens = sum(r["tokens"] for r in reads)
    batches = sum(r["batches"] for r in reads)
    steps = sum(r["steps_per_epoch"] for r in reads)
    fraction = batches / steps
    fetched = sum(r["bytes_fetched"] for r in reads)
    requests = sum(r["requests"] for r in reads)
    read_wall, floor_wall = max(r["seconds"] for r in reads), max(f["seconds"] for f in floors)
    read_tps = read_tokens / read_wall
    decode_tps = sum(f["tokens"] for f in floors) / floor_wall
    amplification = fetched / (stored * fraction)  # per epoch: scaled up when only a fraction was read
    s3 = backend.startswith("s3")
    notes = [
        f"each of the {args.workers} reader processes reads its own rows (rank i of world size {args.workers}); "
        "tokens/s are summed over ranks over the slowest rank's time"
        if args.workers > 1
        else "one reader process (rank 0 of world size 1)",
        "counted bytes are Zarr reads under view.root (chunks, shard indexes, metadata); Icechunk's own "
        "manifest and snapshot fetches are not counted",
        "read time runs from creating the stream to the last batch of the epoch (first batch included); "
        "no model in the loop",
    ]
    if fraction < 1:
        notes.append(
            f"the epoch was cut at --max-read-seconds {args.max_read_seconds:g}: {fraction:.1%} of it was read; "
            "read_amplification is scaled to one epoch"
        )
    targets = {
        "read_tokens_per_second": TARGETS["read_s3" if s3 else "read_local"],
        "read_amplification": TARGETS["read_amplification"],
        "read_vs_decode": TARGETS["read_vs_decode"],
        "write_tokens_per_second": TARGETS["write"],
    }
    values = {
        "read_tokens_per_second": read_tps,
        "read_amplification": amplification,
        "read_vs_decode": read_tps / decode_tps,
        "write_tokens_per_second": written["write_tokens_per_second"],
    }
    return {
        "benchmark": "benchmarks/stream.py",
        "label": args.label,
        "store": backend,
        "shapes": {
            "tokens": written["tokens"],
            "samples": written["samples"],
            "parts": written["parts"],
            "part_tokens": args.part_tokens,
            "sample_len": args.sample_len,
            "vocab": args.vocab,
            "mode": args.mode,
            "k": args.k,
            "shape": shape,
            "entries_per_position": round(written["entries_per_position"], 3),
            "commit_every_parts": args.commit_every,
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "workers": args.workers,
            "latency_ms": args.latency_ms,
            "part_layout": args.part_layout,
            "memory_budget": budget,
            "store_to_budget": round(stored / budget, 2),
            "floor_memory_budget": jobs[0].floor_budget,
        },
        "write_tokens_per_second": written["write_tokens_per_second"],
        "writer_threads": written["writer_threads"],
        "read_tokens_per_second": read_tps,
        "latency_ms": args.latency_ms,
        "decode_tokens_per_second": decode_tps,
        "read_amplification": amplification,
        "first_batch_seconds": max(r["first_batch_seconds"] or math.inf for r in reads),
        "stored_bytes": stored,
        "requests": requests,
        "bytes_fetched": fetched,
        "bytes_per_token": stored / written["tokens"],
        "read_vs_decode": read_tps / decode_tps,
        "epoch_fraction": fraction,
        "steps_per_epoch": steps,
        "batches_read": batches,
        "read_tokens": read_tokens,
        "read_seconds": read_wall,
        "decode_seconds": floor_wall,
        "decode_warm_up_seconds": max(f["warm_up_seconds"] for f in floors),
        "decode_bytes_fetched_when_cached": sum(f["bytes_fetched_when_cached"] for f in floors),
        "write_seconds": written["write_seconds"],
        "generate_seconds": written["generate_seconds"],
        "targets": targets,
        "targets_met": {
            k: (values[k] <= t if k == "read_amplification" else values[k] >= t) for k, t in targets.items()
        },
        "ranks": [{**r, **{f"decode_{k}": v for k, v in f.items() if k != "rank"}} for r, f in zip(reads, floors)],
        "notes": notes,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1m_at_start": args.load_at_start,
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "python": sys.version.split()[0],
            "logitstore": str(Path(logitstore.__file__).parent),
        },
    }


def summary_text(r: dict) -> str:
    s, t, met = r["shapes"], r["targets"], r["targets_met"]
    mark = lambda k: "ok" if met[k] else "MISSED"
    lines = [
        f"stream benchmark: {s['shape']}, vocab {s['vocab']:,}, {r['store']}",
        f"  shapes: {s['tokens']:,} tokens in {s['samples']:,} samples (~{s['sample_len']:,} tokens) in {s['parts']} parts "
        f"of ~{s['part_tokens']:,} tokens, {s['entries_per_position']:.1f} entries/position; commit every "
        f"{s['commit_every_parts']} parts",
        f"  reading: seq_len {s['seq_len']:,} x micro_batch {s['micro_batch']}, {s['workers']} reader process(es), "
        f"memory budget {format_bytes(s['memory_budget'])} (store {s['store_to_budget']:.1f}x the budget)",
        f"  stored          {format_bytes(r['stored_bytes'])} ({r['bytes_per_token']:.1f} B/token)",
        f"  write           {r['write_tokens_per_second']:>12,.0f} tokens/s  (encode + write + commit, one process, "
        f"{r['writer_threads']} part(s) at once)"
        f"   target >= {t['write_tokens_per_second']:,}: {mark('write_tokens_per_second')}",
        f"  read            {r['read_tokens_per_second']:>12,.0f} tokens/s  ({r['epoch_fraction']:.0%} of an epoch in "
        f"{r['read_seconds']:.1f} s)   target >= {t['read_tokens_per_second']:,}: {mark('read_tokens_per_second')}",
        f"  decode floor    {r['decode_tokens_per_second']:>12,.0f} tokens/s  (the same batches from memory); read is "
        f"{r['read_vs_decode']:.0%} of it   target >= {t['read_vs_decode']:.0%}: {mark('read_vs_decode')}",
        f"  read amplification {r['read_amplification']:.2f}  ({format_bytes(r['bytes_fetched'])} fetched in "
        f"{r['requests']:,} requests)   target <= {t['read_amplification']}: {mark('read_amplification')}",
        f"  first batch     {r['first_batch_seconds']:.3f} s",
    ]
    return "\n".join(lines + [f"  note: {n}" for n in r["notes"]])


if __name__ == "__main__":
    main()
