"""What a request to the server asks and what its answer holds: a prompt's log-probabilities as the sparse
top-k arrays (`served_to_sparse`, through `prompt_logprobs`, as the vLLM engine converts its own), a generation request and its
answer's ids and top log-probabilities, and an answer scored in its generating request (`scored_answer`).
"""

from __future__ import annotations

import re

import numpy as np
import orjson

from logitstore.pipelines.engines.prompt_logprobs import ID_PAST_RANGE, entries_to_sparse
from logitstore.pipelines.engines.server.served_json import (
    MISSING_RANK,
    FlatPromptLogprobs,
    MalformedResponse,
    parse_prompt_logprobs,
)
from logitstore.pipelines.engines.vllm import VllmEngineError

# what reading an answer raises where it cannot be stored: not its shape, or values no distribution has
UNUSABLE = (MalformedResponse, VllmEngineError)


def served_to_sparse(body: bytes, tokens: np.ndarray, *, k: int, vocab_size: int) -> dict[str, np.ndarray]:
    """One answer's prompt log-probabilities as the sparse top-k arrays (`prompt_logprobs`), as the
    vLLM engine converts its own; `MalformedResponse` or `VllmEngineError` where it cannot be."""
    return flat_to_sparse(parse_prompt_logprobs(body), tokens, k=k, vocab_size=vocab_size)


def flat_to_sparse(flat: FlatPromptLogprobs, tokens: np.ndarray, *, k: int, vocab_size: int) -> dict[str, np.ndarray]:
    """`served_to_sparse` of prompt log-probabilities already read into flat arrays."""
    if flat.positions != len(tokens):
        raise MalformedResponse(f"{flat.positions} prompt_logprobs entries for a {len(tokens)}-token prompt")
    if len(flat.null_at) != 1 or flat.null_at[0] != 0:
        raise MalformedResponse("prompt_logprobs must be null at the first position only")
    targets = np.asarray(tokens, dtype=np.int64)[1:]
    counts = np.diff(flat.starts)[1:]
    rows = np.repeat(np.arange(len(targets)), counts)
    is_target = flat.ids == targets[rows]
    first = np.full(len(targets), -1, dtype=np.int64)
    hits = np.flatnonzero(is_target)
    first[rows[hits][::-1]] = hits[::-1]  # each row's first entry that is its prompt token
    if (first < 0).any():
        t = int(np.flatnonzero(first < 0)[0])
        raise MalformedResponse(f"prompt_logprobs entry {t + 1} lacks the prompt token {int(targets[t])}")
    target_lp = flat.logprobs[first].astype(np.float64)
    rank = flat.ranks[first]
    if (rank == MISSING_RANK).any():  # V1's convention: entries at least as likely, itself included
        at_least = np.bincount(rows, weights=flat.logprobs >= np.repeat(flat.logprobs[first], counts))
        rank = np.where(rank == MISSING_RANK, at_least.astype(np.int64), rank)
    return entries_to_sparse(
        targets,
        flat.ids,
        flat.logprobs.astype(np.float64),
        counts,
        target_lp,
        rank > k,
        k=k,
        vocab_size=vocab_size,
    )


def generation_request(
    model: str,
    prompt,
    *,
    seed: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: list[int],
    k: int | None,
) -> bytes:
    """One answer's `/v1/completions` request: the prompt as token ids, its own seed (n = 1: each answer
    is one request, so answer g1 does not depend on how many answers a prompt has), the answer's ids back
    (`return_token_ids`). Every sampling setting a server could default from the model's generation config
    (top-k, min-p, penalties) is pinned to "off", so the flags alone decide the draws. With `k`, the top-k
    of every position in the same request: the prompt's as `prompt_logprobs`, the answer's as `logprobs`
    keyed `token_id:ID` (`return_tokens_as_token_ids`)."""
    body = {
        "model": model,
        "prompt": np.asarray(prompt, dtype=np.int64).tolist(),
        "max_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": seed,
        "n": 1,
        "stop_token_ids": list(stop_ids),
        "return_token_ids": True,
    }
    if k is not None:
        body.update(logprobs=k, prompt_logprobs=k, return_tokens_as_token_ids=True)
    return orjson.dumps(body)


_TOKEN_IDS = re.compile(rb'"token_ids"\s*:\s*\[([-0-9,\s]*)\]')
_TOP_LOGPROBS = re.compile(rb'"top_logprobs"\s*:\s*\[([^\]]*)\]')
# one entry of an answer position's top log-probabilities; the `{` marks a position's first entry
_TOP_ENTRY = re.compile(rb'(\{?)\s*"token_id:(-?\d+)"\s*:\s*([-+0-9.eE]+|NaN|-?Infinity)')


def answer_ids(body: bytes) -> np.ndarray:
    """The answer's token ids (`token_ids` of the first choice: vLLM's `return_token_ids`)."""
    found = _TOKEN_IDS.search(body)
    if found is None:
        raise MalformedResponse(
            "the answer has no token_ids: the server must return them (a vLLM that takes return_token_ids)"
        )
    text = found.group(1).strip()
    return _int64(text.split(b",")) if text else np.zeros(0, dtype=np.int64)


def _int64(numbers) -> np.ndarray:
    """Integers given as bytes, an int64 array: one past int64 is `ID_PAST_RANGE`, which the vocabulary check
    refuses (numpy would raise OverflowError, a wrapping reader would store 2**64 + 5 as 5)."""
    try:
        return np.array(numbers, dtype=np.int64)
    except OverflowError:
        # a Python loop, on an answer that is refused anyway
        return np.array([n if abs(n := int(i)) < ID_PAST_RANGE else ID_PAST_RANGE for i in numbers], dtype=np.int64)


def answer_top_logprobs(body: bytes, *, positions: int) -> FlatPromptLogprobs:
    """The answer positions' top log-probabilities (`logprobs.top_logprobs`, keys `token_id:ID`) as flat
    arrays in the shape of `served_json`'s: one regular-expression pass and numpy, no object per entry
    but the matched bytes. Ranks are not sent: `MISSING_RANK`."""
    found = _TOP_LOGPROBS.search(body)
    if found is None:
        raise MalformedResponse("the answer has no logprobs.top_logprobs keyed token_id:ID")
    entries = np.array(_TOP_ENTRY.findall(found.group(1)), dtype=bytes).reshape(-1, 3)
    first = np.flatnonzero(entries[:, 0] == b"{")
    if len(first) != positions or (positions and first[0] != 0):
        raise MalformedResponse(f"{len(first)} top_logprobs positions for a {positions}-token answer")
    return FlatPromptLogprobs(
        starts=np.append(first, len(entries)).astype(np.int64),
        ids=_int64(entries[:, 1]),
        logprobs=entries[:, 2].astype(np.float64).astype(np.float32),
        ranks=np.full(len(entries), MISSING_RANK, dtype=np.int64),
        null_at=np.zeros(0, dtype=np.int64),
    )


def scored_answer(body: bytes, prompt: np.ndarray, answer: np.ndarray, *, k: int, vocab_size: int) -> dict:
    """The sparse arrays of prompt + answer from the generating request alone: the prompt's positions
    from `prompt_logprobs`, the answer's from `logprobs`, put end to end as one prompt's entries (what a
    second request scoring prompt + answer would answer) and converted as any served answer."""
    prompt_part = parse_prompt_logprobs(body)
    answer_part = answer_top_logprobs(body, positions=len(answer))
    flat = FlatPromptLogprobs(
        starts=np.concatenate([prompt_part.starts[:-1], answer_part.starts + prompt_part.starts[-1]]),
        ids=np.concatenate([prompt_part.ids, answer_part.ids]),
        logprobs=np.concatenate([prompt_part.logprobs, answer_part.logprobs]),
        ranks=np.concatenate([prompt_part.ranks, answer_part.ranks]),
        null_at=prompt_part.null_at,
    )
    return flat_to_sparse(flat, np.concatenate([prompt, answer]), k=k, vocab_size=vocab_size)
