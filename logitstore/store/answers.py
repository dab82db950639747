"""Generated answers as chat rows: `StoreVersion.answers_dataset` and `logitstore export`.

A row is TRL's conversational format: `{"prompt_id", "sample", "messages": [the prompt's turns..., {"role":
"assistant", "content": the answer's text}], "generation": id}`, one per answer of a version's teacher, in
the order the index holds them. The prompt's turns are the ones the build was given (`layout.PROMPTS`:
a conversation's messages with their system turn and extra keys, or plain text as one user turn), the
answer's text the teacher's tokenizer's decoding of the answer's tokens (`StoreVersion.answer`'s `text`)
less the stop token it ends with, which the chat template writes again when it renders the row; an
answer cut at `--generate` tokens is exported as it is.

A store written before prompts were kept still exports where that is sound: a plain prompt's text, as
the teacher's tokenizer decodes the prompt's tokens, is its user turn when it hashes to the answer's
source hash (`generation.is_plain_prompt`), and the summary counts those rows (`prompts_not_stored`); a
conversation, which only its rendered text stands for, is refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from logitstore.errors import LogitstoreError
from logitstore.files import replace_file
from logitstore.format import layout
from logitstore.format.layout import read_values
from logitstore.storage.bounded import read_errors
from logitstore.store.generation import generation_of, parse_answer_id, prompt_messages

# What `export` writes, by the output's suffix; both are what `datasets.load_dataset` reads.
EXPORT_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


class ExportError(LogitstoreError):
    """An output that cannot be written, or answers that cannot be made chat rows."""


@dataclass
class AnswerRows:
    """A teacher's answers as chat rows, and how many of their prompts were not stored (plain prompts of a
    store written before prompts were kept: their decoded text is the user turn)."""

    teacher: str
    rows: list[dict] = field(default_factory=list)
    prompts_not_stored: int = 0


def answer_rows(view, *, teacher: str | None = None) -> AnswerRows:
    """Every answer of `teacher` in the version `view` (a `StoreVersion`) as a chat row."""
    name = view.teacher_name(teacher)
    index = view.index.filter(pc.equal(view.index["teacher"], name))
    rows = [
        r for r in index.to_pylist() if generation_of(r["source_hash"]) and parse_answer_id(r["sample_id"]) is not None
    ]
    if not rows:
        raise ExportError(
            f"teacher {name!r} holds no generated answers in version {view.snapshot_id} (build --generate writes them)"
        )
    tokenizer = view.tokenizer(name)
    if tokenizer is None:
        raise ExportError(f"the store keeps no tokenizer of teacher {name!r}: its answers cannot be decoded to text")
    out = AnswerRows(teacher=name)
    by_part: dict[str, list[dict]] = {}
    for r in rows:
        by_part.setdefault(r["part"], []).append(r)
    made = {}
    for part, part_rows in by_part.items():
        for r, row in zip(part_rows, _part_rows(view, name, part, part_rows, tokenizer=tokenizer, out=out)):
            made[r["sample_id"]] = row
    out.rows = [made[r["sample_id"]] for r in rows]  # the index's order
    return out


def _part_rows(view, teacher: str, part: str, rows: list[dict], *, tokenizer, out: AnswerRows) -> list[dict]:
    """The chat rows of one part's answers: their tokens and loss masks read once (`answer_tokens`)."""
    stored = view.prompts(teacher, part)
    starts = np.array([r["token_start"] for r in rows], dtype=np.int64)
    lengths = np.array([r["n_tokens"] for r in rows], dtype=np.int64)
    samples = [(ids, mask.astype(bool)) for ids, mask in answer_tokens(view, teacher, part, starts, lengths)]
    stops = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    decode = lambda seqs: tokenizer.decode_batch(seqs, skip_special_tokens=False)
    answers = decode([_less_stop(ids[mask].tolist(), stops) for ids, mask in samples])
    unstored = [i for i, r in enumerate(rows) if r["sample_id"] not in stored]
    prompt_texts = dict(zip(unstored, decode([samples[i][0][~samples[i][1]].tolist() for i in unstored])))
    made = []
    for i, (r, answer) in enumerate(zip(rows, answers)):
        turns = prompt_messages(
            stored.get(r["sample_id"]), source_hash=r["source_hash"], prompt_text=prompt_texts.get(i)
        )
        if turns is None:
            raise ExportError(
                f"answer {r['sample_id']!r} was stored before prompts were kept and its prompt is a conversation, "
                "which only its chat template's rendering stands for; its messages cannot be exported "
                "(build its answers again into a new store)"
            )
        out.prompts_not_stored += int(i in prompt_texts)
        prompt_id, sample = parse_answer_id(r["sample_id"]) or (r["sample_id"], 0)
        made.append(
            {
                "prompt_id": prompt_id,
                "sample": sample,
                "messages": [*turns, {"role": "assistant", "content": answer}],
                "generation": generation_of(r["source_hash"]),
            }
        )
    return made


def answer_tokens(
    view, teacher: str, part: str, starts: np.ndarray, lengths: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids int64, loss mask uint8) of samples of one part, by their index rows' `token_start` and
    `n_tokens`: one read per array, of the span the samples cover."""
    lo, hi = int(starts.min()), int((starts + lengths).max())
    with read_errors(f"the answers of part {part} of teacher {teacher!r} ({layout.part_path(teacher, part)})"):
        ids = read_values(view.array(teacher, part, "input_ids"), slice(lo, hi))
        mask = read_values(view.array(teacher, part, "loss_mask"), slice(lo, hi))
    spans = [slice(a - lo, a - lo + n) for a, n in zip(starts.tolist(), lengths.tolist())]
    return [(ids[s].astype(np.int64), mask[s].astype(np.uint8)) for s in spans]


def _less_stop(answer: list[int], stops: set[int]) -> list[int]:
    """An answer's tokens less the stop token it ends with (a special token): a chat row's assistant turn
    is its content, and the chat template that renders the row writes the end of the turn itself."""
    return answer[:-1] if answer and answer[-1] in stops else answer


def answers_dataset(view, *, teacher: str | None = None):
    """`answer_rows` as a `datasets.Dataset` (the `hf` extra's datasets package)."""
    try:
        import datasets
    except ImportError:
        raise ExportError("answers_dataset needs the datasets package (pip install 'logitstore[hf]')") from None
    return datasets.Dataset.from_list(answer_rows(view, teacher=teacher).rows)


def check_export_path(out: Path) -> str:
    """The format `out` is written in (`EXPORT_FORMATS`), if it can be written: checked before a store is read."""
    kind = EXPORT_FORMATS.get(out.suffix)
    if kind is None:
        raise ExportError(f"{out}: name a .jsonl or .parquet file (what datasets.load_dataset reads)")
    if out.is_dir():
        raise ExportError(f"{out} is a folder; name a .jsonl or .parquet file")
    if not out.parent.is_dir():
        raise ExportError(f"{out}: its folder {out.parent} does not exist")
    return kind


def write_answers(view, out: Path, *, teacher: str | None = None) -> dict:
    """Write the teacher's answers as chat rows to `out` (JSON lines or Parquet, by its suffix), whole
    or not at all (a temporary file beside it, renamed), and return the summary `export --json` prints."""
    kind = check_export_path(out)
    made = answer_rows(view, teacher=teacher)
    if kind == "parquet":
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(made.rows), sink)
        data = sink.getvalue().to_pybytes()
    else:
        data = b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in made.rows)
    try:
        replace_file(out, data)
    except OSError as e:
        raise ExportError(f"cannot write {out}: {e.strerror or e}") from None
    return {
        "out": str(out),
        "format": kind,
        "teacher": made.teacher,
        "version": view.snapshot_id,
        "answers": len(made.rows),
        "prompts": len({r["prompt_id"] for r in made.rows}),
        "generations": sorted({r["generation"] for r in made.rows}),
        "prompts_not_stored": made.prompts_not_stored,
    }
