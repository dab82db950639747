"""`logitstore export` and `StoreVersion.answer` on stores whose answers' prompts were not kept (written
before they were): a plain prompt's decoded text is its user turn where the answer's source hash
vouches for it, a conversation is refused in one line, and a store of no answers too (exit 2). Answers
with their prompts kept are tested on real builds in tests/test_generate.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
from tokenizers import Tokenizer
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.format import codec
from logitstore.store.generation import answer_source_hash
from logitstore.store.store import Store
from logitstore.store.verify import verify
from logitstore.testing.stores import VOCAB, teacher, word_tokenizer_json
from logitstore.testing.synthetic import random_samples

GENERATION = "0123456789ab"
PROMPT_TOKENS = 3
STOP = VOCAB - 1  # a special token, as an answer's stop token is


def tokenizer_json() -> str:
    tokenizer = Tokenizer.from_str(word_tokenizer_json(VOCAB - 1))
    tokenizer.add_special_tokens(["<stop>"])
    return tokenizer.to_str()


def write_answers(store: Store, sample_ids: list[str], *, sources, seed: int, first: bool = False) -> None:
    """Answers as a writer that kept no prompts wrote them: the first `PROMPT_TOKENS` tokens the prompt's."""
    samples = random_samples(sample_ids, seed=seed, min_tokens=6, max_tokens=10)
    samples.input_ids[samples.token_offsets[1:] - 1] = STOP  # each answer ends with its stop token
    samples.loss_mask = np.concatenate(
        [np.r_[np.zeros(PROMPT_TOKENS, np.uint8), np.ones(n - PROMPT_TOKENS, np.uint8)] for n in samples.n_tokens]
    )
    meta = dataclasses.replace(teacher(), loss_mask="completion")
    with store.writer() as w:
        if first:
            order = codec.frequency_id_order(samples.entry_ids, vocab_size=VOCAB)
            w.add_teacher(meta, tokenizer_json=tokenizer_json(), code_of_id=order)
            w.record_generation("teacher-a", {"id": GENERATION, "seed": 0})
        w.write(samples, teacher="teacher-a", source_hashes=sources(samples))
        w.commit("answers")


def plain_source(samples) -> list[str]:
    """The source hash of an answer to the plain text its prompt's tokens decode to."""
    text = Tokenizer.from_str(tokenizer_json()).decode(samples.input_ids[:PROMPT_TOKENS].tolist())
    return [answer_source_hash(hashlib.sha256(text.encode()).hexdigest()[:32], GENERATION)]


def test_answers_stored_before_prompts_were_kept_export_plain_prompts_and_refuse_conversations(tmp_path):
    uri, out = str(tmp_path / "s"), tmp_path / "rows.jsonl"
    store = Store.open(uri, create=True)
    write_answers(store, ["doc"], sources=lambda s: [None], seed=0, first=True)
    none = CliRunner().invoke(app, ["export", uri, str(out)])
    assert none.exit_code == 2 and none.stderr.count("\n") == 1 and "holds no generated answers" in none.stderr
    assert not out.exists()

    write_answers(store, ["plain/g0"], sources=plain_source, seed=1)
    result = CliRunner().invoke(app, ["export", uri, str(out)])
    assert result.exit_code == 0 and "1 answer(s) were stored before prompts were kept" in result.stderr
    summary = json.loads(CliRunner().invoke(app, ["export", uri, str(out), "--json"]).stdout)
    assert (summary["answers"], summary["prompts_not_stored"]) == (1, 1)
    view = store.read()
    answer = view.answer("plain/g0")
    assert answer["messages"] == [{"role": "user", "content": answer["prompt_text"]}]
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    # the assistant's turn is the answer less its stop token: the chat template writes its own end of turn
    assert answer["text"].endswith(" <stop>") and answer["token_ids"][-1] == STOP
    assistant = {"role": "assistant", "content": answer["text"].removesuffix(" <stop>")}
    assert row == {
        "prompt_id": "plain",
        "sample": 0,
        "messages": [*answer["messages"], assistant],
        "generation": GENERATION,
    }
    assert verify(view).ok

    write_answers(store, ["chat/g0"], sources=lambda s: [answer_source_hash("c" * 32, GENERATION)], seed=2)
    assert store.read().answer("chat/g0")["messages"] is None
    refused = CliRunner().invoke(app, ["export", uri, str(out)])
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1
    assert "'chat/g0' was stored before prompts were kept" in refused.stderr and "conversation" in refused.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == [row]  # the last export stays whole
