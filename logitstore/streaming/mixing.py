"""Several teachers, and teachers with another tokenizer than the student's, in one run.

A run's *sources* are the teachers it learns from, each with a weight (`--teacher-weight A=0.7`) and
the way its signal reaches the student's tokens:

- same tokenizer: the teacher saw exactly the student's tokens; its stored distribution at position t
  is the target at the student's position t (`SparseTargets`, the single-teacher loss);
- cross tokenizer: the build aligned the teacher's tokens with the student's (`--student-tokenizer`,
  `pipelines/align.py`); the signal goes through the alignment groups (`AlignedTargets`):
    1:1 group (teacher token t0 = student token s0, same bytes, same text before): the student's
        position s0 - 1 gets the teacher's position t0 - 1, its entries mapped to student ids
        through the store's exact vocabulary map (unmapped entries stay, with id -1, for the ULD term);
    any other group (1:n, n:1, n:m): a chain term on the probability of the group's bytes, the
        teacher's being the sum of its target log-probabilities over the group's tokens;
    a group at the start of a sample (nothing before it to predict from) gets no signal.

Rules (documented in docs/train.md):
- **The sample set** is the first source's (the first `--teacher-weight`, or the only teacher).
- **Missing samples.** A source that lacks a sample, or whose student-side tokens for it differ from
  the first source's (a long document windowed differently by teachers with other tokenizers), gives
  that sample nothing; the weights of the sources that do have it are renormalised to sum 1 for it.
- **Chains cut by a row boundary** (a packed row ends inside the group) are dropped and counted.
- Metrics: `signal_share` is the share of supervised student positions that received a term from at
  least one teacher; `exact_share` the share at 1:1 groups or from same-tokenizer teachers.

`MixedSource` is a source of the stream engine (`logitstore/streaming/stream.py`) with another way to build a
batch: each sample of the batch is decoded whole from every source's parts in memory (a sample cut
across two rows is decoded twice), turned into student-position signals with numpy, then cut into the
batch's pieces. Nothing loops per token or entry in Python; the loops are per piece and per source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from logitstore.errors import LogitstoreError
from logitstore.format.samples import SparseSamples
from logitstore.format.samples import ranges as _ranges
from logitstore.store.reader import PartReader, TeacherRows
from logitstore.store.version import StoreVersion
from logitstore.streaming.batch import BatchContext, PackedBatch, layout, sparse_targets_of
from logitstore.streaming.order import Pieces, SplitTable
from logitstore.streaming.spec import StreamSpec
from logitstore.streaming.targets import AlignedTargets
from logitstore.streaming.teacher_source import check_train_on, split_rows
from logitstore.text.chat import supervised_positions


class TeacherSourceError(LogitstoreError, ValueError):
    """A teacher weight or student tokenizer that does not fit the store; names the flag."""


@dataclass(eq=False)
class WeightedTeacher:
    """One teacher a run learns from: its weight in the mix and how its signal reaches the student's tokens."""

    name: str  # the teacher's name in the store
    weight: float
    student: str | None  # the teacher's student tokenizer the student uses; None: same tokenizer
    vocab_map: np.ndarray | None = None  # int32 [teacher vocab] -> student id or -1 (cross only)

    @property
    def cross(self) -> bool:
        return self.student is not None


@dataclass
class StudentVocabulary:
    """What the student's tokenizer is, as far as the store knows it."""

    tokenizer_hash: str
    vocab_size: int
    tokenizer_json: str | None  # saved with the final model; None: the teacher's (the store has it)


def student_vocabulary(
    view: StoreVersion, *, teachers: list[str], student_tokenizer: str | None, student_hash: str | None
) -> StudentVocabulary:
    """The student's tokenizer: its own (a model directory, `student_hash`), or for a fresh built-in
    student the store's `--student-tokenizer NAME`, or else the first teacher's."""
    if student_hash is not None:
        for name in teachers:
            meta = view.teachers[name]
            if meta.tokenizer_hash == student_hash:
                return StudentVocabulary(student_hash, meta.vocab_size, None)
            for st in meta.students:
                if st["tokenizer_hash"] == student_hash:
                    return _registered(view, name, st)
        raise TeacherSourceError(
            "--student: its tokenizer is neither a teacher's nor one of the store's student "
            f"tokenizers (teachers {', '.join(teachers)}); build with --student-tokenizer for it"
        )
    if student_tokenizer is None:
        meta = view.teachers[teachers[0]]
        return StudentVocabulary(meta.tokenizer_hash, meta.vocab_size, None)
    for name in teachers:
        for st in view.teachers[name].students:
            if st["name"] == student_tokenizer:
                return _registered(view, name, st)
    known = sorted({st["name"] for n in teachers for st in view.teachers[n].students})
    raise TeacherSourceError(
        f"--student-tokenizer {student_tokenizer!r}: no such student tokenizer in the store "
        f"(it has: {', '.join(known) or 'none'})"
    )


def _registered(view: StoreVersion, teacher: str, st: dict) -> StudentVocabulary:
    tokenizer_json = view.student_tokenizer_json(teacher, st["name"])
    return StudentVocabulary(st["tokenizer_hash"], int(st["vocab_size"]), tokenizer_json)


def resolve_sources(
    view: StoreVersion, *, weights: dict[str, float], vocab: StudentVocabulary
) -> list[WeightedTeacher]:
    """One `WeightedTeacher` per teacher of `weights`, or a clear error naming the teacher that cannot teach this student."""
    sources = []
    for name, weight in weights.items():
        view.teacher_name(name)  # refuses an unknown teacher with the list of known ones
        meta = view.teachers[name]
        if meta.tokenizer_hash == vocab.tokenizer_hash:
            sources.append(WeightedTeacher(name, weight, None))
            continue
        match = [st["name"] for st in meta.students if st["tokenizer_hash"] == vocab.tokenizer_hash]
        if not match:
            raise TeacherSourceError(
                f"teacher {name!r} has another tokenizer than the student and no alignment to it (its student "
                f"tokenizers: {', '.join(meta.student_names) or 'none'}); build with --student-tokenizer"
            )
        if meta.sampled:
            raise TeacherSourceError(
                f"teacher {name!r} is a sampled store: cross-tokenizer distillation needs "
                "top-k or top-p entries (their probabilities, not draw counts)"
            )
        sources.append(
            WeightedTeacher(name, weight, match[0], vocab_map=view.vocab_map(name, match[0]).astype(np.int64))
        )
    return sources


# -- the source of several teachers ------------------------------------------------------------------------


@dataclass
class _SourceTable:
    """A source's split rows matched to the first source's rows (-1 where it lacks the sample)."""

    rows: TeacherRows  # with the student's token columns for a cross source
    row_of: np.ndarray  # [n primary rows] -> row in `rows`, or -1


class MixedSource:
    """Several sources for the stream engine (`logitstore/streaming/stream.py`); same contract (order, packing,
    sharding, resume), with lengths in the student's tokens and `PackedBatch.signals` instead of the
    single-teacher targets. A *part* here is a part of the first source; reading it reads, for every
    source, the parts of its own that hold those samples (one each when the teachers were built from
    the same data, as `build --teacher A --teacher B` does), and a cross source's student arrays."""

    def __init__(
        self,
        view: StoreVersion,
        *,
        sources: list[WeightedTeacher],
        split: str,
        eval_fraction: float,
        train_on: str = StreamSpec.train_on,
    ):
        assert sources, "at least one source"
        self.view, self.sources, self.version = view, sources, view.snapshot_id
        for source in sources:
            check_train_on(view, teacher=source.name, train_on=train_on)
        # Chat data: the first source's loss mask (on the student's side) picks the supervised positions.
        self.completion_only = train_on == "completion" and view.teachers[sources[0].name].loss_mask is not None
        primary = split_rows(view, teacher=sources[0].name, split=split, eval_fraction=eval_fraction)
        self._tables = [
            _source_table(view, s, split=split, eval_fraction=eval_fraction, primary_ids=primary.sample_ids)
            for s in sources
        ]
        # Pack by the student-side lengths of the first source's samples.
        first = self._tables[0].rows.students
        lengths = first["n_student_tokens"] if first is not None else primary.n_tokens
        self.table = SplitTable(sample_ids=primary.sample_ids, n_tokens=lengths, part=primary.part, parts=primary.parts)
        self._primary = primary
        self._readers = [
            PartReader(view, teacher=s.name, rows=t.rows, student=s.student) for s, t in zip(sources, self._tables)
        ]
        self.where = f"the {split} split of teachers {', '.join(s.name for s in sources)} in version {view.snapshot_id}"

    def _own_parts(self, i: int, code: int) -> list[int]:
        """The parts of source i holding the samples of the first source's part `code`."""
        own = self._tables[i].row_of[self._primary.in_part(code)]
        return np.unique(self._tables[i].rows.part[own[own >= 0]]).tolist()

    def part_bytes(self) -> np.ndarray:
        out = np.zeros(len(self.table.parts), dtype=np.int64)
        for code in range(len(out)):  # one step per part, at start
            for i, reader in enumerate(self._readers):
                out[code] += int(reader.bytes[self._own_parts(i, code)].sum()) * (2 if self.sources[i].cross else 1)
        return out  # a cross source's student ids and groups counted as much again: a generous bound

    def read_part(self, code: int) -> list[dict]:
        """Per source, {own part: PartData} (with a cross source's student tokens)."""
        return [{c: reader.read(c) for c in self._own_parts(i, code)} for i, reader in enumerate(self._readers)]

    def warm_part(self, code: int) -> None:
        """Warm what `read_part(code)` will read: each source's own parts (`PartReader.warm`)."""
        for i, reader in enumerate(self._readers):
            for c in self._own_parts(i, code):
                reader.warm(c)

    # -- a batch -----------------------------------------------------------------------------------

    def build(self, pieces: Pieces, parts: dict[int, list], *, stream: BatchContext) -> PackedBatch:
        rows = np.unique(pieces.row)
        per_source = []
        for i in range(len(self.sources)):
            loaded = {}
            for by_source in parts.values():
                loaded.update(by_source[i])
            decoded, errors = self._read_source(i, rows, loaded)
            for r, error in errors.items():
                stream.unreadable(r, error)  # raises, or (on_error="skip") counts the sample as skipped
            per_source.append(decoded)
        primary = per_source[0]
        ok = np.array([r in primary.index for r in pieces.row.tolist()], dtype=bool)
        for later in per_source[1:]:  # the student's tokens must be the same, or the source lacks the sample
            for r in list(later.index):
                if r not in primary.index or not np.array_equal(later.tokens(r), primary.tokens(r)):
                    del later.index[r]
        return self._assemble(pieces, ok, per_source, micro_batch=stream.micro_batch, seq_len=stream.seq_len)

    def _read_source(self, i: int, rows: np.ndarray, loaded: dict) -> tuple[_Decoded, dict]:
        """(the rows this source has and could read, decoded whole; {primary row: exception} for those it
        has but could not read)."""
        source, st, reader = self.sources[i], self._tables[i], self._readers[i]
        own = st.row_of[rows]
        have = own >= 0
        damage = reader.damage(loaded, own[have])
        errors = {int(r): d for r, d in zip(rows[have].tolist(), damage) if d is not None}
        good = np.array([d is None for d in damage], dtype=bool)
        primary_rows, own_rows = rows[have][good], own[have][good]
        samples = reader.samples(loaded, own_rows, np.zeros(len(own_rows), np.int64), st.rows.n_tokens[own_rows])
        decoded = _Decoded(samples, index={int(r): k for k, r in enumerate(primary_rows.tolist())}, cross=source.cross)
        if source.cross:
            assert source.vocab_map is not None  # resolve_sources maps every cross source's vocabulary
            vmap = source.vocab_map
            ids = samples.entry_ids.astype(np.int64)
            samples.entry_ids = np.where(ids < len(vmap), vmap[np.minimum(ids, len(vmap) - 1)], -1)
            for k, (r, (student_ids, groups, *mask)) in enumerate(
                zip(primary_rows.tolist(), reader.student_tokens(loaded, own_rows))
            ):  # one step per sample
                t0, t1 = samples.position_offsets[k : k + 2]
                alignment = Alignment.of(groups, samples.target_logprobs[t0:t1])
                decoded.student[int(r)] = (student_ids, alignment, mask[0] if mask else None)
        return decoded, errors

    def _assemble(
        self, pieces: Pieces, ok: np.ndarray, per_source: list[_Decoded], *, micro_batch: int, seq_len: int
    ) -> PackedBatch:
        B, L = micro_batch, seq_len
        lay = layout(pieces, ok, micro_batch=B, seq_len=L)
        flat, n, tokens, positions = lay.flat, lay.n, lay.tokens, lay.positions
        input_ids = np.zeros(B * L, dtype=np.int64)
        rows, starts = pieces.row[ok], pieces.a[ok]
        primary = per_source[0]
        if len(rows):
            input_ids[tokens] = np.concatenate([primary.tokens(int(r))[a : a + m] for r, a, m in zip(rows, starts, n)])
        first_position = np.concatenate([[0], np.cumsum(n - 1)])[:-1]
        target_ids = input_ids[positions + 1]
        # Weights renormalised per sample over the sources that have it.
        present = np.array([[int(r) in src.index for r in rows] for src in per_source], dtype=bool).reshape(
            len(per_source), -1
        )
        w = np.array([s.weight for s in self.sources])[:, None] * present
        w = w / np.maximum(w.sum(axis=0, keepdims=True), 1e-30)
        signals, coverage, chains_cut = [], [], 0
        for i, (source, src) in enumerate(zip(self.sources, per_source)):
            sel = np.flatnonzero(present[i])  # the pieces whose sample this source has
            at = _ranges(first_position[sel], n[sel] - 1)  # their positions in the batch
            weight = np.zeros(len(positions), np.float32)
            weight[at] = np.repeat(w[i, sel], n[sel] - 1)
            if source.cross:
                targets, cov, exact, cut = _aligned_targets(
                    src,
                    rows,
                    sel,
                    starts=starts,
                    n=n,
                    first_position=first_position,
                    weight=weight,
                    target_ids=target_ids,
                )
                chains_cut += cut
            else:
                which = np.array([src.index[int(r)] for r in rows[sel]], dtype=np.int64)
                fragments = src.samples.cut(which, starts[sel], starts[sel] + n[sel])
                # Entries as probabilities, never as draws: a mix leaves a sampled teacher's counts out
                # (whether they should count in a mix is an open question).
                fragments.entry_counts = None
                targets = sparse_targets_of(fragments, target_ids=target_ids, at=at, weight=weight)
                cov = np.zeros(len(positions), bool)
                cov[at] = True
                cov &= weight > 0
                exact = cov
            signals.append((source.name, targets))
            coverage.append((cov, exact))
        if self.completion_only and len(rows):  # chat data: the positions whose next token is completion
            mask = np.concatenate([primary.loss_mask(int(r))[a : a + m] for r, a, m in zip(rows, starts, n)])
            keep = supervised_positions(mask, n)
            signals = [(name, targets.restrict(torch.from_numpy(keep))) for name, targets in signals]
            positions, coverage = positions[keep], [(cov[keep], exact[keep]) for cov, exact in coverage]
        counts = {"positions": len(positions), "chains_cut": chains_cut}
        covered, exact_covered = np.zeros(len(positions), bool), np.zeros(len(positions), bool)
        for (name, _), (cov, exact) in zip(signals, coverage):
            covered |= cov
            exact_covered |= exact
            counts[f"signal_positions/{name}"] = int(cov.sum())
        counts["signal_positions"] = int(covered.sum())
        counts["exact_positions"] = int(exact_covered.sum())
        return PackedBatch(
            input_ids=torch.from_numpy(input_ids.reshape(B, L)),
            position_ids=torch.from_numpy(lay.position_ids.reshape(B, L)),
            document_ids=torch.from_numpy(lay.document_ids.reshape(B, L)),
            positions=torch.from_numpy(positions),
            target_ids=torch.from_numpy(input_ids[positions + 1]),
            signals=signals,
            n_tokens=int(n.sum()),
            segments=[(self.table.sample_ids[r], int(a), int(f), int(m)) for r, a, f, m in zip(rows, starts, flat, n)],
            signal_counts=counts,
        )


@dataclass
class Alignment:
    """A cross source's sample on the student's positions: its 1:1 groups as (student position, teacher
    position) pairs, and its other groups as chains, student position ranges [c0, c1) with the teacher's
    log-probability of the group's bytes. A group at the start of a sample (nothing before it) has none."""

    exact_s: np.ndarray
    exact_t: np.ndarray
    chain_s0: np.ndarray
    chain_s1: np.ndarray
    chain_logprob: np.ndarray

    @classmethod
    def of(cls, groups: np.ndarray, target_logprobs: np.ndarray) -> Alignment:
        """From the sample's alignment groups [g, 4] (t0, t1, s0, s1) and its teacher target log-probabilities."""
        t0, t1, s0, s1 = (groups[:, k] for k in range(4))
        usable = (t0 >= 1) & (s0 >= 1) & (t1 > t0) & (s1 > s0)  # a group with text before it on both sides
        one = usable & (t1 - t0 == 1) & (s1 - s0 == 1)
        chain = usable & ~one
        # Teacher log-probability of a chain: targets of positions t0-1 .. t1-2, by a prefix sum.
        prefix = np.concatenate([[0.0], np.cumsum(target_logprobs.astype(np.float64))])
        return cls(
            exact_s=s0[one] - 1,
            exact_t=t0[one] - 1,
            chain_s0=s0[chain] - 1,
            chain_s1=s1[chain] - 1,
            chain_logprob=(prefix[t1[chain] - 1] - prefix[t0[chain] - 1]).astype(np.float32),
        )


@dataclass
class _Decoded:
    """One source's samples of a batch, decoded whole (a cross source's entry ids mapped to the student's,
    -1 where none), and by primary row: its sample there and, for a cross source, the student's side."""

    samples: SparseSamples
    index: dict[int, int]  # primary row -> its sample in `samples`
    cross: bool = False
    student: dict[int, tuple] = field(default_factory=dict)  # cross: primary row -> (ids, Alignment, loss mask)

    def tokens(self, row: int) -> np.ndarray:
        """The sample's student-side tokens: the teacher's own, or (cross) the student's ids."""
        if self.cross:
            return self.student[row][0]
        t0, t1 = self.samples.token_offsets[self.index[row] : self.index[row] + 2]
        return self.samples.input_ids[t0:t1]

    def loss_mask(self, row: int) -> np.ndarray:
        """Chat data: per student-side token, 1 in the completion."""
        if self.cross:
            return self.student[row][2]
        assert self.samples.loss_mask is not None  # chat data
        t0, t1 = self.samples.token_offsets[self.index[row] : self.index[row] + 2]
        return self.samples.loss_mask[t0:t1]


def _aligned_targets(src: _Decoded, rows, sel, *, starts, n, first_position, weight, target_ids):
    P = len(target_ids)
    samples = src.samples
    exact_pos, teacher_pos, chain_lp, chain_pos, chain_group = [], [], [], [], []
    covered, exact_cov = np.zeros(P, bool), np.zeros(P, bool)
    n_chain = cut = 0
    for k in sel.tolist():  # one step per piece
        r = int(rows[k])
        al: Alignment = src.student[r][1]
        a, m, p0 = int(starts[k]), int(n[k]), int(first_position[k])
        lo, hi = a, a + m - 1  # the piece's student positions [lo, hi)
        keep = (al.exact_s >= lo) & (al.exact_s < hi)
        exact_pos.append(p0 + al.exact_s[keep] - lo)
        teacher_pos.append(samples.position_offsets[src.index[r]] + al.exact_t[keep])  # in `samples`
        inside = (al.chain_s0 >= lo) & (al.chain_s1 <= hi)
        touches = (al.chain_s1 > lo) & (al.chain_s0 < hi)
        cut += int((touches & ~inside).sum())
        c0, c1 = al.chain_s0[inside], al.chain_s1[inside]
        chain_lp.append(al.chain_logprob[inside])
        chain_pos.append(p0 + _ranges(c0 - lo, c1 - c0))
        chain_group.append(np.repeat(np.arange(n_chain, n_chain + len(c0)), c1 - c0))
        n_chain += len(c0)
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)
    exact_pos_a, chain_pos_a, t = cat(exact_pos, np.int64), cat(chain_pos, np.int64), cat(teacher_pos, np.int64)
    counts = samples.n_entries[t].astype(np.int64)
    entries = _ranges(samples.entry_offsets[t], counts)
    exact_cov[exact_pos_a] = True
    covered[exact_pos_a] = True
    covered[chain_pos_a] = True
    tensor = lambda x: torch.from_numpy(x)
    targets = AlignedTargets(
        target_ids=tensor(target_ids),
        exact_pos=tensor(exact_pos_a),
        entry_ids=tensor(samples.entry_ids[entries].astype(np.int64)),
        entry_logprobs=tensor(samples.entry_logprobs[entries].astype(np.float32)),
        entry_pos=tensor(np.repeat(np.arange(len(t), dtype=np.int64), counts)),
        tail=tensor(samples.tail[t].astype(np.float32)),
        chain_teacher_logprob=tensor(cat(chain_lp, np.float32)),
        chain_pos=tensor(chain_pos_a),
        chain_group=tensor(cat(chain_group, np.int64)),
        weight=tensor(weight),
    )
    has_weight = weight > 0
    return targets, covered & has_weight, exact_cov & has_weight, cut


def _source_table(
    view: StoreVersion, source: WeightedTeacher, *, split: str, eval_fraction: float, primary_ids: list[str]
) -> _SourceTable:
    rows = split_rows(view, teacher=source.name, split=split, eval_fraction=eval_fraction, student=source.student)
    return _SourceTable(rows=rows, row_of=match_rows(primary_ids, rows.sample_ids))


def match_rows(primary_ids: list[str], ids: list[str]) -> np.ndarray:
    """[len(primary_ids)] row of each primary sample id in `ids`, or -1."""
    where = {sid: i for i, sid in enumerate(ids)}
    return np.array([where.get(sid, -1) for sid in primary_ids], dtype=np.int64)
