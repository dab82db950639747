"""`BuildSummary`: what a build reports (`build --json`, the last lines of its progress), counted from the
commits it made, so two builds of the same data at once each count only what their own commits hold.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pyarrow as pa

from logitstore.pipelines.workers import Unit
from logitstore.store.documents import document_ids


@dataclass
class BuildSummary:
    """The `--json` summary. `samples`/`tokens` count what this run wrote."""

    samples: int = 0
    tokens: int = 0
    skipped: int = 0  # documents too short to predict anything (< 2 tokens)
    no_completion: int = 0  # conversations whose rendering holds no assistant token (skipped)
    tool_calls: int = 0  # conversations with tool calls that the teacher's chat template does not render (skipped)
    duplicates: int = 0  # documents whose id appeared earlier in the input
    already_stored: int = 0  # samples committed by an earlier (interrupted) run of the build
    refused: int = 0  # samples the teacher's server refused (a 4xx for that request; --engine server)
    too_long: int = 0  # samples longer than the teacher's server takes (its max_model_len; --engine server)
    changed: int = 0  # documents stored before with other text: replaced or kept, by --on-duplicate
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    bytes_per_token: float | None = None
    version: str | None = None  # the branch's version after the build; None: nothing stored, nothing made
    teacher: str = ""
    commits: int = 0
    stored_bytes: int = 0  # compressed bytes of the parts this run wrote
    teachers: list = field(default_factory=list)  # each teacher's own summary (one with one --teacher)
    # build --generate: prompts read, answers generated (this run), their tokens, answers cut at --generate
    prompts: int = 0
    answers: int = 0
    generated_tokens: int = 0
    answers_cut: int = 0
    answers_retokenized: int = 0  # answers whose generated ids a side with the generator's tokenizer re-tokenized
    answers_empty: int = 0  # answers without a token (a served generator's): not stored
    generation: dict | None = None  # what wrote the answers (`Generation.record`), stored with them
    no_answer: int = 0  # a later teacher of several: answers the first teacher does not hold (not scored)
    startup_seconds: dict | None = None  # the command to the teacher's first batch, in phases (`startup.py`)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def own_json(self) -> dict:
        """One teacher's part of a build's `teachers` list: its summary less that list."""
        return {k: v for k, v in self.to_json().items() if k != "teachers"}


def count_skips(summary: BuildSummary, unit: Unit) -> None:
    """Samples the engine left out of a merged unit (the server engine's refusals and too long samples)."""
    summary.refused += unit.skips.get("refused", 0)
    summary.too_long += unit.skips.get("too_long", 0)


def count_commit(summary: BuildSummary, writer) -> None:
    """The summary counts what the commits hold: samples a concurrent build of the same data committed
    first were dropped at the rebase and count as already stored, and a commit left with nothing to
    hold was not made."""
    result = writer.result
    summary.samples += result.samples
    summary.tokens += result.tokens
    summary.stored_bytes += result.stored_bytes
    summary.already_stored += result.dropped
    summary.changed += len(set(document_ids(pa.array(result.changed, pa.string())).to_pylist()))
    summary.commits += result.committed


def summary_json(summary: BuildSummary) -> str:
    return json.dumps(summary.to_json(), indent=2)
