"""Several teachers, and teachers with another tokenizer than the student's, in one run.

A run's *sources* are the teachers it learns from, each with a weight (`--teacher-weight A=0.7`) and
the way its signal reaches the student's tokens:

- same tokenizer: the teacher saw exactly the student's tokens; its stored distribution at position t
  is the target at the student's position t (`SparseTargets`, the single-teacher loss);
- cross tokenizer: the build aligned the teacher's tokens with the student's (`--student-tokenizer`,
  `logitstore/align.py`); the signal goes through the alignment groups (`AlignedTargets`):
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

`MixedSource` is a source of the stream engine (`trainer/stream.py`) with another way to build a
batch: each sample of the batch is decoded whole from every source's parts in memory (a sample cut
across two rows is decoded twice), turned into student-position signals with numpy, then cut into the
batch's pieces. Nothing loops per token or entry in Python; the loops are per piece and per source.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
import torch

from logitstore import codec
from logitstore.chat import supervised_positions
from logitstore.errors import DamagedDataError, LogitstoreError
from logitstore.meta import array_at, read_values
from logitstore.store import StoreVersion, read_errors
from logitstore.trainer.aligned_losses import AlignedTargets
from logitstore.trainer.losses import SparseTargets
from logitstore.trainer.stream import (
    PackedBatch,
    PartReader,
    Pieces,
    SplitTable,
    TeacherRows,
    check_train_on,
    layout,
    split_index,
)
from logitstore.trainer.stream import ranges as _ranges


class TeacherSourceError(LogitstoreError, ValueError):
    """A teacher weight or student tokenizer that does not fit the store; names the flag."""


@dataclass(eq=False)
class Source:
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
    data = read_values(array_at(view.student_group(teacher, st["name"]), "tokenizer"))
    return StudentVocabulary(st["tokenizer_hash"], int(st["vocab_size"]), bytes(data).decode("utf-8"))


def resolve_sources(view: StoreVersion, *, weights: dict[str, float], vocab: StudentVocabulary) -> list[Source]:
    """One `Source` per weighted teacher, or a clear error naming the teacher that cannot teach this student."""
    sources = []
    for name, weight in weights.items():
        view.teacher_name(name)  # refuses an unknown teacher with the list of known ones
        meta = view.teachers[name]
        if meta.tokenizer_hash == vocab.tokenizer_hash:
            sources.append(Source(name, weight, None))
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
        sources.append(Source(name, weight, match[0], vocab_map=view.vocab_map(name, match[0]).astype(np.int64)))
    return sources


# -- the source of several teachers ------------------------------------------------------------------------


@dataclass
class _SourceTable:
    """A source's split rows matched to the first source's rows (-1 where it lacks the sample)."""

    rows: TeacherRows
    row_of: np.ndarray  # [n primary rows] -> row in `rows`, or -1
    students: dict[str, np.ndarray] | None  # student_start / n_student_tokens / group_start / n_groups

    def student_columns(self) -> dict[str, np.ndarray]:
        """`students`, which a cross source's table has."""
        assert self.students is not None, "a cross source's table"
        return self.students


class MixedSource:
    """Several sources for the stream engine (`trainer/stream.py`); same contract (order, packing,
    sharding, resume), with lengths in the student's tokens and `PackedBatch.signals` instead of the
    single-teacher targets. A *part* here is a part of the first source; reading it reads, for every
    source, the parts of its own that hold those samples (one each when the teachers were built from
    the same data, as `build --teacher A --teacher B` does), and a cross source's student arrays."""

    def __init__(
        self,
        view: StoreVersion,
        *,
        sources: list[Source],
        split: str,
        eval_fraction: float,
        train_on: str = "completion",
    ):
        assert sources, "at least one source"
        self.view, self.sources, self.version = view, sources, view.snapshot_id
        for source in sources:
            check_train_on(view, teacher=source.name, train_on=train_on)
        # Chat data: the first source's loss mask (on the student's side) picks the supervised positions.
        self.completion_only = train_on == "completion" and view.teachers[sources[0].name].loss_mask is not None
        primary = TeacherRows.of(view, teacher=sources[0].name, split=split, eval_fraction=eval_fraction)
        self._tables = [
            _source_table(view, s, split=split, eval_fraction=eval_fraction, primary_ids=primary.sample_ids)
            for s in sources
        ]
        # Pack by the student-side lengths of the first source's samples.
        lengths = self._tables[0].student_columns()["n_student_tokens"] if sources[0].cross else primary.n_tokens
        self.table = SplitTable(sample_ids=primary.sample_ids, n_tokens=lengths, part=primary.part, parts=primary.parts)
        self._primary = primary
        self._readers = [PartReader(view, teacher=s.name, rows=t.rows) for s, t in zip(sources, self._tables)]
        self._decoders = [(view.teachers[s.name].codec, view.id_of_code(s.name).astype(np.int32)) for s in sources]
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

    def read_part(self, code: int) -> list[tuple[dict, dict]]:
        """Per source: ({own part: PartData}, {own part: (student ids, groups)} for a cross source)."""
        out = []
        for i, (source, reader) in enumerate(zip(self.sources, self._readers)):
            own = self._own_parts(i, code)
            students = {c: self._student_arrays(i, c) for c in own} if source.cross else {}
            out.append(({c: reader.read(c) for c in own}, students))
        return out

    def _student_arrays(self, i: int, code: int) -> tuple:
        """(ids, groups), and the loss mask for chat data, of a part's student tokens."""
        source = self.sources[i]
        base = f"teachers/{source.name}/parts/{self._tables[i].rows.parts[code]}/students/{source.student}"
        names = ("ids", "groups", "loss_mask") if self.view.teachers[source.name].loss_mask else ("ids", "groups")
        with read_errors(f"the student tokens in {base}"):  # damage stops the run too; no per-sample skip here
            return tuple(read_values(array_at(self.view.root, f"{base}/{name}")) for name in names)

    # -- a batch -----------------------------------------------------------------------------------

    def build(self, pieces: Pieces, parts: dict[int, list], *, stream) -> PackedBatch:
        rows = np.unique(pieces.row)
        per_source = []
        for i in range(len(self.sources)):
            loaded, students = {}, {}
            for by_source in parts.values():
                loaded.update(by_source[i][0])
                students.update(by_source[i][1])
            signals, errors = self._read_source(i, rows, loaded, students)
            for r, error in errors.items():
                stream.unreadable(r, error)  # raises, or (on_error="skip") counts the sample as skipped
            per_source.append(signals)
        primary = per_source[0]
        ok = np.array([r in primary for r in pieces.row.tolist()], dtype=bool)
        for later in per_source[1:]:  # the student's tokens must be the same, or the source lacks the sample
            for r in list(later):
                if r not in primary or not np.array_equal(later[r].tokens, primary[r].tokens):
                    del later[r]
        return self._assemble(pieces, ok, per_source, micro_batch=stream.micro_batch, seq_len=stream.seq_len)

    def _read_source(self, i: int, rows: np.ndarray, loaded: dict, students: dict) -> tuple[dict, dict]:
        """({primary row: _SampleSignal} for the rows this source has and could read,
        {primary row: exception} for those it has but could not read)."""
        source, st, reader = self.sources[i], self._tables[i], self._readers[i]
        own = st.row_of[rows]
        have = own >= 0
        errors: dict = {}
        good = []
        for primary_row, own_row in zip(rows[have].tolist(), own[have].tolist()):  # one step per sample
            damage = loaded[int(st.rows.part[own_row])].damaged.get(own_row)
            if damage is None:
                good.append((primary_row, own_row))
            else:
                errors[primary_row] = damage
        if not good:
            return {}, errors
        primary_rows = np.array([p for p, _ in good], dtype=np.int64)
        own_rows = np.array([o for _, o in good], dtype=np.int64)
        n_tokens = st.rows.n_tokens[own_rows]
        params, id_of_code = self._decoders[i]
        enc = reader.gather(loaded, own_rows, np.zeros(len(own_rows), np.int64), n_tokens)
        decoded = codec.decode(enc, params=params, id_of_code=id_of_code, n_tokens=n_tokens)
        aligned = self._students(i, own_rows, students) if source.cross else None
        tok_off, pos_off = decoded.token_offsets, decoded.position_offsets
        ent_off = np.concatenate([[0], np.cumsum(decoded.n_entries, dtype=np.int64)])
        out: dict = {}
        for k in range(len(own_rows)):  # one step per sample: slicing only
            p0, p1 = pos_off[k], pos_off[k + 1]
            signal = _SampleSignal(
                tokens=decoded.input_ids[tok_off[k] : tok_off[k + 1]],
                n_entries=decoded.n_entries[p0:p1].astype(np.int64),
                entry_ids=decoded.entry_ids[ent_off[p0] : ent_off[p1]].astype(np.int64),
                entry_logprobs=decoded.entry_logprobs[ent_off[p0] : ent_off[p1]],
                tail=decoded.tail[p0:p1],
                target_logprobs=decoded.target_logprobs[p0:p1],
                loss_mask=None if decoded.loss_mask is None else decoded.loss_mask[tok_off[k] : tok_off[k + 1]],
            )
            if aligned is not None:
                assert source.vocab_map is not None  # resolve_sources maps every cross source's vocabulary
                ids, groups, *mask = aligned[k]
                signal = signal.through(
                    groups, student_ids=ids, vocab_map=source.vocab_map, loss_mask=mask[0] if mask else None
                )
            out[int(primary_rows[k])] = signal
        return out, errors

    def _students(self, i: int, own_rows: np.ndarray, students: dict) -> list[tuple]:
        """Student ids and groups [g, 4] of each row (and its loss mask, chat data), from its part's arrays."""
        st = self._tables[i]
        cols = st.student_columns()
        out = []
        for row in own_rows.tolist():  # one step per sample: slicing only
            ids, groups, *mask = students[int(st.rows.part[row])]
            s0, n = cols["student_start"][row], cols["n_student_tokens"][row]
            g0, g = cols["group_start"][row], cols["n_groups"][row]
            if s0 + n > len(ids) or 4 * (g0 + g) > len(groups) or any(len(m) != len(ids) for m in mask):
                raise DamagedDataError(
                    f"the student tokens of sample {st.rows.sample_ids[row]!r} lie outside the stored arrays"
                )
            out.append(
                (
                    ids[s0 : s0 + n].astype(np.int64),
                    groups[4 * g0 : 4 * (g0 + g)].astype(np.int64).reshape(-1, 4),
                    *(m[s0 : s0 + n] for m in mask),
                )
            )
        return out

    def _assemble(
        self, pieces: Pieces, ok: np.ndarray, per_source: list[dict], *, micro_batch: int, seq_len: int
    ) -> PackedBatch:
        B, L = micro_batch, seq_len
        lay = layout(pieces, ok, micro_batch=B, seq_len=L)
        flat, n, tokens, positions = lay.flat, lay.n, lay.tokens, lay.positions
        input_ids = np.zeros(B * L, dtype=np.int64)
        rows, starts = pieces.row[ok], pieces.a[ok]
        primary = per_source[0]
        if len(rows):
            input_ids[tokens] = np.concatenate([primary[int(r)].tokens[a : a + m] for r, a, m in zip(rows, starts, n)])
        first_position = np.concatenate([[0], np.cumsum(n - 1)])[:-1]
        # Weights renormalised per sample over the sources that have it.
        present = np.array([[int(r) in src for r in rows] for src in per_source], dtype=bool).reshape(
            len(per_source), -1
        )
        w = np.array([s.weight for s in self.sources])[:, None] * present
        w = w / np.maximum(w.sum(axis=0, keepdims=True), 1e-30)
        signals, coverage, chains_cut = [], [], 0
        for i, (source, src) in enumerate(zip(self.sources, per_source)):
            pieces_i = [(k, src[int(r)]) for k, r in enumerate(rows) if present[i, k]]
            weight = np.zeros(len(positions), np.float32)
            for k, _ in pieces_i:
                weight[first_position[k] : first_position[k] + n[k] - 1] = w[i, k]
            if source.cross:
                targets, cov, exact, cut = _aligned_targets(
                    pieces_i,
                    starts=starts,
                    n=n,
                    first_position=first_position,
                    weight=weight,
                    target_ids=input_ids[positions + 1],
                )
                chains_cut += cut
            else:
                targets, cov = _same_targets(
                    pieces_i,
                    starts=starts,
                    n=n,
                    first_position=first_position,
                    weight=weight,
                    target_ids=input_ids[positions + 1],
                    P=len(positions),
                )
                exact = cov
            signals.append((source.name, targets))
            coverage.append((cov, exact))
        if self.completion_only and len(rows):  # chat data: the positions whose next token is completion
            mask = np.concatenate([primary[int(r)].loss_mask[a : a + m] for r, a, m in zip(rows, starts, n)])
            keep = supervised_positions(mask, n)
            signals = [(name, targets.only(torch.from_numpy(keep))) for name, targets in signals]
            positions, coverage = positions[keep], [(cov[keep], exact[keep]) for cov, exact in coverage]
        counts = {"positions": len(positions), "chains_cut": chains_cut}
        covered, exact_covered = np.zeros(len(positions), bool), np.zeros(len(positions), bool)
        for (name, _), (cov, exact) in zip(signals, coverage):
            covered |= cov
            exact_covered |= exact
            counts[f"signal_positions/{name}"] = int(cov.sum())
        counts["signal_positions"] = int(covered.sum())
        counts["exact_positions"] = int(exact_covered.sum())
        empty_long, empty_float = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32)
        return PackedBatch(
            input_ids=torch.from_numpy(input_ids.reshape(B, L)),
            position_ids=torch.from_numpy(lay.position_ids.reshape(B, L)),
            document_ids=torch.from_numpy(lay.document_ids.reshape(B, L)),
            positions=torch.from_numpy(positions),
            entry_ids=empty_long,
            entry_logprobs=empty_float,
            entry_pos=empty_long,
            tail=empty_float,
            target_ids=torch.from_numpy(input_ids[positions + 1]),
            target_logprobs=empty_float,
            entry_counts=None,
            n_tokens=int(n.sum()),
            segments=[(self.table.sample_ids[r], int(a), int(f), int(m)) for r, a, f, m in zip(rows, starts, flat, n)],
            signals=signals,
            signal_counts=counts,
        )


@dataclass
class _SampleSignal:
    """One source's decoded sample. For a cross source, `through` re-expresses it on student positions."""

    tokens: np.ndarray  # the student-side tokens: the teacher's own, or (cross) the student's ids
    n_entries: np.ndarray
    entry_ids: np.ndarray
    entry_logprobs: np.ndarray
    tail: np.ndarray
    target_logprobs: np.ndarray
    # cross only: 1:1 groups as (student position, teacher position); chains as student position
    # ranges [c0, c1) with the teacher's log-probability of the group's bytes
    exact_s: np.ndarray | None = None
    exact_t: np.ndarray | None = None
    chain_s0: np.ndarray | None = None
    chain_s1: np.ndarray | None = None
    chain_logprob: np.ndarray | None = None
    loss_mask: np.ndarray | None = None  # chat data: per student-side token, 1 in the completion

    def through(
        self, groups: np.ndarray, *, student_ids: np.ndarray, vocab_map: np.ndarray, loss_mask: np.ndarray | None = None
    ) -> _SampleSignal:
        t0, t1, s0, s1 = (groups[:, k] for k in range(4))
        usable = (t0 >= 1) & (s0 >= 1) & (t1 > t0) & (s1 > s0)  # a group with text before it on both sides
        one = usable & (t1 - t0 == 1) & (s1 - s0 == 1)
        chain = usable & ~one
        # Teacher log-probability of a chain: targets of positions t0-1 .. t1-2, by a prefix sum.
        prefix = np.concatenate([[0.0], np.cumsum(self.target_logprobs.astype(np.float64))])
        mapped = np.where(
            self.entry_ids < len(vocab_map), vocab_map[np.minimum(self.entry_ids, len(vocab_map) - 1)], -1
        )
        return _SampleSignal(
            tokens=student_ids,
            n_entries=self.n_entries,
            entry_ids=mapped,
            entry_logprobs=self.entry_logprobs,
            tail=self.tail,
            target_logprobs=self.target_logprobs,
            exact_s=s0[one] - 1,
            exact_t=t0[one] - 1,
            chain_s0=s0[chain] - 1,
            chain_s1=s1[chain] - 1,
            chain_logprob=(prefix[t1[chain] - 1] - prefix[t0[chain] - 1]).astype(np.float32),
            loss_mask=loss_mask,
        )


def _entries_of(sig: _SampleSignal, teacher_positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(entry ids, log-probs, per-position counts) of the given teacher positions, in their order."""
    offsets = np.concatenate([[0], np.cumsum(sig.n_entries)])
    counts = sig.n_entries[teacher_positions]
    idx = _ranges(offsets[teacher_positions], counts)
    return sig.entry_ids[idx], sig.entry_logprobs[idx], counts


def _same_targets(pieces, *, starts, n, first_position, weight, target_ids, P):
    ids, lps, pos, tail, target_lp = [], [], [], np.ones(P, np.float32), np.zeros(P, np.float32)
    covered = np.zeros(P, bool)
    for k, sig in pieces:
        a, m, p0 = int(starts[k]), int(n[k]), int(first_position[k])
        teacher_positions = np.arange(a, a + m - 1)
        e_ids, e_lps, counts = _entries_of(sig, teacher_positions)
        ids.append(e_ids)
        lps.append(e_lps)
        pos.append(np.repeat(np.arange(p0, p0 + m - 1), counts))
        tail[p0 : p0 + m - 1] = sig.tail[teacher_positions]
        target_lp[p0 : p0 + m - 1] = sig.target_logprobs[teacher_positions]
        covered[p0 : p0 + m - 1] = True
    cat = lambda xs, dt: torch.from_numpy(np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))
    targets = SparseTargets(
        entry_ids=cat(ids, np.int64),
        entry_logprobs=cat(lps, np.float32),
        entry_pos=cat(pos, np.int64),
        tail=torch.from_numpy(tail),
        target_ids=torch.from_numpy(target_ids),
        target_logprobs=torch.from_numpy(target_lp),
        weight=torch.from_numpy(weight),
    )
    return targets, covered & (weight > 0)


def _aligned_targets(pieces, *, starts, n, first_position, weight, target_ids):
    P = len(target_ids)
    exact_pos, ids, lps, entry_pos, tails = [], [], [], [], []
    chain_lp, chain_pos, chain_group = [], [], []
    covered, exact_cov = np.zeros(P, bool), np.zeros(P, bool)
    n_exact = n_chain = cut = 0
    for k, sig in pieces:
        a, m, p0 = int(starts[k]), int(n[k]), int(first_position[k])
        lo, hi = a, a + m - 1  # the piece's student positions [lo, hi)
        keep = (sig.exact_s >= lo) & (sig.exact_s < hi)
        s, t = sig.exact_s[keep], sig.exact_t[keep]
        e_ids, e_lps, counts = _entries_of(sig, t)
        exact_pos.append(p0 + s - lo)
        ids.append(e_ids)
        lps.append(e_lps)
        entry_pos.append(np.repeat(np.arange(n_exact, n_exact + len(s)), counts))
        tails.append(sig.tail[t])
        n_exact += len(s)
        inside = (sig.chain_s0 >= lo) & (sig.chain_s1 <= hi)
        touches = (sig.chain_s1 > lo) & (sig.chain_s0 < hi)
        cut += int((touches & ~inside).sum())
        c0, c1 = sig.chain_s0[inside], sig.chain_s1[inside]
        chain_lp.append(sig.chain_logprob[inside])
        chain_pos.append(p0 + _ranges(c0 - lo, c1 - c0))
        chain_group.append(np.repeat(np.arange(n_chain, n_chain + len(c0)), c1 - c0))
        n_chain += len(c0)
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)
    exact_pos_a, chain_pos_a = cat(exact_pos, np.int64), cat(chain_pos, np.int64)
    exact_cov[exact_pos_a] = True
    covered[exact_pos_a] = True
    covered[chain_pos_a] = True
    t = lambda x: torch.from_numpy(x)
    targets = AlignedTargets(
        target_ids=t(target_ids),
        exact_pos=t(exact_pos_a),
        entry_ids=t(cat(ids, np.int64)),
        entry_logprobs=t(cat(lps, np.float32)),
        entry_pos=t(cat(entry_pos, np.int64)),
        tail=t(cat(tails, np.float32)),
        chain_teacher_logprob=t(cat(chain_lp, np.float32)),
        chain_pos=t(chain_pos_a),
        chain_group=t(cat(chain_group, np.int64)),
        weight=t(weight),
    )
    has_weight = weight > 0
    return targets, covered & has_weight, exact_cov & has_weight, cut


def _source_table(
    view: StoreVersion, source: Source, *, split: str, eval_fraction: float, primary_ids: list[str]
) -> _SourceTable:
    idx = split_index(view, teacher=source.name, split=split, eval_fraction=eval_fraction)
    table = TeacherRows.of(view, teacher=source.name, split=split, eval_fraction=eval_fraction)
    students = None
    if source.student is not None:  # cross
        k = view.teachers[source.name].student_names.index(source.student)
        students = {
            c: pc.list_element(idx[c], k).to_numpy().astype(np.int64)
            for c in ("student_start", "n_student_tokens", "group_start", "n_groups")
        }
    return _SourceTable(rows=table, row_of=match_rows(primary_ids, table.sample_ids), students=students)


def match_rows(primary_ids: list[str], ids: list[str]) -> np.ndarray:
    """[len(primary_ids)] row of each primary sample id in `ids`, or -1."""
    where = {sid: i for i, sid in enumerate(ids)}
    return np.array([where.get(sid, -1) for sid in primary_ids], dtype=np.int64)
