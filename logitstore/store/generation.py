"""Generated answers in a store: how an answer is keyed, which generation wrote it, and reading it back.

`build --generate N` (pipelines/generate.py) stores each answer as a sample of its own: the prompt's
tokens then the answer's, with the loss mask on the answer only. Its sample id is `PROMPTID/gN`, N the
sample number (0 .. --samples-per-prompt - 1), so a resumed build knows every answer it holds by id
before it generates anything.

A *generation* is everything that decides the answers but the prompt: the generator (name, weights'
and tokenizer's hashes, the logitstore run and step it comes from), the engine, the sampling settings,
the seed and the round. Its id is the first 12 hex digits of the sha256 of that record's canonical
JSON. The teacher's group keeps every generation its samples came from (`GENERATIONS_ATTR`, by id),
and an answer's source hash begins with its generation's id (`g<id>-<hash of prompt and id>`), so
each sample names the generation that wrote it without a column of its own, and another generation's
answer to the same prompt counts as a document stored with other text (`--on-duplicate`).
"""

from __future__ import annotations

import hashlib
import json
import re

GENERATIONS_ATTR = "logitstore_generations"  # on a teacher's group: {generation id: record}
_ANSWER_ID = re.compile(r"(?P<prompt>.+)/g(?P<sample>[0-9]+)")
_SOURCE = re.compile(r"g(?P<id>[0-9a-f]{12})-[0-9a-f]+")


def answer_id(prompt_id: str, sample: int) -> str:
    return f"{prompt_id}/g{sample}"


def parse_answer_id(sample_id: str) -> tuple[str, int] | None:
    """(prompt id, sample number) of an answer's sample id, or None for another sample."""
    match = _ANSWER_ID.fullmatch(sample_id)
    return None if match is None else (match["prompt"], int(match["sample"]))


def generation_id(record: dict) -> str:
    """The id of a generation record (its canonical JSON's sha256, first 12 hex digits); `id` excluded."""
    body = {k: v for k, v in record.items() if k != "id"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


def answer_source_hash(prompt_hash: str, generation: str) -> str:
    """An answer's source hash (32 characters, as a text's): its generation's id, then a hash of the
    prompt's source hash and that id."""
    tail = hashlib.sha256(f"{prompt_hash}/{generation}".encode()).hexdigest()[:18]
    return f"g{generation}-{tail}"


def generation_of(source_hash: str | None) -> str | None:
    """The generation id an answer's source hash begins with; None for a sample that is no answer."""
    match = _SOURCE.fullmatch(source_hash or "")
    return None if match is None else match["id"]


def seed_of(seed: int, prompt_id: str, sample: int) -> int:
    """The 32-bit sampling seed of one answer: from the build's seed, the prompt's id and the sample
    number, so an answer never depends on which other prompts share its batch or on input order."""
    return int(hashlib.sha256(f"{seed}/{prompt_id}/{sample}".encode()).hexdigest()[:8], 16)
