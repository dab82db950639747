"""Samples read back against the samples written: same ids per position, values within the codec's
documented error bounds."""

from __future__ import annotations

import numpy as np

from logitstore.format.samples import SparseSamples


def assert_samples_close(
    got: SparseSamples, expected: SparseSamples, *, bound: float, bound_fine: float, coarse_below: float
) -> None:
    """Same ids per position (in any order), values within the codec's documented bounds."""
    assert got.n_tokens.tolist() == expected.n_tokens.tolist()
    np.testing.assert_array_equal(got.input_ids, expected.input_ids)
    np.testing.assert_array_equal(got.n_entries, expected.n_entries)
    g, e = _by_position_and_id(got), _by_position_and_id(expected)
    np.testing.assert_array_equal(got.entry_ids[g], expected.entry_ids[e])
    _assert_logprobs_close(got.entry_logprobs[g], expected.entry_logprobs[e], bound, bound_fine, coarse_below)
    _assert_logprobs_close(got.target_logprobs, expected.target_logprobs, bound, bound_fine, coarse_below)
    with np.errstate(divide="ignore"):
        _assert_logprobs_close(np.log(got.tail), np.log(np.clip(expected.tail, 0, 1)), bound, bound_fine, coarse_below)
    if expected.entry_counts is not None:
        assert got.entry_counts is not None, "the written samples have entry counts, the read ones none"
        np.testing.assert_array_equal(got.entry_counts[g], expected.entry_counts[e])


def _by_position_and_id(s: SparseSamples) -> np.ndarray:
    return np.lexsort((s.entry_ids, np.repeat(np.arange(len(s.n_entries)), s.n_entries)))


def _assert_logprobs_close(got, expected, bound, bound_fine, coarse_below):
    expected = np.minimum(np.asarray(expected, dtype=np.float64), 0)
    got = np.asarray(got, dtype=np.float64)
    finite = np.isfinite(expected)
    assert (np.isneginf(got) == ~finite).all(), "minus infinity must round-trip exactly"
    err = np.abs(got[finite] - expected[finite])
    limit = np.where(expected[finite] >= coarse_below, bound_fine, bound) + 1e-5
    assert (err <= limit).all(), f"max error {err.max()} beyond the documented bound"
