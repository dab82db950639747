"""The stream engine: a pinned store version (or a live teacher) -> packed, fixed-length micro-batches
with the teacher's sparse targets. Deterministic, sharded across ranks, resumable mid-epoch, and
reading each stored byte about once per epoch however large the store.

One engine, `Stream`, owns order, split, packing, sharding, resume, reading and prefetch. What turns
a piece of a sample into targets is its *source* (`Source`): `teacher_source.StoreSource` (one teacher of
a store), `mixing.MixedSource` (several or cross-tokenizer teachers), `version_mix.VersionsSource` (a weighted
mix of a store's versions) and `live.stream.LiveSource` (a teacher process beside the trainer). `store_stream`
builds the first three, `logitstore.stream` the first two.

The stream lives in five modules: its options and their checks (`spec.py`), the order (`order.py`: the
split, the epoch plan, windows and packing, without reading data), the batch (`batch.py`: `PackedBatch`
and `assemble`), the store's source (`teacher_source.py`) and the engine with its factory (here).

The contract, which tests/test_stream.py holds the engine to, is in docs/train.md ("Streaming", "The
stream's contract"): the split by id hash, reader groups, the window shuffle within a group, the
memory budget, packing, sharding, the state a run resumes from, iteration, DataLoader workers,
prefetch, damaged data and outages.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Generator, Iterator

import numpy as np
import torch

from logitstore.ahead import read_ahead
from logitstore.errors import DamagedDataError, StorageError
from logitstore.sizes import format_bytes, parse_bytes
from logitstore.store.store import Store
from logitstore.store.version import StoreVersion
from logitstore.streaming.batch import PackedBatch
from logitstore.streaming.mixing import MixedSource
from logitstore.streaming.order import EpochPlan, Pieces, deal_samples, group_window_parts, window_parts
from logitstore.streaming.segments import plan_segments
from logitstore.streaming.source import HeldParts, Source
from logitstore.streaming.spec import DEFAULT_MEMORY_BUDGET, StreamConfigError, StreamSpec
from logitstore.streaming.teacher_source import StoreSource
from logitstore.streaming.version_mix import VersionsSource, WeightedVersion, mix_version

LOOKAHEAD_BATCHES = 8  # micro-batches ahead whose parts are asked for: work for every reader thread


# -- the engine ---------------------------------------------------------------------------------------------


class Stream(torch.utils.data.IterableDataset):
    """Packed micro-batches of one rank from a source, to the contract in docs/train.md. Use as
    an iterable; `state_dict`/`load_state_dict` resume mid-epoch; `close()` (or `with`) when done. An
    `IterableDataset`, so `DataLoader(stream, batch_size=None, num_workers=W, multiprocessing_context=
    "spawn")` decodes in W processes and yields the same batches in the same order."""

    def __init__(self, source: Source, spec: StreamSpec):
        self.spec = spec = spec.placed()
        assert spec.rank is not None and spec.world_size is not None  # placed
        self.source, self.table = source, source.table
        # The spec's options the engine reads all the time, and sources through `BatchContext`.
        seq_len, micro_batch, world_size, split = spec.seq_len, spec.micro_batch, spec.world_size, spec.split
        self.seq_len, self.micro_batch, self.rank, self.world_size = seq_len, micro_batch, spec.rank, world_size
        self.seed, self.split, self.prefetch, self.on_error = spec.seed, split, spec.prefetch, spec.on_error
        self.n_samples = len(self.table.sample_ids)
        self._plans: dict[int, EpochPlan] = {}
        self._needs_of_step: dict[tuple[int, int], list] = {}  # (epoch, step's first row) -> `_needs`
        part_bytes = source.part_bytes()
        self._reads = part_bytes is not None  # live mode reads nothing: one group
        self._set_groups(spec.reader_groups or spec.default_reader_groups())
        self.memory_budget = parse_bytes(
            spec.memory_budget if spec.memory_budget is not None else DEFAULT_MEMORY_BUDGET,
            name="memory budget (--memory-budget)",
        )
        self.window_parts = (
            None if part_bytes is None else window_parts(part_bytes, self.memory_budget, where=self._where)
        )
        self._group_window = self._window_of_groups()
        self._parts = (
            None
            if part_bytes is None
            else HeldParts(
                source.read_part, sizes=part_bytes, threads=spec.read_threads, warm=getattr(source, "warm_part", None)
            )
        )
        self._part_bytes = part_bytes
        self._held: dict[int, tuple[int, int, list[int]]] = {}  # group -> (epoch, window, parts held for it)
        self._epoch, self._rows = 0, 0  # the consumer's position: what has been yielded
        self._generation = 0
        self._worker: Generator | None = None  # the prefetch thread's iterator (`read_ahead`)
        self.wait_seconds = 0.0
        self.skipped_ids: set[str] = set()
        self._recipe: dict | None = None  # how `store_stream` made it: what a worker process rebuilds it from

    @property
    def _where(self) -> str:
        return getattr(self.source, "where", f"the {self.split} split")

    @property
    def skipped_samples(self) -> int:
        """Distinct samples skipped as unreadable (on_error="skip")."""
        return len(self.skipped_ids)

    @property
    def part_reads(self) -> int:
        """Parts fetched from storage so far (each read whole, or its split's ranges)."""
        return 0 if self._parts is None else self._parts.reads

    @property
    def peak_parts_held(self) -> int:
        """The most parts held in memory at once so far (read, or being read)."""
        return 0 if self._parts is None else self._parts.peak

    @property
    def peak_bytes_held(self) -> int:
        """The most bytes of parts held in memory at once so far (`Source.part_bytes`): at most the
        memory budget when the stream reads in windows."""
        return 0 if self._parts is None else self._parts.peak_bytes

    def _set_groups(self, groups: int) -> None:
        """Deal the samples to `groups` reader groups (the eval split, and a source with nothing to read:
        one) and count the rows they pack: each group packs its own, so a group's partial last row
        is dropped (train) or padded (eval)."""
        self.reader_groups = groups
        effective = min(groups, self.n_samples) if self.split == "train" and self._reads else 1
        self.effective_groups = effective  # groups holding samples: no more than there are samples
        self._group_of_sample = deal_samples(self.table, seed=self.seed, groups=effective)
        tokens = np.bincount(self._group_of_sample, self.table.n_tokens, minlength=effective)
        self.rows_per_epoch = int(sum(self._packed_rows(int(t)) for t in tokens.tolist()))  # one step per group
        block = self.world_size * self.micro_batch
        if self.split == "eval":  # every token counts once: a padded last row and a padded last step
            self.steps_per_epoch = -(-self.rows_per_epoch // block)
        else:
            self.steps_per_epoch = self.rows_per_epoch // block
        self._plans.clear()
        self._needs_of_step.clear()
        self._check_size()

    def _packed_rows(self, tokens: int) -> int:
        """Rows `tokens` packed tokens fill: the eval split pads its last row, the train split drops it."""
        return -(-tokens // self.seq_len) if self.split == "eval" else tokens // self.seq_len

    def _window_of_groups(self) -> int | None:
        """Parts per window of each reader group (None: one window each)."""
        return group_window_parts(self._effective_window(), groups=self.effective_groups, where=self._where)

    def _check_size(self) -> None:
        if self.n_samples == 0:
            hint = "; raise --eval-fraction to hold some out" if self.split == "eval" else ""
            raise StreamConfigError(f"{self._where} holds no samples{hint}")
        if self.steps_per_epoch == 0:
            raise StreamConfigError(
                f"{self._where} packs into {self.rows_per_epoch} rows of {self.seq_len} tokens, fewer than one "
                f"micro-batch of {self.micro_batch} rows for each of {self.world_size} ranks"
                + (
                    f" (each of {self.effective_groups} reader groups packs its own)"
                    if self.effective_groups > 1
                    else ""
                )
                + "; lower seq_len or micro_batch"
            )

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the consumer is: global rows consumed in the epoch by all ranks together."""
        return {
            "epoch": self._epoch,
            "rows_consumed": self._rows,
            "seed": self.seed,
            "version": self.source.version,
            "window_parts": self._effective_window(),
            "reader_groups": self.reader_groups,
        }

    def _effective_window(self) -> int | None:
        """`window_parts`, or None for the global shuffle (one window): what the order depends on."""
        if self.window_parts is None or self.window_parts >= len(self.table.parts):
            return None
        return self.window_parts

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (any world size). Stops a running prefetch; the next `iter()` resumes."""
        if state.get("version") != self.source.version:
            raise StreamConfigError(
                f"the data state is from store version {state.get('version')}, "
                f"this stream reads {self.source.version}; resume on the same version"
            )
        if state.get("seed") != self.seed:
            raise StreamConfigError(
                f"the data state is from seed {state.get('seed')}, this stream has seed {self.seed}"
            )
        groups = int(state.get("reader_groups", 1))  # a state that records none was taken with one group
        if groups != self.reader_groups:
            if self.spec.reader_groups is not None:
                raise StreamConfigError(
                    f"the data state was taken with {groups} reader groups, this stream deals its parts to "
                    f"{self.reader_groups} (--reader-groups); resume with --reader-groups {groups} or without it"
                )
            self._set_groups(groups)  # not asked for: the run's own, whatever the world size now
            self._group_window = self._window_of_groups()
        if state.get("window_parts") != self._effective_window():
            show = lambda w: "one window (the global shuffle)" if w is None else f"windows of {w} parts"
            raise StreamConfigError(
                f"the data state was taken with {show(state.get('window_parts'))}, this stream "
                f"shuffles in {show(self._effective_window())} (its memory budget, "
                f"{format_bytes(self.memory_budget)}); resume with the same --memory-budget"
            )
        epoch, rows = int(state["epoch"]), int(state["rows_consumed"])
        if epoch < 0 or not 0 <= rows <= self.rows_per_epoch:
            raise StreamConfigError(
                f"the data state (epoch {epoch}, row {rows}) is outside this stream's "
                f"{self.rows_per_epoch} rows per epoch"
            )
        self._stop_worker()
        self._held.clear()  # the windows to hold follow from the restored position
        self._generation += 1  # an iterator from before the load must not move the restored position
        self._epoch, self._rows = epoch, rows

    # -- iteration -----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[PackedBatch]:
        self._warn_if_workers_overlap()
        self._stop_worker()
        self._generation += 1
        generation = self._generation
        batches = self._inline() if self.prefetch == 0 else self._prefetched()
        try:
            for batch, epoch, rows in batches:
                if generation != self._generation:  # superseded by a newer iter() or a load_state_dict
                    return
                self._epoch, self._rows = epoch, rows
                batch.data_state = self.state_dict()
                yield batch
            if self.split == "eval" and generation == self._generation:
                self._epoch, self._rows = 0, 0  # the pass is over: the next iter() is a full pass again
        finally:
            if generation == self._generation:
                self._stop_worker()

    def _schedule(self, epoch: int, rows: int) -> Iterator[tuple[int, int, int]]:
        """(epoch, first global row of the step, rows consumed after it); in a DataLoader worker, only
        its share of the steps (`_worker_slice`)."""
        block = self.world_size * self.micro_batch
        worker, workers = self._worker_slice()
        step = 0
        while True:
            if self.split == "eval":  # one pass; the last step may run past the end (padding rows)
                if rows >= self.rows_per_epoch:
                    return
            elif rows + block > self.rows_per_epoch:
                epoch, rows = epoch + 1, 0
                continue
            after = min(rows + block, self.rows_per_epoch)
            if step % workers == worker:
                yield epoch, rows, after
            rows = after
            step += 1

    def _inline(self) -> Iterator[tuple[PackedBatch, int, int]]:
        return self._batches(self._epoch, self._rows)

    def _batches(self, epoch: int, rows: int) -> Iterator[tuple[PackedBatch, int, int]]:
        for step_epoch, row0, after in self._schedule(epoch, rows):
            yield self._build(step_epoch, row0), step_epoch, after

    def _prefetched(self) -> Iterator[tuple[PackedBatch, int, int]]:
        ahead = read_ahead(self._batches(self._epoch, self._rows), depth=self.prefetch, name="logitstore-prefetch")
        self._worker = ahead  # `_stop_worker` closes it; a closed one yields nothing more
        while True:
            started = time.perf_counter()
            item = next(ahead, None)  # items are tuples: None is the end
            self.wait_seconds += time.perf_counter() - started
            if item is None:
                return
            yield item

    def _stop_worker(self) -> None:
        if self._worker is not None:
            self._worker.close()  # stops the thread and waits for the batch it is building
            self._worker = None

    def close(self) -> None:
        """Stop the prefetch thread and the readers, and drop the parts held. The stream can be iterated
        again afterwards (it reads again what it needs)."""
        self._stop_worker()
        if self._parts is not None:
            self._parts.close()
        self._held.clear()

    def __enter__(self) -> Stream:
        return self

    # -- DataLoader worker processes -------------------------------------------------------------------

    def __reduce__(self):
        # A stream crosses into a DataLoader worker (spawned: Icechunk must never be forked) as the recipe
        # it was made from, at its current position; the worker opens the version itself.
        if self._recipe is None:
            raise StreamConfigError(
                f"a stream of {self._where} cannot be sent to another process; only a "
                "store stream (logitstore.stream) can, for DataLoader workers"
            )
        return _stream_from_recipe, (self._recipe, self.state_dict())

    def _worker_slice(self) -> tuple[int, int]:
        """(this DataLoader worker, workers): worker w of W yields the steps w, w + W, ... counted from
        where the iteration starts, so a DataLoader (in order) yields the same batches as one process."""
        info = torch.utils.data.get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def _warn_if_workers_overlap(self) -> None:
        """In DataLoader worker 0 of several: say so when the workers will read the same parts (the
        reader groups are not a multiple of world size x micro_batch x workers), and what to pass."""
        worker, workers = self._worker_slice()
        needed = dataclasses.replace(self.spec, loader_workers=workers).default_reader_groups()
        if worker != 0 or workers == 1 or self.split != "train" or not self._reads or self.reader_groups % needed == 0:
            return
        warnings.warn(
            f"the {workers} DataLoader workers of each rank read most of its parts each (about {workers}x): "
            f"{self.reader_groups} reader groups are not a multiple of world size x micro_batch x workers "
            f"({needed}); pass loader_workers={workers} (or reader_groups={needed})",
            stacklevel=3,
        )

    def __exit__(self, *exc) -> None:
        self.close()

    # -- building a batch ------------------------------------------------------------------------------

    def _plan(self, epoch: int) -> EpochPlan:
        if epoch not in self._plans:
            if len(self._plans) >= 2:  # the current epoch and the next are all a stream needs
                self._plans.pop(min(self._plans))
            self._plans[epoch] = EpochPlan(
                self.table,
                seed=self.seed,
                epoch=epoch,
                seq_len=self.seq_len,
                window_parts=self._group_window,
                group_of_sample=self._group_of_sample,
                rows=self._packed_rows,
            )
        return self._plans[epoch]

    def _block(self, plan: EpochPlan, row0: int) -> Pieces:
        """This rank's micro-batch of the step starting at global row `row0`: the rank-th block of
        `micro_batch` rows of the step's rows laid out by reader group."""
        step = self.world_size * self.micro_batch
        return plan.block(row0, step, first=self.rank * self.micro_batch, count=self.micro_batch)

    def _build(self, epoch: int, row0: int) -> PackedBatch:
        plan = self._plan(epoch)
        pieces = self._block(plan, row0)
        parts = {}
        if self._parts is not None and len(pieces.row):  # no rows: past the end of the eval pass, padding
            self._read_ahead(epoch, plan, row0)
            parts = self._parts.get(np.unique(self.table.part[pieces.row]).tolist())
        batch = self.source.build(pieces, parts, stream=self)
        batch.segment_plan = plan_segments(batch.position_ids)  # here, on the stream's thread: not in the step
        return batch

    def _read_ahead(self, epoch: int, plan: EpochPlan, row0: int) -> None:
        """Ask for the parts this reader's micro-batches need, this one's and the next
        `LOOKAHEAD_BATCHES` of the epoch (in a DataLoader worker, only its own steps'), in the order they
        need them, so reads overlap decoding and a reader reads only the parts its own rows touch. In
        windows, each group's parts are held from the earliest window asked for and the next only
        (`_hold`), so what is read ahead stays within the budget; with one window everything read stays."""
        step = self.world_size * self.micro_batch
        _, workers = self._worker_slice()
        stop = min(row0 + (LOOKAHEAD_BATCHES + 1) * step * workers, self.rows_per_epoch)
        needs = [need for r in range(row0, stop, step * workers) for need in self._needs(epoch, plan, r)]
        if not needs:
            return
        part = np.concatenate([p for _, p, _ in needs])
        assert self._parts is not None  # a source with parts (`_build`)
        _, at = np.unique(part, return_index=True)
        part = part[np.sort(at)]  # each part once, in the order first needed
        if plan.windowed:
            part = self._hold(epoch, plan, [(g, int(w[0])) for g, _, w in needs if len(w)], wanted=part)
        self._parts.want(part.tolist())

    def _needs(self, epoch: int, plan: EpochPlan, row0: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(group, parts, windows) this reader's micro-batch of the step at `row0` needs (`GroupPlan.needs`),
        kept for the steps read ahead: each step is asked for by the `LOOKAHEAD_BATCHES` builds before it."""
        key = (epoch, row0)
        if key not in self._needs_of_step:
            for old in [k for k in self._needs_of_step if k < key]:  # steps built already
                del self._needs_of_step[old]
            step, first = self.world_size * self.micro_batch, self.rank * self.micro_batch
            self._needs_of_step[key] = [
                (g, *plan.groups[g].needs(j0, j0 + n))
                for g, j0, n, _ in plan.block_runs(row0, step, first=first, count=self.micro_batch)
            ]
        return self._needs_of_step[key]

    def _hold(self, epoch: int, plan: EpochPlan, windows: list[tuple[int, int]], *, wanted: np.ndarray) -> np.ndarray:
        """Hold each group's window (the earliest of `windows` asked for it) and its next; let go of the
        parts of windows before. In memory: two windows of each group this reader takes rows of, which
        the budget bounds (`group_window_parts`), and, while the budget has room, the parts of later
        windows that `wanted` (parts in the order needed) asks for first: a batch that crosses into the
        window after next then finds its part read, instead of waiting for a read begun only when the
        stream reached the window before (reading and decoding would take turns). Returns the
        parts of `wanted` held."""
        assert self._parts is not None and self._part_bytes is not None  # windows: a source with parts
        moved = False
        earliest: dict[int, int] = {}
        for g, window in windows:  # in the order needed: a group's first is its earliest
            earliest.setdefault(g, window)
        for g, window in earliest.items():
            if self._held.get(g, (-1, -1))[:2] == (epoch, window):  # held already
                continue
            group = plan.groups[g]
            after = group.parts_of_window(window + 1) if window + 1 < group.n_windows else np.zeros(0, np.int64)
            self._held[g] = (epoch, window, np.concatenate([group.parts_of_window(window), after]).tolist())
            moved = True
            if window + 2 < group.n_windows:  # the window after those: its manifests, not its bytes (the budget)
                self._parts.warm(group.parts_of_window(window + 2).tolist())
        held = {p for _, _, parts in self._held.values() for p in parts}
        room = self.memory_budget - int(self._part_bytes[sorted(held)].sum())
        ahead = wanted[~np.isin(wanted, list(held))]
        ahead = ahead[: int(np.searchsorted(np.cumsum(self._part_bytes[ahead]), room, side="right"))]
        if moved:
            self._parts.keep_only(held | set(ahead.tolist()))
        return wanted[np.isin(wanted, list(held)) | np.isin(wanted, ahead)]

    def unreadable(self, row: int, error: Exception, *, part: str | None = None) -> None:
        """A sample that cannot be used: raise, or (on_error="skip") count it and go on."""
        if isinstance(error, StorageError):  # an outage is never a damaged sample to skip
            raise error
        sample_id = self.table.sample_ids[row]
        if self.on_error == "skip":
            self.skipped_ids.add(sample_id)
            return
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        where = f" (part {part})" if part else ""
        raise DamagedDataError(
            f"cannot read sample {sample_id!r}{where} of {self._where}: {cause} (--on-error skip trains without it)"
        ) from error


# -- building streams ---------------------------------------------------------------------------------------


def store_stream(
    view: StoreVersion, spec: StreamSpec, *, sources: list | None = None, versions: list[WeightedVersion] | None = None
) -> Stream:
    """The stream of a store version: one teacher (`spec.teacher`, or the version's only one), several
    or cross-tokenizer teachers (`sources`, `logitstore/streaming/mixing.py`), or one teacher of a
    weighted mix of versions (`versions`, `logitstore/streaming/version_mix.py`; `view` is then unused)."""
    source = _source_of(view, spec, sources=sources, versions=versions)
    stream = Stream(source, spec)
    if sources is None and view.store.location.uri.split("://")[0] != "memory":
        mix = None if versions is None else [(w.view.snapshot_id, w.weight) for w in versions]
        stream._recipe = {"uri": view.store.location.uri, "snapshot": view.snapshot_id, "spec": stream.spec, "mix": mix}
    return stream


def _source_of(
    view: StoreVersion, spec: StreamSpec, *, sources: list | None, versions: list[WeightedVersion] | None
) -> Source:
    """The source type that reads what is asked for: several or cross teachers, several versions, or one of each."""
    split, eval_fraction, train_on = spec.split, spec.eval_fraction, spec.train_on
    if sources is not None and (len(sources) > 1 or sources[0].cross):
        if versions is not None:
            raise StreamConfigError(
                "--version-weight mixes the versions of one teacher with the student's tokenizer; "
                "leave out --teacher-weight and --student-tokenizer"
            )
        return MixedSource(view, sources=sources, split=split, eval_fraction=eval_fraction, train_on=train_on)
    teacher = sources[0].name if sources else spec.teacher
    if versions is not None and isinstance(mix_version(versions), dict):
        return VersionsSource(versions, teacher=teacher, split=split, eval_fraction=eval_fraction, train_on=train_on)
    if versions is not None:  # one version at weight 1: that version
        view = versions[0].view
    return StoreSource(view, teacher=teacher, split=split, eval_fraction=eval_fraction, train_on=train_on)


def _stream_from_recipe(recipe: dict, state: dict) -> Stream:
    """The stream `store_stream` made from `recipe`, at `state`: how a stream arrives in another process."""
    store = Store.open(recipe["uri"])
    mix = recipe.get("mix")
    versions = None if mix is None else [WeightedVersion(store.read(v), w) for v, w in mix]
    stream = store_stream(store.read(recipe["snapshot"]), recipe["spec"], versions=versions)
    stream.load_state_dict(state)
    return stream
