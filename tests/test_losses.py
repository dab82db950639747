"""Distillation losses against dense float64 references built from the definitions in
`logitstore.trainer.losses` (buckets built densely here, in the test only)."""

from __future__ import annotations

import math

import pytest
import torch

from logitstore.streaming.targets import SparseTargets
from logitstore.trainer.config import LOSS_NAMES, LossConfig
from logitstore.trainer.losses import ce_term, distill_loss, kd_term

V, P, K = 40, 7, 5
TINY = 1e-30
VARYING_K = [0, 1, 3, 5, 12, V, 2]  # includes a position with no entries and one with everything stored


def _teacher_logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(P, V, generator=g, dtype=torch.float64) * 2.5


def _student_logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(P, V, generator=g) * 2.0).requires_grad_()


def _targets(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randint(0, V, (P,), generator=g), g


def _sparsify(teacher: torch.Tensor, ks: list[int], *, noise: float = 0.0, seed: int = 0) -> SparseTargets:
    """Top-k_t entries per position (in a shuffled order), the exact tail, and optional quantization noise."""
    lp = torch.log_softmax(teacher, dim=-1)
    target_ids, g = _targets(seed)
    order = lp.argsort(dim=-1, descending=True)
    ids = [order[t, : ks[t]][torch.randperm(ks[t], generator=g)] for t in range(P)]
    stored = torch.zeros(P, V, dtype=torch.bool)
    for t in range(P):
        stored[t, ids[t]] = True
    entry_ids = torch.cat(ids)
    entry_pos = torch.repeat_interleave(torch.arange(P), torch.tensor(ks))
    entry_lp = lp[entry_pos, entry_ids]
    entry_lp = entry_lp + noise * (2 * torch.rand(len(entry_lp), generator=g, dtype=torch.float64) - 1)
    tail = torch.where(stored, 0.0, lp.exp()).sum(-1)  # summed directly: exact however small
    return SparseTargets(
        entry_ids=entry_ids,
        entry_logprobs=entry_lp.float(),
        entry_pos=entry_pos,
        tail=tail.float(),
        target_ids=target_ids,
        target_logprobs=lp[torch.arange(P), target_ids].float(),
    )


def _sampled(teacher: torch.Tensor, *, n_draws: int, generator: torch.Generator) -> SparseTargets:
    """n_draws draws per position (row of `teacher`) from the teacher, stored as distinct ids with counts."""
    lp = torch.log_softmax(teacher, dim=-1)
    rows = len(lp)
    draws = torch.multinomial(lp.exp(), n_draws, replacement=True, generator=generator)
    counts = torch.zeros_like(lp).scatter_add_(1, draws, torch.ones_like(draws, dtype=lp.dtype))
    entry_pos, entry_ids = counts.nonzero(as_tuple=True)  # row-major: positions non-decreasing
    target_ids = torch.randint(0, V, (rows,), generator=generator)
    return SparseTargets(
        entry_ids=entry_ids,
        entry_logprobs=lp[entry_pos, entry_ids].float(),
        entry_pos=entry_pos,
        tail=(1 - torch.where(counts > 0, lp.exp(), 0.0).sum(-1)).float(),
        target_ids=target_ids,
        target_logprobs=lp[torch.arange(rows), target_ids].float(),
        entry_counts=counts[entry_pos, entry_ids].float(),
        n_draws=n_draws,
    )


def _dense_rows(t: SparseTargets, values: torch.Tensor, *, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-entry array scattered densely ([rows, V] float64) and the stored mask."""
    stored = torch.zeros(rows, V, dtype=torch.bool)
    stored[t.entry_pos, t.entry_ids] = True
    dense = torch.zeros(rows, V, dtype=torch.float64)
    dense[t.entry_pos, t.entry_ids] = values.double()
    return dense, stored


def _dense(t: SparseTargets, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _dense_rows(t, values, rows=P)


def _masked_lse(x: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(torch.where(present, x, -math.inf), dim=-1, keepdim=True)


def reference(z: torch.Tensor, t: SparseTargets, cfg: LossConfig) -> torch.Tensor:
    """Dense float64 loss from the module docstring's definitions, over V + 1 buckets per position
    (one per token, the last for the tail; a token in the tail has an empty bucket of its own)."""
    T = cfg.temperature
    z = z.double()
    ce = -torch.log_softmax(z, -1)[torch.arange(P), t.target_ids].mean()
    log_q_full = torch.log_softmax(z / T, dim=-1)
    lp, stored = _dense(t, t.entry_logprobs)
    if t.entry_counts is not None:
        counts, _ = _dense(t, t.entry_counts)
        n = counts.sum(-1, keepdim=True) if t.n_draws is None else t.n_draws
        kd = torch.where(stored, counts / n * (lp - log_q_full), 0.0).sum(-1)
        return T**2 * (_weight(t) * kd).mean() + cfg.alpha * ce
    q_tail = torch.where(stored, 0.0, log_q_full.exp()).sum(-1, keepdim=True)  # 1 - sum q_i, summed directly
    log_q = torch.cat([log_q_full, q_tail.clamp_min(TINY).log()], dim=-1)
    log_p = torch.cat([lp, t.tail.double().clamp_min(TINY).log()[:, None]], dim=-1) / T
    present = torch.cat([stored, torch.full((P, 1), cfg.kind != "topk_renorm")], dim=-1)
    log_p = log_p - _masked_lse(log_p, present)
    if cfg.kind == "topk_renorm":
        log_q = log_q - _masked_lse(log_q, present)
    # Double where: empty buckets are 0 in value and gradient, never 0 * inf.
    log_p, log_q = torch.where(present, log_p, 0.0), torch.where(present, log_q, 0.0)
    p, q = log_p.exp(), log_q.exp()
    if cfg.kind in ("forward_kl", "topk_renorm"):
        terms = p * (log_p - log_q)
    elif cfg.kind == "reverse_kl":
        terms = q * (log_q - log_p)
    else:
        b = cfg.jsd_beta
        m = b * p + (1 - b) * q
        terms = b * p * (log_p - m.log()) + (1 - b) * q * (log_q - m.log())
    kd = torch.where(present, terms, 0.0).sum(-1)
    return T**2 * (_weight(t) * kd).mean() + cfg.alpha * ce


def _weight(t: SparseTargets) -> torch.Tensor:
    """[P] float64 position weights of the KD term (1 without weights); the CE term has none."""
    return torch.ones(P, dtype=torch.float64) if t.weight is None else t.weight.double()


def _loss_and_grad(fn, z: torch.Tensor) -> tuple[float, torch.Tensor]:
    z = z.detach().clone().requires_grad_()
    out = fn(z)
    loss = out[0] if isinstance(out, tuple) else out
    (grad,) = torch.autograd.grad(loss, z)
    assert torch.isfinite(grad).all()
    return float(loss.detach()), grad.double()


def _assert_matches_reference(z: torch.Tensor, t: SparseTargets, cfg: LossConfig, *, tol: float = 1e-5) -> None:
    got, got_grad = _loss_and_grad(lambda x: distill_loss(x, t, cfg), z)
    want, want_grad = _loss_and_grad(lambda x: reference(x, t, cfg), z.double())
    assert got == pytest.approx(want, abs=tol)
    assert (got_grad - want_grad).abs().max() < tol


LAYOUTS = {
    "topk": lambda teacher: _sparsify(teacher, [K] * P, noise=0.01),
    "varying": lambda teacher: _sparsify(teacher, VARYING_K, noise=0.01),
    "exact_topk": lambda teacher: _sparsify(teacher, [K] * P),
}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.5])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", LOSS_NAMES)
def test_matches_dense_reference(kind, layout, temperature):
    seed = LOSS_NAMES.index(kind) + 10 * sorted(LAYOUTS).index(layout)
    t = LAYOUTS[layout](_teacher_logits(seed))
    cfg = LossConfig(kind=kind, temperature=temperature, alpha=0.25, jsd_beta=0.3 if kind == "jsd" else 0.5)
    _assert_matches_reference(_student_logits(seed), t, cfg)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_forward_kl_with_everything_stored_is_the_full_kl(temperature):
    teacher = _teacher_logits(3)
    t = _sparsify(teacher, [V] * P)
    assert float(t.tail.abs().max()) == 0.0
    # exact tempered teacher: no tail to approximate
    _assert_equals_full_kl(t, torch.log_softmax(teacher / temperature, dim=-1), temperature, _student_logits(3))


def _assert_equals_full_kl(t, p_log, temperature, z):
    """distill_loss on `t` equals T^2 KL(p || softmax(z / T)) against the dense `p_log`, value and gradient."""
    T = temperature

    def full_kl(z):
        return T**2 * (p_log.exp() * (p_log - torch.log_softmax(z.double() / T, dim=-1))).sum(-1).mean()

    got, got_grad = _loss_and_grad(lambda x: distill_loss(x, t, LossConfig(temperature=T)), z)
    want, want_grad = _loss_and_grad(full_kl, z.double())
    assert got == pytest.approx(want, abs=1e-5)
    assert (got_grad - want_grad).abs().max() < 1e-5


def test_student_equal_to_teacher_has_zero_loss_and_gradient():
    teacher = _teacher_logits(4)
    t = _sparsify(teacher, [V] * P)
    loss, grad = _loss_and_grad(lambda x: distill_loss(x, t, LossConfig()), teacher.float())
    assert abs(loss) < 1e-6
    assert grad.abs().max() < 1e-6


def test_temperature_scales_by_t_squared():
    """Same tempered distributions on both sides, so the KD term differs only by the factor T^2."""
    teacher = _teacher_logits(5)
    z = _student_logits(5)
    t2, t1 = _sparsify(teacher * 2, [V] * P), _sparsify(teacher, [V] * P)
    _, hot = distill_loss(z * 2, t2, LossConfig(temperature=2.0))
    _, cold = distill_loss(z, t1, LossConfig(temperature=1.0))
    assert hot["kd"] == pytest.approx(4 * cold["kd"], rel=1e-5)


def test_alpha_adds_cross_entropy_on_the_actual_next_token():
    teacher = _teacher_logits(6)
    t = _sparsify(teacher, [K] * P)
    z = _student_logits(6)
    _, parts0 = distill_loss(z, t, LossConfig(temperature=2.0))
    loss, parts = distill_loss(z, t, LossConfig(temperature=2.0, alpha=0.7))
    ce = torch.nn.functional.cross_entropy(z.double(), t.target_ids).item()  # temperature 1
    assert parts["ce"] == pytest.approx(ce, abs=1e-5)
    assert parts0["ce"] == pytest.approx(ce, abs=1e-5)  # reported even when alpha is 0
    assert parts["kd"] == pytest.approx(parts0["kd"], abs=1e-6)
    assert parts["loss"] == pytest.approx(parts0["kd"] + 0.7 * ce, abs=1e-5)
    assert float(loss.detach()) == pytest.approx(parts["loss"], abs=1e-6)
    assert set(parts) == {"kd", "ce", "loss"} and all(isinstance(v, float) for v in parts.values())


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("with_n_draws", [True, False])
def test_sampled_estimator_matches_reference(temperature, with_n_draws):
    t = _sampled(_teacher_logits(7), n_draws=16, generator=torch.Generator().manual_seed(7))
    if not with_n_draws:
        t.n_draws = None  # inferred from the count totals
    _assert_matches_reference(_student_logits(7), t, LossConfig(temperature=temperature, alpha=0.5))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampled_estimator_expectation_is_exact(temperature):
    """The estimator is linear in the counts, so expected counts n * p give its expectation exactly:
    T^2 KL(p || softmax(z / T)), value and gradient."""
    teacher = _teacher_logits(8)
    t = _sparsify(teacher, [V] * P)
    t.n_draws = 8
    t.entry_counts = (8 * t.entry_logprobs.double().exp()).float()
    _assert_equals_full_kl(t, torch.log_softmax(teacher, dim=-1), temperature, _student_logits(8))


def test_sampled_estimator_is_unbiased_over_draws():
    """n_sets independent draw sets in one call (the student repeated once per set): the mean kd over
    the sets is their average, and each set's gradient is its block of rows."""
    teacher, n_sets, n_draws = _teacher_logits(9), 2000, 4
    z = _student_logits(9).detach()
    p_log = torch.log_softmax(teacher, dim=-1)
    dense, dense_grad = _loss_and_grad(
        lambda x: (p_log.exp() * (p_log - torch.log_softmax(x.double(), -1))).sum(-1).mean(), z.double()
    )
    t = _sampled(teacher.repeat(n_sets, 1), n_draws=n_draws, generator=torch.Generator().manual_seed(9))
    mean, grads = _loss_and_grad(lambda x: distill_loss(x, t, LossConfig()), z.repeat(n_sets, 1))
    grads = grads.reshape(n_sets, P, V) * n_sets  # each set's gradient of its own mean over P

    # Each set's estimate, from the definition, only to measure the spread.
    counts, _ = _dense_rows(t, t.entry_counts, rows=n_sets * P)
    log_q = torch.log_softmax(z.double(), -1).repeat(n_sets, 1)
    values = (counts / n_draws * (p_log.repeat(n_sets, 1) - log_q)).sum(-1).reshape(n_sets, P).mean(-1)
    assert mean == pytest.approx(float(values.mean()), abs=1e-5)

    se = float(values.std()) / math.sqrt(n_sets)
    assert se > 1e-3  # one draw set is noisy: the checks below have power
    assert abs(mean - dense) < 4 * se
    grad_se = grads.std(dim=0) / math.sqrt(n_sets)
    # A token never drawn in any set has no spread to measure; its bias is p_v / P for a p_v that all
    # n_sets * n_draws draws missed, so a few / (n_sets * n_draws * P) at most.
    floor = 5 / (n_sets * n_draws * P)
    assert ((grads.mean(dim=0) - dense_grad).abs() <= 5 * grad_se + floor).all()


@pytest.mark.parametrize("kind", ["topk_renorm", "reverse_kl", "jsd"])
def test_sampled_store_refuses_other_kinds(kind):
    t = _sampled(_teacher_logits(10), n_draws=4, generator=torch.Generator().manual_seed(10))
    with pytest.raises(ValueError, match=f"--loss {kind}.*sampled"):
        distill_loss(_student_logits(10), t, LossConfig(kind=kind))


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        ({"kind": "kl"}, "--loss"),
        ({"kind": None}, "--loss"),
        ({"temperature": 0.0}, "--kd-temperature"),
        ({"temperature": -1.0}, "--kd-temperature"),
        ({"temperature": math.inf}, "--kd-temperature"),
        ({"temperature": math.nan}, "--kd-temperature"),
        ({"temperature": "2"}, "--kd-temperature"),
        ({"alpha": -0.1}, "--alpha"),
        ({"alpha": math.nan}, "--alpha"),
        ({"jsd_beta": 0.0}, "--jsd-beta"),
        ({"jsd_beta": 1.0}, "--jsd-beta"),
        ({"jsd_beta": 1.5}, "--jsd-beta"),
    ],
)
def test_invalid_config_names_the_flag(options, flag):
    with pytest.raises(ValueError, match=flag):
        LossConfig(**options)


def test_bf16_logits_are_computed_in_fp32():
    t = _sparsify(_teacher_logits(11), VARYING_K, noise=0.01)
    z = _student_logits(11).detach().bfloat16().requires_grad_()
    loss, parts = distill_loss(z, t, LossConfig(kind="jsd", alpha=0.5))
    _, want = distill_loss(z.detach().float(), t, LossConfig(kind="jsd", alpha=0.5))
    assert parts == pytest.approx(want, abs=1e-6)
    assert loss.dtype == torch.float32
    loss.backward()
    assert z.grad.dtype == torch.bfloat16 and torch.isfinite(z.grad.float()).all()


def test_empty_micro_batch_gives_zero():
    empty_long, empty_float = torch.zeros(0, dtype=torch.long), torch.zeros(0)
    t = SparseTargets(empty_long, empty_float, empty_long, empty_float, empty_long, empty_float)
    z = torch.zeros(0, V, requires_grad=True)
    loss, parts = distill_loss(z, t, LossConfig(alpha=1.0))
    loss.backward()
    assert parts == {"kd": 0.0, "ce": 0.0, "loss": 0.0}


def _position_weights(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + seed)
    w = torch.rand(P, generator=g) * 2
    w[1] = 0.0  # a position this teacher does not cover
    return w


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("kind", LOSS_NAMES)
def test_position_weights_multiply_the_kd_terms_only(kind, temperature):
    t = _sparsify(_teacher_logits(12), VARYING_K, noise=0.01, seed=12)
    t.weight = _position_weights(12)
    cfg = LossConfig(kind=kind, temperature=temperature, alpha=0.4)
    _assert_matches_reference(_student_logits(12), t, cfg)
    _, parts = distill_loss(_student_logits(12), t, cfg)
    ce = torch.nn.functional.cross_entropy(_student_logits(12).detach().double(), t.target_ids).item()
    assert parts["ce"] == pytest.approx(ce, abs=1e-5)  # unweighted


def test_position_weights_on_a_sampled_store():
    t = _sampled(_teacher_logits(13), n_draws=16, generator=torch.Generator().manual_seed(13))
    t.weight = _position_weights(13)
    _assert_matches_reference(_student_logits(13), t, LossConfig(temperature=2.0, alpha=0.5))


def test_unit_weights_change_nothing():
    t = _sparsify(_teacher_logits(14), VARYING_K, noise=0.01, seed=14)
    cfg = LossConfig(kind="jsd", temperature=1.5, alpha=0.3)
    _, unweighted = distill_loss(_student_logits(14), t, cfg)
    t.weight = torch.ones(P)
    _, weighted = distill_loss(_student_logits(14), t, cfg)
    assert weighted == pytest.approx(unweighted, abs=1e-7)


def test_weights_of_the_wrong_shape_are_refused():
    t = _sparsify(_teacher_logits(15), [K] * P)
    t.weight = torch.ones(P + 1)
    with pytest.raises(ValueError, match="weight"):
        distill_loss(_student_logits(15), t, LossConfig())


@pytest.mark.parametrize("weighted", [False, True])
def test_kd_term_and_ce_term_make_up_distill_loss(weighted):
    t = _sparsify(_teacher_logits(16), VARYING_K, noise=0.01, seed=16)
    t.weight = _position_weights(16) if weighted else None
    cfg = LossConfig(kind="reverse_kl", temperature=2.0, alpha=0.6)
    z = _student_logits(16)
    kd, ce = kd_term(z, t, cfg), ce_term(z, t.target_ids)
    _, parts = distill_loss(z, t, cfg)
    assert float(kd.detach()) == pytest.approx(parts["kd"], abs=1e-6)
    assert float(ce.detach()) == pytest.approx(parts["ce"], abs=1e-6)
    _, grad = _loss_and_grad(lambda x: kd_term(x, t, cfg) + cfg.alpha * ce_term(x, t.target_ids), z)
    _, want = _loss_and_grad(lambda x: distill_loss(x, t, cfg), z)
    assert (grad - want).abs().max() < 1e-6
    with pytest.raises(ValueError, match="target_ids"):
        ce_term(z, t.target_ids[:-1])


def test_kd_term_and_ce_term_of_an_empty_micro_batch_are_zero():
    empty_long, empty_float = torch.zeros(0, dtype=torch.long), torch.zeros(0)
    t = SparseTargets(empty_long, empty_float, empty_long, empty_float, empty_long, empty_float, weight=empty_float)
    z = torch.zeros(0, V, requires_grad=True)
    total = kd_term(z, t, LossConfig()) + ce_term(z, t.target_ids)
    total.backward()
    assert float(total.detach()) == 0.0


# -- the chunked head: distill_loss(hidden @ weight.T) without the [P, V] logits ----------------------------


def _chunked_case(t: SparseTargets, cfg: LossConfig, *, chunk: int, seed: int) -> None:
    """Value and gradients (hidden states and weight) of the chunked loss against the dense float64
    reference on the same hidden @ weight.T."""
    from logitstore.trainer.losses import chunked_distill_loss

    g = torch.Generator().manual_seed(3000 + seed)
    d = 6
    hidden = torch.randn(P, d, generator=g)
    weight = torch.randn(V, d, generator=g)

    def grads(fn, dtype):
        h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
        out = fn(h, w)
        loss = out[0] if isinstance(out, tuple) else out
        return (float(loss.detach()), *torch.autograd.grad(loss, (h, w)))

    got = grads(lambda h, w: chunked_distill_loss(h, w, t, cfg, chunk=chunk), torch.float32)
    want = grads(lambda h, w: reference(h @ w.T, t, cfg), torch.float64)
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    for a, b in zip(got[1:], want[1:]):
        assert (a.double() - b).abs().max() < 1e-5


@pytest.mark.parametrize("chunk", [1, 3, P])
@pytest.mark.parametrize("kind", LOSS_NAMES)
def test_chunked_head_matches_the_dense_reference(kind, chunk):
    seed = LOSS_NAMES.index(kind)
    t = LAYOUTS["varying"](_teacher_logits(seed))
    cfg = LossConfig(kind=kind, temperature=1.5, alpha=0.25, jsd_beta=0.3 if kind == "jsd" else 0.5)
    _chunked_case(t, cfg, chunk=chunk, seed=seed)


@pytest.mark.parametrize("with_n_draws", [True, False])
def test_chunked_head_matches_the_reference_on_a_sampled_store(with_n_draws):
    t = _sampled(_teacher_logits(7), n_draws=16, generator=torch.Generator().manual_seed(7))
    if not with_n_draws:
        t.n_draws = None
    _chunked_case(t, LossConfig(temperature=2.0, alpha=0.5), chunk=2, seed=7)


def test_chunked_head_reports_the_same_parts_as_distill_loss():
    from logitstore.trainer.losses import chunked_distill_loss

    t = LAYOUTS["topk"](_teacher_logits(3))
    hidden, weight = torch.randn(P, 6), torch.randn(V, 6)
    cfg = LossConfig(alpha=0.5)
    _, whole = distill_loss(hidden @ weight.T, t, cfg)
    _, chunked = chunked_distill_loss(hidden, weight, t, cfg, chunk=2)
    assert chunked == pytest.approx(whole, abs=1e-5)


def test_chunked_head_under_autocast_multiplies_in_bf16_and_scores_in_fp32():
    # One CUDA rank trains under bf16 autocast: the head's three matmuls must run in bf16 (fp32 ones
    # are ~10x slower on a GPU), the loss on fp32 logits, the gradients in the parameters' dtype.
    from torch.utils._python_dispatch import TorchDispatchMode

    from logitstore.trainer.losses import chunked_distill_loss

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: set[tuple[str, torch.dtype]] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("mm", "addmm_", "logsumexp"):
                self.seen.add((name, args[0].dtype))
            return func(*args, **(kwargs or {}))

    t = LAYOUTS["topk"](_teacher_logits(5))
    hidden = torch.randn(P, 6, generator=torch.Generator().manual_seed(5), requires_grad=True)
    weight = torch.randn(V, 6, generator=torch.Generator().manual_seed(6), requires_grad=True)
    want, _ = chunked_distill_loss(hidden, weight, t, LossConfig(), chunk=3)
    with MatmulDtypes() as mode, torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = chunked_distill_loss(hidden, weight, t, LossConfig(), chunk=3)
        got.backward()
    assert {dtype for name, dtype in mode.seen if name == "mm"} == {torch.bfloat16}
    assert {dtype for name, dtype in mode.seen if name == "logsumexp"} == {torch.float32}
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=2e-2)
