"""Synthetic teacher outputs: real log-softmax distributions from random logits.

For tests and benchmarks that need many valid samples quickly; real teacher output comes from
`logitstore.pipelines.teacher`.
"""

from __future__ import annotations

import numpy as np

from logitstore.format.samples import SparseSamples


def random_samples(
    sample_ids: list[str],
    *,
    seed: int = 0,
    vocab: int = 1000,
    min_tokens: int = 2,
    max_tokens: int = 60,
    k: int = 8,
    mode: str = "topk",
) -> SparseSamples:
    """Real log-softmax distributions over `vocab` from random logits; top-k, top-p-capped or sampled."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_tokens, max_tokens + 1, len(sample_ids))
    parts: dict[str, list] = {
        name: [] for name in ("input_ids", "n_entries", "entry_ids", "entry_logprobs", "tail", "target", "counts")
    }
    for T in lengths:
        tokens = rng.integers(0, vocab, T)
        logits = rng.normal(size=(T - 1, vocab)) * rng.uniform(0.5, 6, size=(T - 1, 1))
        logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        parts["input_ids"].append(tokens)
        parts["target"].append(logprobs[np.arange(T - 1), tokens[1:]])
        for row in logprobs:
            ids, counts = _pick_entries(rng, row, k=k, mode=mode)
            parts["n_entries"].append([len(ids)])
            parts["entry_ids"].append(ids)
            parts["entry_logprobs"].append(row[ids])
            parts["tail"].append([max(0.0, -np.expm1(np.logaddexp.reduce(row[ids])))])
            parts["counts"].append(counts)
    cat = lambda name, dtype: np.concatenate(parts[name]).astype(dtype) if parts[name] else np.zeros(0, dtype)
    return SparseSamples(
        sample_ids=list(sample_ids),
        n_tokens=lengths.astype(np.int64),
        input_ids=cat("input_ids", np.int64),
        n_entries=cat("n_entries", np.int64),
        entry_ids=cat("entry_ids", np.int64),
        entry_logprobs=cat("entry_logprobs", np.float32),
        tail=cat("tail", np.float32),
        target_logprobs=cat("target", np.float32),
        entry_counts=cat("counts", np.int64) if mode == "sampled" else None,
    )


def _pick_entries(rng, row: np.ndarray, *, k: int, mode: str):
    if mode == "sampled":
        draws = rng.choice(len(row), size=k, p=np.exp(row) / np.exp(row).sum())
        ids, counts = np.unique(draws, return_counts=True)
        return ids, counts
    k = min(k, len(row))
    top = np.argpartition(-row, k - 1)[:k]
    top = top[np.argsort(-row[top])].copy()  # a copy: a view would keep the whole argsort alive
    if mode == "topk":
        return top, None
    cum = np.cumsum(np.exp(row[top]))
    return top[: int(np.searchsorted(cum, 0.9)) + 1].copy(), None
