"""Prompts for `build --generate` and the answers a store keeps for them (token ids per answer id)."""

from __future__ import annotations

import json

import logitstore

PROMPTS = {
    "france": "The capital of France is",
    "story": "Once upon a time, a small robot",
    "code": "def add(a, b):",
    "list": "Three colours of the rainbow are",
}


def write_prompts(path, prompts: dict[str, str]):
    path.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in prompts.items()))
    return path


def answers(store) -> dict[str, list[int]]:
    view = logitstore.open(str(store))
    return {sid: view.answer(sid)["token_ids"] for sid in view.index["sample_id"].to_pylist()}
