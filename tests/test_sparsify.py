"""Entry selection (top-k, top-p, sampled) against dense references, padding dropped."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from logitstore.format import codec
from logitstore.format.sparsity import DEFAULT_SAMPLED, DEFAULT_TOPK, Sparsity, default_sparsity
from logitstore.pipelines.sparsify import to_samples
from logitstore.pipelines.teacher import SparseBatch

V, K = 50, 10


def dense_batch(*, rows=2, positions=6, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(rows, positions, V)) * 2
    logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    order = np.argsort(-logprobs, axis=-1)[..., :K]
    top = np.take_along_axis(logprobs, order, axis=-1)
    tail = -np.expm1(np.logaddexp.reduce(top, axis=-1))
    batch = SparseBatch(
        ids=torch.as_tensor(order, dtype=torch.int32),
        logprobs=torch.as_tensor(top, dtype=torch.float32),
        target_logprob=torch.as_tensor(logprobs[..., 0], dtype=torch.float32),
        tail=torch.as_tensor(tail, dtype=torch.float32),
    )
    return batch, logprobs


def quantized(values, grid):
    """`values` as the store keeps them: on the value grid."""
    return codec.dequantize(codec.quantize(np.asarray(values, dtype=np.float32), params=grid), params=grid)


def convert(batch, sparsity, lengths=(7, 4)):
    tokens = [np.zeros(n, dtype=np.int64) for n in lengths]
    return to_samples(batch, sample_ids=["a", "b"], lengths=np.array(lengths), input_ids=tokens, sparsity=sparsity)


def test_topk_drops_padding_positions():
    batch, _ = dense_batch()
    s = convert(batch, Sparsity(k=K))
    assert len(s.n_entries) == 6 + 3 and (s.n_entries == K).all()
    np.testing.assert_array_equal(s.entry_ids[:K], batch.ids[0, 0].numpy())
    np.testing.assert_array_equal(s.entry_ids[6 * K : 7 * K], batch.ids[1, 0].numpy())


@pytest.mark.parametrize("p", [0.3, 0.7, 0.95])
def test_top_p_keeps_the_shortest_prefix_and_moves_the_rest_to_the_tail(p):
    batch, dense = dense_batch()
    s = convert(batch, Sparsity(mode="topp", k=K, p=p), lengths=(7, 7))
    sorted_p = np.exp(-np.sort(-dense, axis=-1)).reshape(-1, V)
    expected_n = np.minimum((np.cumsum(sorted_p, axis=1) < p).sum(axis=1) + 1, K)
    np.testing.assert_array_equal(s.n_entries, expected_n)
    expected_tail = 1 - np.take_along_axis(np.cumsum(sorted_p, axis=1), expected_n[:, None] - 1, axis=1)[:, 0]
    # stored on the value grid: the log of the tail within the grid's bound (all tails here are above -5 nats)
    grid = Sparsity().grid
    assert np.abs(np.log(s.tail) - np.log(expected_tail)).max() <= grid.error_bound_fine + 1e-6


def test_sampled_draws_become_distinct_ids_with_counts():
    draws = torch.tensor([[[3, 1, 3, 3], [2, 2, 2, 2]]], dtype=torch.int32)
    lp = torch.log(torch.tensor([[[0.5, 0.1, 0.5, 0.5], [0.9, 0.9, 0.9, 0.9]]]))
    batch = SparseBatch(ids=draws, logprobs=lp, target_logprob=torch.zeros(1, 2), tail=torch.tensor([[0.4, 0.1]]))
    s = to_samples(
        batch,
        sample_ids=["a"],
        lengths=np.array([3]),
        input_ids=[np.zeros(3, dtype=np.int64)],
        sparsity=Sparsity(mode="sampled", n=4),
    )
    assert s.n_entries.tolist() == [2, 1]
    assert s.entry_ids.tolist() == [1, 3, 2] and s.entry_counts.tolist() == [1, 3, 4]
    grid = Sparsity().grid  # log-probabilities come back on the value grid, the store's values
    np.testing.assert_array_equal(s.entry_logprobs, quantized(np.log([0.1, 0.5, 0.9]), grid))


@pytest.mark.parametrize(
    "bad", [dict(k=0), dict(mode="topp", p=0), dict(mode="sampled", n=0), dict(temperature=0), dict(mode="nope")]
)
def test_bad_sparsity_names_the_flag(bad):
    with pytest.raises(ValueError):
        Sparsity(**bad)


def test_the_cli_default_is_sampled_except_where_probabilities_are_needed():
    from logitstore.format.sparsity import SparsityError
    from logitstore.format.sparsity import sparsity_from_flags as _sparsity

    assert DEFAULT_SAMPLED == Sparsity(mode="sampled", n=16) and DEFAULT_TOPK == Sparsity(k=64)
    assert default_sparsity() == DEFAULT_SAMPLED
    assert default_sparsity(student_tokenizers=True) == default_sparsity(engine_samples=False) == DEFAULT_TOPK
    flags = dict(top_k=None, top_p=None, sample=None, temperature=1.0, default=DEFAULT_SAMPLED)
    assert _sparsity(**flags) == DEFAULT_SAMPLED
    assert _sparsity(**{**flags, "temperature": 2.0}) == Sparsity(mode="sampled", n=16, temperature=2.0)
    assert _sparsity(**{**flags, "top_k": 8}) == Sparsity(k=8)
    assert _sparsity(**{**flags, "top_p": 0.9}) == Sparsity(mode="topp", p=0.9, k=64)
    assert _sparsity(**{**flags, "sample": 4}) == Sparsity(mode="sampled", n=4)
    with pytest.raises(SparsityError, match="choose one of --top-k and --sample"):
        _sparsity(**{**flags, "top_k": 8, "sample": 4})


def test_one_default_for_the_cli_the_build_and_live_mode():
    """A config keeps the sparsity as asked; the engine settles the default (`Engine.settle`), once."""
    from logitstore.format.sparsity import SparsityFlags
    from logitstore.live.config import LiveConfig
    from logitstore.pipelines.build import BuildConfig
    from logitstore.pipelines.engines import engine_class
    from logitstore.pipelines.workers import worker_settings

    def settled(cfg: BuildConfig) -> Sparsity:  # no teacher needed: these engines settle without one
        return engine_class(cfg.engine).settle(worker_settings(cfg, teacher_spec=None)).settings.stored

    assert LiveConfig().sparsity == BuildConfig().sparsity == SparsityFlags()  # unset: the engine's default
    assert LiveConfig.from_flags("default").sparsity == SparsityFlags()  # train --live-teacher default
    assert BuildConfig(sparsity=SparsityFlags(top_k=8)).sparsity == Sparsity(k=8)  # flags that name one: settled
    assert settled(BuildConfig()) == DEFAULT_SAMPLED
    assert settled(BuildConfig(engine="vllm")) == DEFAULT_SAMPLED  # vLLM draws through its hidden states
    top_k_only = BuildConfig(engine="vllm", vllm_output="logprobs")  # prompt log-probabilities: top-k only
    assert settled(top_k_only) == DEFAULT_TOPK == settled(BuildConfig(student_tokenizers=("gpt2",)))
    assert settled(BuildConfig(sparsity=SparsityFlags(temperature=2.0))) == Sparsity(
        mode="sampled", n=16, temperature=2.0
    )
    assert settled(BuildConfig(sparsity=Sparsity(k=8), student_tokenizers=("gpt2",))) == Sparsity(k=8)


def test_sparsity_round_trips_through_teacher_metadata_with_its_grid():
    from logitstore.format.grid import GRIDS
    from logitstore.format.sparsity import SparsityError, sparsity_from_flags

    for setting in (
        Sparsity(k=8),
        Sparsity(mode="topp", p=0.9, k=32, temperature=2.0),
        Sparsity(mode="sampled", n=16, grid=GRIDS["coarse"]),
    ):
        assert Sparsity.from_meta(setting.to_json(), setting.grid) == setting
    assert Sparsity(mode="sampled", n=16).to_json() == {"mode": "sampled", "n": 16, "temperature": 1.0}
    assert Sparsity(mode="topp", p=0.9, k=32).describe() == "top-p 0.9 (cap 32)"
    fine = sparsity_from_flags(top_k=8, top_p=None, sample=None, temperature=1.0, default=DEFAULT_SAMPLED, grid="fine")
    assert fine.grid == GRIDS["fine"] and fine.k == 8
    with pytest.raises(SparsityError, match="--value-grid must be one of default, fine, coarse"):
        sparsity_from_flags(top_k=8, top_p=None, sample=None, temperature=1.0, default=DEFAULT_SAMPLED, grid="odd")
    with pytest.raises(SparsityError, match="sparsity mode must be one of topk, topp, sampled"):
        Sparsity.from_meta({"mode": "dense"})


@pytest.mark.parametrize("grid_name", ["default", "fine", "coarse"])
def test_the_devices_grid_codes_are_the_codecs(grid_name):
    """The selection quantizes where the logits are; its codes must be the codec's own, bit for bit: at
    every code's value, at every tie between two codes, past the floor, and at infinities and NaN."""
    from logitstore.format.grid import GRIDS, Q_MAX
    from logitstore.pipelines.sparsify import quantize

    grid = GRIDS[grid_name]
    values = codec.dequantize(np.arange(Q_MAX + 1, dtype=np.uint16), params=grid)
    finite = values[np.isfinite(values)]
    ties = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    edges = np.array([0.0, -0.0, 1e-7, 3.0, -1e-30, grid.floor, grid.floor * 2, -1e38, -np.inf, np.inf, np.nan])
    values = np.concatenate([values, ties, -rng.exponential(8.0, 10_000), edges]).astype(np.float32)
    device = quantize(torch.from_numpy(values), grid)
    assert device.dtype == torch.int32
    np.testing.assert_array_equal(device.numpy(), codec.quantize(values, params=grid).astype(np.int32))


@pytest.mark.parametrize(
    "sparsity", [Sparsity(k=K), Sparsity(mode="topp", k=K, p=0.7), Sparsity(mode="sampled", n=K)], ids=str
)
def test_only_the_real_positions_leave_the_device_in_stored_types(sparsity):
    from logitstore.pipelines.sparsify import on_device, real_positions

    batch, _ = dense_batch()
    lengths = np.array([7, 4])
    positions = torch.from_numpy(real_positions(lengths, batch.ids.shape[1]))
    selected = on_device(batch, positions=positions, sparsity=sparsity)
    tensors = selected.tensors()
    assert {name: t.shape[0] for name, t in tensors.items()} == dict.fromkeys(tensors, 6 + 3)
    assert selected.ids.dtype == torch.int32
    assert {selected.codes.dtype, selected.tail.dtype, selected.target.dtype} == {torch.int16}  # uint16 bits
    assert (selected.n_entries is None) == (sparsity.mode == "topk")
    assert (selected.counts is None) == (not sparsity.sampled)
    if not sparsity.sampled:  # the second sample's first position follows the first sample's six
        np.testing.assert_array_equal(selected.ids[6].numpy(), batch.ids[1, 0].numpy())


def test_distinct_draws_on_the_device_match_a_per_row_count():
    from logitstore.pipelines.sparsify import to_samples

    rng = np.random.default_rng(1)
    draws = rng.integers(0, 6, size=(3, 5, 8))  # few ids: many repeats
    logprobs = np.log(np.arange(1, 7) / 21.0)[draws]  # an id's log-probability is the same wherever drawn
    batch = SparseBatch(
        ids=torch.as_tensor(draws, dtype=torch.int32),
        logprobs=torch.as_tensor(logprobs, dtype=torch.float32),
        target_logprob=torch.zeros(3, 5),
        tail=torch.full((3, 5), 0.25),
    )
    lengths = np.array([6, 3, 5])
    s = to_samples(
        batch,
        sample_ids=["a", "b", "c"],
        lengths=lengths,
        input_ids=[np.zeros(n, dtype=np.int64) for n in lengths],
        sparsity=Sparsity(mode="sampled", n=8),
    )
    rows = [draws[b, t] for b, n in enumerate(lengths) for t in range(n - 1)]  # the real positions, in order
    expected = [np.unique(row, return_counts=True) for row in rows]
    assert s.n_entries.tolist() == [len(ids) for ids, _ in expected]
    assert s.entry_ids.tolist() == [i for ids, _ in expected for i in ids.tolist()]
    assert s.entry_counts.tolist() == [c for _, counts in expected for c in counts.tolist()]
    grid = Sparsity().grid
    np.testing.assert_array_equal(s.entry_logprobs, quantized(np.log(np.arange(1, 7) / 21.0)[s.entry_ids], grid))


@pytest.mark.parametrize(
    "sparsity",
    [Sparsity(k=K), Sparsity(mode="topp", k=K, p=0.7), Sparsity(mode="sampled", n=K)],
    ids=str,
)
def test_torchs_kernels_select_what_numpys_do(sparsity):
    """A GPU runs the selection in torch's kernels, the CPU in numpy's and numba's: run here on the same
    batch (padding included), they must give the same ids, codes, counts and entries per position."""
    from logitstore.pipelines.sparsify import real_positions, select_numpy, select_torch

    batch, _ = dense_batch(rows=3, positions=7, seed=2)
    if sparsity.sampled:  # draws: few distinct ids, repeats, each with its own log-probability
        batch.ids = batch.ids % 4
        batch.logprobs = torch.log((batch.ids.float() + 1) / 10)
    positions = real_positions(np.array([8, 3, 6]), batch.ids.shape[1])
    with_torch = select_torch(batch, positions=torch.from_numpy(positions), sparsity=sparsity).tensors()
    with_numpy = select_numpy(batch, positions=positions, sparsity=sparsity).tensors()
    assert with_torch.keys() == with_numpy.keys()
    for name, tensor in with_torch.items():
        assert tensor.dtype == with_numpy[name].dtype, name
        np.testing.assert_array_equal(tensor.numpy(), with_numpy[name].numpy(), err_msg=name)
