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

Each answer's prompt is kept as the user gave it (`layout.PROMPTS`, one JSON line per answer of a part:
`{"id", "messages"}` for a conversation, `{"id", "text"}` for plain text), so an answer becomes a chat
row (`store/answers.py`) with the conversation's own turns, not the text its chat template rendered.
"""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np

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


def prompt_record(*, text: str | None, messages: list[dict] | None) -> dict:
    """An answer's prompt as given: a conversation's messages (as the chat reader keeps them), or plain text."""
    return {"messages": messages} if messages is not None else {"text": text}


def prompt_lines(sample_ids: list[str], prompts: list[dict | None]) -> bytes:
    """The prompts of a part's answers as stored (`layout.PROMPTS`): one JSON line per answer, in the
    part's sample order, keyed by sample id (an index may keep some of a part's samples only)."""
    lines = [
        json.dumps({"id": sid, **prompt}, ensure_ascii=False, separators=(",", ":"))
        for sid, prompt in zip(sample_ids, prompts, strict=True)
        if prompt is not None
    ]
    return "".join(line + "\n" for line in lines).encode("utf-8")


def prompt_array(sample_ids: list[str], prompts: list[dict | None] | None) -> dict[str, np.ndarray]:
    """`{layout.PROMPTS: the prompts' lines as bytes}` for a part of answers with prompts; else nothing."""
    from logitstore.format import layout  # here: layout imports the codec (numba), which a build's start-up must not

    if prompts is None or all(p is None for p in prompts):
        return {}
    return {layout.PROMPTS: np.frombuffer(prompt_lines(sample_ids, prompts), dtype=np.uint8)}


def read_prompt_lines(data: bytes) -> dict[str, dict]:
    """Sample id -> prompt record, of a part's stored prompts (`prompt_lines`)."""
    out = {}
    for line in data.decode("utf-8").splitlines():
        record = json.loads(line)
        out[record.pop("id")] = record
    return out


def prompt_turns(prompt: dict) -> list[dict]:
    """A prompt record's chat turns: a conversation's messages, or plain text as one user turn."""
    if "messages" in prompt:
        return [dict(m) for m in prompt["messages"]]
    return [{"role": "user", "content": prompt["text"]}]


def prompt_messages(stored: dict | None, *, source_hash: str, prompt_text: str | None) -> list[dict] | None:
    """An answer's prompt turns: as stored; for an answer stored before prompts were kept, a plain
    prompt's text (`is_plain_prompt`) as one user turn; else None (the turns of a conversation are not
    to be had from the text its chat template rendered)."""
    if stored is not None:
        return prompt_turns(stored)
    if prompt_text is not None and is_plain_prompt(source_hash, prompt_text):
        return [{"role": "user", "content": prompt_text}]
    return None


def is_plain_prompt(source_hash: str, text: str) -> bool:
    """Whether an answer's prompt was this plain text: its source hash is the one an answer to that text
    has (the text's sha256, as input text is hashed). What a store written before prompts were kept
    can still say: a conversation's hash is of its messages, which its rendered text does not give back."""
    generation = generation_of(source_hash)
    text_hash = hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
    return generation is not None and answer_source_hash(text_hash, generation) == source_hash
