"""Human- and machine-readable views of stored samples (`logitstore show`)."""

from __future__ import annotations

import re

import numpy as np

from logitstore.errors import LogitstoreError
from logitstore.store.version import StoreVersion


def sample_as_json(
    view: StoreVersion, sample_id: str, *, teacher: str | None = None, student_tokenizer: str | None = None
) -> dict:
    """`{"sample_id", "input_ids", "loss_mask", "positions": [{"ids", "logprobs", "tail", "target_logprob"}]}`.

    Entries of each position are sorted by probability, highest first. Sampled stores add `counts`;
    when the store keeps the teacher's tokenizer, `tokens` and `entry_tokens` hold decoded strings.
    With `student_tokenizer`: `student_ids` and `alignment`, a list of [t0, t1, s0, s1], half-open
    ranges into `input_ids` and `student_ids` that cover the same bytes, in order (and `student_tokens`).
    """
    teacher = view.teacher_name(teacher)
    s = view.sample(sample_id, teacher=teacher)
    offsets = s.entry_offsets
    # Highest probability first within each position: one lexsort over (position, -logprob).
    position = np.repeat(np.arange(len(s.n_entries)), s.n_entries)
    order = np.lexsort((-s.entry_logprobs, position))
    ids, logprobs = s.entry_ids[order], s.entry_logprobs[order]
    counts = None if s.entry_counts is None else s.entry_counts[order]
    positions = []
    for p in range(len(s.n_entries)):  # one dict per position is the output format itself
        e0, e1 = offsets[p], offsets[p + 1]
        entry = {
            "ids": ids[e0:e1].tolist(),
            "logprobs": [float(x) for x in logprobs[e0:e1]],
            "tail": float(s.tail[p]),
            "target_logprob": float(s.target_logprobs[p]),
        }
        if counts is not None:
            entry["counts"] = counts[e0:e1].tolist()
        positions.append(entry)
    # Chat data: 1 for the completion's tokens (position t is supervised iff token t + 1 is); [] for plain text.
    loss_mask = [] if s.loss_mask is None else s.loss_mask.astype(int).tolist()
    out = {
        "sample_id": sample_id,
        "teacher": teacher,
        "input_ids": s.input_ids.tolist(),
        "loss_mask": loss_mask,
        "positions": positions,
    }
    tokenizer = view.tokenizer(teacher)
    if tokenizer is not None:
        # Decoded one by one, so byte-level markers become text (' module', not 'Ġmodule'); a token that is
        # only part of a multi-byte character decodes to U+FFFD.
        vocab = {int(i): tokenizer.decode([int(i)]) for i in np.unique(np.concatenate([s.input_ids, ids]))}
        out["tokens"] = [vocab[int(t)] for t in s.input_ids]
        out["entry_tokens"] = [[vocab[i] for i in pos["ids"]] for pos in positions]
    answer = view.answer(sample_id, teacher=teacher)
    if answer is not None:  # a generated answer (build --generate): its text and what wrote it
        out["answer"] = answer
    if student_tokenizer is not None:
        student_ids, groups = view.student_tokens(sample_id, teacher=teacher, student=student_tokenizer)
        out["student_tokenizer"] = student_tokenizer
        out["student_ids"] = student_ids.tolist()
        out["alignment"] = groups.tolist()
        decoder = view.student_tokenizer(teacher, student_tokenizer)
        out["student_tokens"] = [decoder.decode([int(i)]) for i in student_ids]
    return out


def position_slice(obj: dict, *, start: int | None, stop: int | None) -> dict:
    """`sample_as_json`'s output cut to positions [start, stop): those positions, and the tokens from the
    first one's to the one the last predicts (`input_ids`, `tokens`, `loss_mask`); `first_position` says
    where they start. (Alignment fields of a student tokenizer stay whole: they index the whole sample.)"""
    n = len(obj["positions"])
    first, last = min(start or 0, n), min(stop if stop is not None else n, n)
    out = {**obj, "positions": obj["positions"][first:last], "first_position": first}
    token_span = slice(first, last + 1 if last > first else first)
    for key in ("input_ids", "tokens", "loss_mask"):
        if obj.get(key):
            out[key] = obj[key][token_span]
    if "entry_tokens" in obj:
        out["entry_tokens"] = obj["entry_tokens"][first:last]
    return out


def list_samples(view: StoreVersion, *, limit: int | None = None) -> list[dict]:
    """`[{"sample_id", "tokens", "teacher"}]`, one per stored sample and teacher, in index order (the
    order the samples were written); the first `limit` of them."""
    index = view.index if limit is None else view.index.slice(0, limit)
    return [
        {"sample_id": sid, "tokens": n, "teacher": t}
        for sid, n, t in zip(
            index["sample_id"].to_pylist(), index["n_tokens"].to_pylist(), index["teacher"].to_pylist()
        )
    ]


def parse_positions(text: str) -> tuple[int | None, int | None]:
    """`A:B` (either side may be left out, as in a Python slice; no negatives) -> (A, B)."""
    match = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", text)
    if match is None:
        raise LogitstoreError(f"--positions {text!r}: expected A:B, e.g. 0:20, 100: or :50")
    start, stop = (int(g) if g else None for g in match.groups())
    if start is not None and stop is not None and stop < start:
        raise LogitstoreError(f"--positions {text!r}: the end {stop} is before the start {start}")
    return start, stop
