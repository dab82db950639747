"""The codec round trip and its documented error bound, on hand-picked edges and on hypothesis data."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logitstore.format import codec
from logitstore.format.codec import dequantize, quantize
from logitstore.format.grid import GRIDS, Q_MAX, CodecParams
from logitstore.format.samples import SparseSamples
from logitstore.testing.samples import assert_samples_close
from logitstore.testing.synthetic import random_samples

PARAMS = CodecParams()


def _round_trip(samples, params=PARAMS, vocab=1000):
    order = (
        codec.frequency_id_order(samples.entry_ids, vocab_size=vocab)
        if params.id_order == "frequency"
        else codec.identity_order(vocab)
    )
    enc = codec.encode(samples, params=params, code_of_id=order.astype(np.int64), vocab_size=vocab)
    return codec.decode(enc, params=params, id_of_code=codec.invert_permutation(order), n_tokens=samples.n_tokens)


def _assert_bound(got, expected, params=PARAMS):
    assert_samples_close(
        got, expected, bound=params.error_bound, bound_fine=params.error_bound_fine, coarse_below=params.coarse_below
    )


@pytest.mark.parametrize("mode", ["topk", "topp", "sampled"])
@pytest.mark.parametrize("id_order", ["frequency", "identity"])
def test_round_trip_within_bound(mode, id_order):
    samples = random_samples([f"s{i}" for i in range(7)], mode=mode, k=16)
    params = CodecParams(id_order=id_order)
    _assert_bound(_round_trip(samples, params), samples, params)


@pytest.mark.parametrize("grid", sorted(GRIDS))
@pytest.mark.parametrize("mode", ["topk", "topp", "sampled"])
def test_every_named_grid_round_trips_within_its_bound(grid, mode):
    """The grids the frontier benchmark compares, each held to its own documented bound."""
    params = GRIDS[grid]
    samples = random_samples([f"s{i}" for i in range(5)], mode=mode, k=24, seed=3)
    _assert_bound(_round_trip(samples, params), samples, params)
    lp = -np.random.default_rng(0).exponential(8.0, size=5000).astype(np.float32)
    lp = lp[lp >= params.floor]
    err = np.abs(dequantize(quantize(lp, params=params), params=params).astype(np.float64) - lp)
    assert (err <= np.where(lp >= params.coarse_below, params.error_bound_fine, params.error_bound) + 1e-5).all()


def test_values_below_the_floor_stay_finite():
    params = GRIDS["fine"]
    back = dequantize(
        quantize(np.array([params.floor - 50.0, -np.inf], dtype=np.float32), params=params), params=params
    )
    assert back[0] == pytest.approx(params.floor, abs=1e-3) and np.isneginf(back[1])


def test_quantize_edges():
    lp = np.array([0.0, -0.0249, -0.025, -4.99, -5.0, -5.2, -30.0, -np.inf, 1e-6], dtype=np.float32)
    back = dequantize(quantize(lp, params=PARAMS), params=PARAMS)
    assert back[0] == 0.0 and np.isneginf(back[7]) and back[8] == 0.0
    fine = lp[:5]
    assert np.all(np.abs(back[:5] - fine) <= PARAMS.error_bound_fine + 1e-6)
    assert np.all(np.abs(back[5:7] - lp[5:7]) <= PARAMS.error_bound + 1e-6)


def test_tail_of_zero_and_one_round_trip_exactly():
    samples = random_samples(["a"], k=4)
    samples.tail[:] = 0.0
    samples.tail[0] = 1.0
    got = _round_trip(samples)
    assert got.tail[0] == 1.0 and (got.tail[1:] == 0.0).all()


def test_codes_are_sorted_and_delta_coded_per_position():
    samples = random_samples(["a", "b"], k=8)
    order = codec.identity_order(1000).astype(np.int64)
    enc = codec.encode(samples, params=CodecParams(id_order="identity"), code_of_id=order, vocab_size=1000)
    starts = samples.entry_offsets[:-1]
    first = enc.entry_codes[starts].astype(np.int64)
    # Within a position every later delta is a positive gap; across positions the first is absolute.
    rest = np.ones(len(enc.entry_codes), bool)
    rest[starts] = False
    assert (enc.entry_codes[rest] > 0).all()
    expected_first = [np.sort(samples.entry_ids[a:b])[0] for a, b in zip(starts, samples.entry_offsets[1:])]
    np.testing.assert_array_equal(first, expected_first)


@pytest.mark.parametrize("vocab", [1000, 151_936])  # uint16 and uint32 gaps
def test_decode_entries_is_the_running_sum_and_the_grid_in_one_pass(vocab):
    # The stream's decode (one numba pass, int64 ids) against the definition: per position, the running
    # sum of the gaps is the code, the id order maps code -> id, the grid maps code -> log-probability.
    samples = random_samples(["a", "b", "c"], vocab=vocab, k=16)
    params = CodecParams()
    code_of_id = np.random.default_rng(0).permutation(vocab).astype(np.uint32)
    enc = codec.encode(samples, params=params, code_of_id=code_of_id, vocab_size=vocab)
    offsets = samples.entry_offsets
    ids, logprobs = codec.decode_entries(
        enc.entry_codes, enc.entry_logprobs, offsets, id_of_code=codec.invert_permutation(code_of_id), params=params
    )
    assert ids.dtype == np.int64 and logprobs.dtype == np.float32
    codes = np.concatenate([np.cumsum(enc.entry_codes[a:b], dtype=np.int64) for a, b in zip(offsets[:-1], offsets[1:])])
    np.testing.assert_array_equal(ids, codec.invert_permutation(code_of_id)[codes])
    np.testing.assert_array_equal(logprobs, dequantize(enc.entry_logprobs, params=params))
    by_position = [np.sort(ids[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    expected = [np.sort(samples.entry_ids[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    for got, want in zip(by_position, expected):  # the entries' ids themselves, in code order
        np.testing.assert_array_equal(got, want)


def test_frequency_order_is_a_permutation_with_frequent_ids_first():
    ids = np.array([7, 7, 7, 3, 3, 9])
    code = codec.frequency_id_order(ids, vocab_size=12)
    assert sorted(code.tolist()) == list(range(12))
    assert code[7] == 0 and code[3] == 1 and code[9] == 2
    np.testing.assert_array_equal(codec.invert_permutation(code)[code], np.arange(12))


def test_large_vocabulary_uses_uint32_ids():
    samples = random_samples(["a"], vocab=70_000, k=4, max_tokens=5)
    assert codec.id_dtype(70_000) == np.uint32
    _assert_bound(_round_trip(samples, vocab=70_000), samples)


@pytest.mark.parametrize(
    "bad",
    [
        dict(fine_step=0),
        dict(fine_step=0.5, coarse_step=0.1),
        dict(coarse_below=1.0),
        dict(coarse_below=-5.01),
        dict(id_order="random"),
    ],
)
def test_invalid_params_are_refused(bad):
    with pytest.raises(ValueError):
        CodecParams(**bad)


@settings(max_examples=60, deadline=None)
@given(
    lp=st.lists(st.floats(min_value=-200, max_value=0, allow_nan=False, width=32), min_size=1, max_size=300),
    fine=st.sampled_from([0.01, 0.05, 0.1, 0.25]),
    ratio=st.sampled_from([1, 2, 10]),
    levels=st.integers(min_value=0, max_value=200),
)
def test_quantize_bound_property(lp, fine, ratio, levels):
    params = CodecParams(fine_step=fine, coarse_step=fine * ratio, coarse_below=-levels * fine)
    x = np.array(lp, dtype=np.float32)
    err = np.abs(dequantize(quantize(x, params=params), params=params).astype(np.float64) - x)
    limit = np.where(x >= params.coarse_below, params.error_bound_fine, params.error_bound)
    assert (err <= limit + 1e-4).all()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=6),
    k=st.integers(min_value=1, max_value=40),
    mode=st.sampled_from(["topk", "topp", "sampled"]),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_round_trip_property(n, k, mode, seed):
    samples = random_samples([f"s{i}" for i in range(n)], seed=seed, vocab=300, k=k, mode=mode, max_tokens=20)
    _assert_bound(_round_trip(samples, vocab=300), samples)


def _quantize_numpy(logprobs, *, params):
    """The grid as numpy formulas (the form `quantize` had before its numba kernel): the reference."""
    x = np.maximum(-np.asarray(logprobs, dtype=np.float64), 0)
    split = -params.coarse_below
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.where(
            x <= split, np.rint(x / params.fine_step), params.fine_levels + np.rint((x - split) / params.coarse_step)
        )
    q_max = Q_MAX
    return np.where(np.isinf(x), q_max, np.minimum(np.nan_to_num(q, posinf=q_max - 1), q_max - 1)).astype(np.uint16)


@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_quantize_equals_the_numpy_formulas_code_for_code(grid):
    params = GRIDS[grid]
    rng = np.random.default_rng(0)
    steps = np.arange(70_000)
    edges = [
        0.0,
        -0.0,
        1e-5,
        1e-4,
        -np.inf,
        np.inf,
        np.nan,
        -1e-20,
        -1e300,
        -1e308,
        params.coarse_below,
        params.coarse_below - params.fine_step / 2,
        params.floor,
        params.floor - params.coarse_step / 2,
    ]
    values = np.concatenate(
        [
            rng.normal(0, 30, 100_000),
            -np.abs(rng.normal(0, 1e6, 1000)),
            edges,
            -steps * params.fine_step,
            -(steps + 0.5) * params.fine_step,
            params.coarse_below - steps * params.coarse_step / 2,
        ]
    )
    for dtype in (np.float64, np.float32):
        with np.errstate(over="ignore"):  # 1e300 as float32 is infinite
            typed = values.astype(dtype)
        np.testing.assert_array_equal(quantize(typed, params=params), _quantize_numpy(typed, params=params))


def test_encode_finds_a_duplicate_entry_and_names_it():
    from logitstore.errors import InvalidSampleError

    samples = random_samples(["a", "b"], k=8)
    position = 3
    start = samples.entry_offsets[position]
    samples.entry_ids[start + 5] = samples.entry_ids[start + 1]
    with pytest.raises(
        InvalidSampleError,
        match=rf"token id {samples.entry_ids[start + 1]} appears twice among the "
        rf"entries of position {position}",
    ):
        codec.encode(samples, params=PARAMS, code_of_id=codec.identity_order(1000), vocab_size=1000)


def test_encode_orders_every_position_as_a_stable_sort_by_code():
    """Entries of each position in code order, values with them, at every size: the counting sort of short
    positions and the sort of long ones (past `_RANK_SORT_MAX`) against numpy's stable argsort."""
    rng = np.random.default_rng(3)
    vocab = 70_000
    n_entries = np.array([0, 1, 2, 17, 64, 255, 256, 257, 300], dtype=np.int64)
    ids = np.concatenate([rng.choice(vocab, size=n, replace=False) for n in n_entries])
    samples = SparseSamples(
        sample_ids=["a"],
        n_tokens=np.array([len(n_entries) + 1]),
        input_ids=np.zeros(len(n_entries) + 1, dtype=np.int64),
        n_entries=n_entries,
        entry_ids=ids,
        entry_logprobs=-rng.exponential(3.0, len(ids)).astype(np.float32),
        tail=np.full(len(n_entries), 0.1, dtype=np.float32),
        target_logprobs=np.zeros(len(n_entries), dtype=np.float32),
        entry_counts=rng.integers(1, 9, len(ids)),
    )
    code_of_id = rng.permutation(vocab).astype(np.uint32)
    enc = codec.encode(samples, params=PARAMS, code_of_id=code_of_id, vocab_size=vocab)
    offsets = samples.entry_offsets
    for a, b in zip(offsets[:-1], offsets[1:]):  # one position at a time: the reference
        order = a + np.argsort(code_of_id[ids[a:b]], kind="stable")
        codes = code_of_id[ids[order]].astype(np.int64)
        np.testing.assert_array_equal(enc.entry_codes[a:b], np.diff(codes, prepend=0))
        np.testing.assert_array_equal(
            enc.entry_logprobs[a:b], codec.quantize(samples.entry_logprobs[order], params=PARAMS)
        )
        np.testing.assert_array_equal(enc.entry_counts[a:b], samples.entry_counts[order])
