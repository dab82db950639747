"""`build --generate` with several `--teacher`s: one set of answers, scored by every teacher.

Multi-teacher distillation (`logitstore.streaming.mixing`) pairs the teachers' samples by id and token
ids, so every teacher must score the same answers. The first teacher's pass generates them (its
`Generation`: `--generator`, or the first teacher itself); every later teacher's pass takes the answers
the branch holds for the first teacher (`StoredAnswers`): the same ids `PROMPTID/gN`, the same token ids
and loss mask, the same source hash and generation record. Nothing is generated twice: a later pass
only reads, and a resumed build's first pass skips the answers the branch holds. An answer the first
teacher does not hold (its server refused it, or it was too long) is scored by no later teacher either
(`no_answer`).

A later teacher reads the answers as token ids, so it must have the first teacher's tokenizer
(`check_one_tokenizer`, before anything is written).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow.compute as pc

from logitstore.pipelines.config import BuildError
from logitstore.pipelines.generate import Generated, Generation, GenerationCounts
from logitstore.pipelines.inputs import Document
from logitstore.pipelines.retokenize import Prompt
from logitstore.store.answers import answer_tokens

# An answer as a later teacher scores it: prompt + answer token ids, and the loss mask (the answer's).
Answer = tuple[np.ndarray, np.ndarray]


@dataclass
class AnswersOf:
    """Where a later teacher's pass takes its answers: the build's first teacher and its generation
    record; `held` gives them from memory instead of the branch (a dry run writes no answers)."""

    teacher: str
    record: dict
    held: dict[str, tuple[Answer, str]] = field(default_factory=dict)  # answer id -> (answer, source hash)


def check_one_tokenizer(teachers: list, infos: list, *, student_tokenizers: tuple[str, ...] = ()) -> None:
    """With `--generate`, every teacher scores the first one's answers' token ids: one tokenizer for all,
    and no student tokenizer (a later teacher's pass reads token ids, not the answers' text to align)."""
    if student_tokenizers and len(teachers) > 1:
        raise BuildError(
            "--student-tokenizer with --generate takes one --teacher: a later teacher's answers are not aligned "
            "to student tokenizers yet; build each teacher's answers in a build of its own"
        )
    for teacher, info in zip(teachers[1:], infos[1:]):
        if info.tokenizer_hash != infos[0].tokenizer_hash:
            raise BuildError(
                f"--teacher {teacher}: its tokenizer differs from the first teacher's ({infos[0].spec.name}); "
                "with --generate every teacher scores the same answers' token ids, and answers are not "
                "tokenized for another tokenizer yet: build that teacher's answers in a build of their own"
            )


class StoredAnswers(Generation):
    """The answer source of a later teacher's pass: a `Generation` that generates nothing. The planner
    (`plan._plan_answers`) asks it for each prompt's answer documents, as of a generation (the first
    pass's record, so the ids and source hashes are the first teacher's), and for the answers it wants;
    they come from the first teacher's samples in `version` (the branch when this pass starts), or from
    `source.held` first. It loads no generator: it sets only the settings `Generation`'s planning methods read."""

    def __init__(self, cfg, *, source: AnswersOf, version=None, counts=None):
        self.cfg, self.max_new_tokens, self.record = cfg, cfg.generate, source.record
        self.generated, self._generator, self.counts = Generated(), None, counts
        self.source, self.version = source, version
        self._rows: dict[str, int] | None = None
        self._index: dict[str, list] = {}

    def generator(self):
        raise AssertionError("a later teacher's pass generates nothing")

    def carry_as_text(self, tokenizer, students) -> None:
        """Nothing is carried as text: the answers are the first teacher's token ids (one tokenizer for all,
        and no student tokenizers: `check_one_tokenizer`)."""

    def prompt_tokens(self, tokenizer, docs: list[Document]) -> list[Prompt]:
        """Nothing to tokenize: the first pass checked every prompt, and its samples hold their tokens."""
        empty = np.empty(0, np.int64)
        return [Prompt(empty, empty)] * len(docs)

    def answer(
        self, wanted: list[tuple[Document, Prompt]], *, counts: GenerationCounts
    ) -> Iterator[tuple[Document, np.ndarray, np.ndarray, None]]:
        """(answer document, prompt + answer tokens, loss mask, no student sides) of each wanted answer the first teacher
        holds (of this generation: its source hash); the others count as `no_answer`."""
        found = self._read([doc for doc, _ in wanted])
        if self.counts is not None:
            self.counts.no_answer += len(wanted) - len(found)
        for doc, _ in wanted:
            if doc.id in found:
                tokens, mask = found[doc.id]
                yield doc, tokens, mask, None

    def _read(self, docs: list[Document]) -> dict[str, Answer]:
        """The answers of this generation (their source hash) among `docs`: from memory, else the branch."""
        held = self.source.held
        out = {d.id: held[d.id][0] for d in docs if d.id in held and held[d.id][1] == d.source_hash}
        if self.version is None:
            return out
        index, rows = self._first_teachers_rows()
        same = [d for d in docs if d.id not in out and d.id in rows]
        picked = [(d.id, rows[d.id]) for d in same if index["source_hash"][rows[d.id]] == d.source_hash]
        by_part: dict[str, list[tuple[str, int]]] = {}
        for sid, r in picked:  # per answer, not per token
            by_part.setdefault(index["part"][r], []).append((sid, r))
        for part, members in by_part.items():
            starts = np.array([index["token_start"][r] for _, r in members], dtype=np.int64)
            lengths = np.array([index["n_tokens"][r] for _, r in members], dtype=np.int64)
            samples = answer_tokens(self.version, self.source.teacher, part, starts, lengths)
            out.update((sid, sample) for (sid, _), sample in zip(members, samples))
        return out

    def _first_teachers_rows(self) -> tuple[dict[str, list], dict[str, int]]:
        """The first teacher's index rows (columns as lists) and each sample id's row, read once."""
        if self._rows is None:
            index = self.version.index
            index = index.filter(pc.equal(index["teacher"], self.source.teacher))
            columns = ("sample_id", "part", "token_start", "n_tokens", "source_hash")
            self._index = {name: index[name].to_pylist() for name in columns}
            self._rows = {sid: i for i, sid in enumerate(self._index["sample_id"])}
        return self._index, self._rows
