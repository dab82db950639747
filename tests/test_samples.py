"""Bad sample arrays are refused with a message that names the problem."""

from __future__ import annotations

import numpy as np
import pytest

from logitstore.errors import InvalidSampleError
from logitstore.testing.synthetic import random_samples


def _fresh():
    return random_samples(["a", "b"], k=4, min_tokens=3, max_tokens=8)


def _break(field, value):
    def apply(s):
        setattr(s, field, value(s) if callable(value) else value)

    return apply


CASES = {
    "wrong shape": (_break("tail", lambda s: s.tail[:-1]), "tail has"),
    "2-d": (_break("entry_ids", lambda s: s.entry_ids.reshape(1, -1)), "1-D"),
    "float ids": (_break("entry_ids", lambda s: s.entry_ids.astype(np.float32)), "integer dtype"),
    "id outside vocabulary": (
        _break("entry_ids", lambda s: np.where(np.arange(len(s.entry_ids)) == 0, 1000, s.entry_ids)),
        "outside the vocabulary",
    ),
    "negative input id": (
        _break("input_ids", lambda s: np.where(np.arange(len(s.input_ids)) == 1, -1, s.input_ids)),
        "outside the vocabulary",
    ),
    "nan": (
        _break(
            "entry_logprobs",
            lambda s: np.where(np.arange(len(s.entry_logprobs)) == 2, np.nan, s.entry_logprobs).astype(np.float32),
        ),
        "NaN",
    ),
    "positive": (_break("target_logprobs", lambda s: np.abs(s.target_logprobs) + 0.5), "positive"),
    "tail above one": (_break("tail", lambda s: s.tail + 2), "tail"),
    "duplicate entry": (
        _break("entry_ids", lambda s: np.where(np.arange(len(s.entry_ids)) == 1, s.entry_ids[0], s.entry_ids)),
        "appears twice",
    ),
    "duplicate sample id": (_break("sample_ids", ["a", "a"]), "appears twice in one write"),
    "too short": (_break("n_tokens", lambda s: np.array([1, s.n_tokens.sum() - 1])), "at least 2"),
    "empty id": (_break("sample_ids", ["", "b"]), "non-empty"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_samples_are_refused(case):
    breaker, message = CASES[case]
    s = _fresh()
    breaker(s)
    with pytest.raises(InvalidSampleError, match=message):
        s.validate(vocab_size=1000)


def test_valid_samples_pass_and_select_round_trips():
    s = _fresh()
    s.validate(vocab_size=1000)
    one = s.select(1)
    assert one.sample_ids == ["b"] and one.n_tokens.tolist() == [s.n_tokens[1]]
    assert len(one.entry_ids) == one.n_entries.sum()


@pytest.mark.parametrize("mode", ["topk", "topp", "sampled"])
def test_cut_gives_each_fragment_as_a_sample_of_its_own(mode):
    """`cut` (the one cut of `SparseSamples`: live mode's pieces, a mix's fragments) equals slicing each
    sample alone: tokens [a, b), positions [a, b - 1), their entries, in the order asked."""
    samples = random_samples([f"s{i}" for i in range(6)], k=5, min_tokens=2, max_tokens=30, mode=mode, seed=3)
    samples.loss_mask = (np.arange(int(samples.n_tokens.sum())) % 3 == 0).astype(np.uint8)
    rng = np.random.default_rng(0)
    which = rng.integers(0, len(samples), 20)
    a = np.array([rng.integers(0, samples.n_tokens[i]) for i in which])
    b = np.array([rng.integers(lo + 1, samples.n_tokens[i] + 1) for lo, i in zip(a, which)])
    got = samples.cut(which, a, b)
    for k, (i, lo, hi) in enumerate(zip(which.tolist(), a.tolist(), b.tolist())):
        one, want = got.select(k), samples.select(i)
        e = want.entry_offsets
        assert one.sample_ids == want.sample_ids and one.n_tokens.tolist() == [hi - lo]
        np.testing.assert_array_equal(one.input_ids, want.input_ids[lo:hi])
        np.testing.assert_array_equal(one.loss_mask, want.loss_mask[lo:hi])
        np.testing.assert_array_equal(one.n_entries, want.n_entries[lo : hi - 1])
        np.testing.assert_array_equal(one.tail, want.tail[lo : hi - 1])
        np.testing.assert_array_equal(one.target_logprobs, want.target_logprobs[lo : hi - 1])
        np.testing.assert_array_equal(one.entry_ids, want.entry_ids[e[lo] : e[hi - 1]])
        np.testing.assert_array_equal(one.entry_logprobs, want.entry_logprobs[e[lo] : e[hi - 1]])
        if mode == "sampled":
            np.testing.assert_array_equal(one.entry_counts, want.entry_counts[e[lo] : e[hi - 1]])
