"""Generated answers carried as text: `build --generate` with a generator whose tokenizer is not the
teacher's, or with `--student-tokenizer` (docs/build.md "Generated data").

The generator's answer ids are decoded by its own tokenizer (special tokens kept as their text, spaces
not cleaned up). An answer that ended at one of the generator's stop tokens ends, in the text, with that
token's text where the tokenizers are the same, and with the teacher's stop token's text where they are
not (so the teacher scores its own way of stopping, as a chat template renders it). Each side then
tokenizes that text after its own tokens of the prompt's text, the two parts apart, so every side cuts
where the prompt ends: the teacher's tokens (prompt's, then the answer's, which decode to the text), and
per student tokenizer its ids, the groups (`align.align_groups`) and its loss mask, 1 on exactly the
tokens of the answer's bytes. Teacher tokens past `--max-length` are cut, and the text with them.

A side with the generator's own tokenizer (the teacher answering itself, a student tokenizer that wrote
the answer: the on-policy case) holds the generated ids themselves, their byte ends the lengths of the
bytes each stands for, where those bytes spell the decoded text exactly; where they do not (the bytes of
a character that never completes, a tokenizer whose decoding drops or adds spaces), or the answer was
cut, it holds its tokens of the text instead, and the answer is counted (`answers_retokenized`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from logitstore.pipelines import align


@dataclass(frozen=True)
class Prompt:
    """A prompt as the generator and the teacher take it."""

    ids: np.ndarray  # the teacher's tokens
    generator_ids: np.ndarray  # the generator's (`ids` itself where it has the teacher's tokenizer)
    # answers carried as text: what `ids` are the tokens of (the prompt, or its chat rendering), their
    # byte ends in it, and each student tokenizer's (ids, byte ends) of it, by name
    text: str | None = None
    ends: np.ndarray | None = None
    students: dict[str, tuple[np.ndarray, np.ndarray]] | None = None


@dataclass(frozen=True)
class TextAnswer:
    """One answer as a sample: the teacher's tokens and loss mask, each student tokenizer's side."""

    tokens: np.ndarray  # the teacher's: prompt, then answer
    mask: np.ndarray  # 1 on the answer's tokens
    students: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]  # name -> (ids, groups, mask)
    cut: bool  # the teacher's tokens of the answer overflowed --max-length, and were cut
    retokenized: bool  # a side with the generator's tokenizer holds other tokens than the generated ones


@dataclass
class AnswerText:
    """How one build carries answers as text."""

    teacher: Any  # the teacher's tokenizer
    generator: Any | None  # the generator's tokenizer, where it is not the teacher's
    generator_hash: str  # the generator's tokenizer hash (a student tokenizer with it held the generated ids)
    teacher_stop: str  # the teacher's stop token's text: what a stopped answer of another tokenizer ends with
    students: Sequence[Any]  # `plan.StudentSide`s (plan imports this module, through generate)
    special_tokens: bool  # plain prompts take the tokenizer's special tokens (as text input does); chat holds them

    def prompts(self, texts: list[str], generator_ids: list[np.ndarray] | None) -> list[Prompt]:
        """Each prompt text tokenized by the teacher and every student tokenizer, with byte ends."""
        special = self.special_tokens
        teacher = align.encode_with_byte_ends(self.teacher, texts, add_special_tokens=special)
        sides = [align.encode_with_byte_ends(st.tokenizer, texts, add_special_tokens=special) for st in self.students]
        out = []
        for i, (text, (ids, ends)) in enumerate(zip(texts, teacher)):
            students = {st.registration.name: side[i] for st, side in zip(self.students, sides)}
            own = ids if generator_ids is None else np.asarray(generator_ids[i], dtype=np.int64)
            out.append(Prompt(ids=ids, generator_ids=own, text=text, ends=ends, students=students))
        return out

    def answers(
        self, prompts: list[Prompt], generated: list[np.ndarray], *, stop_ids: Sequence[int], max_length: int
    ) -> list[TextAnswer]:
        """Each (prompt, generated ids) as a sample of the teacher's tokens, with every student's side."""
        stops = np.asarray(stop_ids, dtype=np.int64)
        generated = [np.asarray(a, dtype=np.int64) for a in generated]
        stopped = [len(a) > 0 and bool(np.isin(a[-1:], stops).any()) for a in generated]
        # the generated ids that stand for the text (with their stop where the tokenizers are the same), and
        # that text: what a side with the generator's tokenizer holds where their bytes spell it exactly
        crossing = self.generator is not None
        spelled = [a[:-1] if s and crossing else a for a, s in zip(generated, stopped)]
        texts = self._generator_tokenizer.batch_decode(
            [a.tolist() for a in spelled], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        # byte ends of the generated ids, where a side has the generator's tokenizer and their bytes spell the text
        hashes = [st.registration.tokenizer_hash for st in self.students]
        holds = not crossing or self.generator_hash in hashes
        own = [self._own_ends(a, text) if holds else None for a, text in zip(spelled, texts)]
        tails = [self.teacher_stop if s and crossing else "" for s in stopped]
        texts = [text + tail for text, tail in zip(texts, tails)]
        teacher = align.encode_with_byte_ends(self.teacher, texts, add_special_tokens=False)
        cut = []
        for i, (prompt, (ids, ends)) in enumerate(zip(prompts, teacher)):
            generated_ends = own[i]
            if not crossing and generated_ends is not None:  # the teacher's own answer: at most --generate tokens
                teacher[i] = (spelled[i], generated_ends)
            room = max_length - len(prompt.ids)
            cut.append(len(teacher[i][0]) > room)
            if cut[-1]:
                keep = _clean_cut(ends, room)
                texts[i] = texts[i].encode()[: int(ends[keep - 1]) if keep else 0].decode()
                teacher[i] = (ids[:keep], ends[:keep])
        sides = [align.encode_with_byte_ends(st.tokenizer, texts, add_special_tokens=False) for st in self.students]
        out = []
        for i, (prompt, (ids, ends)) in enumerate(zip(prompts, teacher)):
            assert prompt.text is not None and prompt.ends is not None and prompt.students is not None
            base = len(prompt.text.encode())
            t_ends = np.concatenate([prompt.ends, ends + base])
            own_ends = own[i]
            kept = None if own_ends is None or cut[i] else (spelled[i], own_ends)
            students, generators = {}, 0 if crossing else 1
            for st, side in zip(self.students, sides):
                name = st.registration.name
                (p_ids, p_ends), (a_ids, a_ends) = prompt.students[name], side[i]
                if st.registration.tokenizer_hash == self.generator_hash:
                    generators += 1
                    if kept is not None:
                        a_ids, a_ends = self._generated_side(st, kept, tail=tails[i])
                groups = align.align_groups(t_ends, np.concatenate([p_ends, a_ends + base]))
                mask = np.concatenate([np.zeros(len(p_ids), np.uint8), np.ones(len(a_ids), np.uint8)])
                students[name] = (np.concatenate([p_ids, a_ids]), groups, mask)
            out.append(
                TextAnswer(
                    tokens=np.concatenate([prompt.ids, ids]),
                    mask=np.concatenate([np.zeros(len(prompt.ids), np.uint8), np.ones(len(ids), np.uint8)]),
                    students=students,
                    cut=cut[i],
                    retokenized=bool(generators) and kept is None,
                )
            )
        return out

    @property
    def _generator_tokenizer(self):
        """The generator's tokenizer."""
        return self.generator if self.generator is not None else self.teacher

    @cached_property
    def _pieces(self) -> tuple[np.ndarray, np.ndarray]:
        """The bytes each of the generator's ids stands for (a special token: its text), and their lengths."""
        pieces = [  # special tokens (and holes): a few decode calls
            b if b is not None else self._generator_tokenizer.decode([i], skip_special_tokens=False).encode()
            for i, b in enumerate(align.token_byte_strings(self._generator_tokenizer))
        ]
        table = np.empty(len(pieces), dtype=object)
        table[:] = pieces
        return table, np.fromiter((len(b) for b in pieces), dtype=np.int64, count=len(pieces))

    def _own_ends(self, ids: np.ndarray, text: str) -> np.ndarray | None:
        """Byte ends of generated ids in their decoded text, where their bytes spell it exactly (not: a
        character whose bytes never complete, a tokenizer whose decoding drops or adds spaces)."""
        table, lengths = self._pieces
        if len(ids) and int(ids.max()) >= len(table):
            return None
        if b"".join(table[ids]) != text.encode():
            return None
        return np.cumsum(lengths[ids])

    def _generated_side(self, student, mine: tuple[np.ndarray, np.ndarray], *, tail: str) -> tuple:
        """A student tokenizer that is the generator's: the generated ids, then its tokens of the teacher's stop."""
        ids, ends = mine
        if not tail:
            return ids, ends
        [(stop_ids, stop_ends)] = align.encode_with_byte_ends(student.tokenizer, [tail], add_special_tokens=False)
        base = int(ends[-1]) if len(ends) else 0
        return np.concatenate([ids, stop_ids]), np.concatenate([ends, stop_ends + base])


def _clean_cut(ends: np.ndarray, room: int) -> int:
    """The most tokens, at most `room`, that end where the next begins: byte ends fall at a character's
    end, and the tokens of one character split in several share it, so a cut keeps them together."""
    keep = room
    while 0 < keep < len(ends) and ends[keep] == ends[keep - 1]:  # a few steps, within one character
        keep -= 1
    return keep


def stop_text(tokenizer, stop_ids: Sequence[int]) -> str:
    """The text of a model's stop token: its tokenizer's end-of-sequence token where it is one of the
    model's stop ids, else the first of them; "" where it names none."""
    eos = getattr(tokenizer, "eos_token_id", None)
    stop = eos if eos in stop_ids else (stop_ids[0] if stop_ids else eos)
    return "" if stop is None else tokenizer.decode([int(stop)], skip_special_tokens=False)
