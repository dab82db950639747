"""The cross-tokenizer loss against dense float64 references written from the definitions in
`logitstore.trainer.aligned_losses` (loops over positions and explicit sorts, in the test only)."""

from __future__ import annotations

import math

import pytest
import torch

from logitstore.streaming.targets import AlignedTargets
from logitstore.trainer.aligned_losses import aligned_kd

VT, VS, N_MAPPED = 12, 10, 7  # teacher vocabulary, student vocabulary, tokens in the exact map
P = 10
EXACT_POS = [0, 2, 3, 5, 6, 8]
# How each 1:1 position's entries are chosen: its top k teacher tokens, or a special set.
LAYOUT = [("top", 0), ("top", 3), ("top", VT), ("unmapped", 3), ("mapped_only", None), ("top", 7)]
CHAINS = [[1], [4], [7, 9]]  # many-token groups: their student positions
PARTS = ("exact", "uld", "chain")


def _vocab_map(seed: int, *, vt: int = VT, vs: int = VS, n_mapped: int = N_MAPPED) -> torch.Tensor:
    """[vt] student id of each teacher token, -1 for the unmapped ones: random and injective."""
    g = torch.Generator().manual_seed(500 + seed)
    vmap = torch.full((vt,), -1, dtype=torch.long)
    vmap[torch.randperm(vt, generator=g)[:n_mapped]] = torch.randperm(vs, generator=g)[:n_mapped]
    return vmap


def _student_logits(seed: int, *, rows: int = P, vs: int = VS) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(rows, vs, generator=g) * 2.0).requires_grad_()


def _teacher_logprobs(seed: int, vmap: torch.Tensor, layout: list) -> torch.Tensor:
    """[P1, VT] full teacher log-softmax; a "mapped_only" position puts no mass on unmapped tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(layout), len(vmap), generator=g, dtype=torch.float64) * 2.5
    for j, (kind, _) in enumerate(layout):
        if kind == "mapped_only":
            logits[j, vmap < 0] = -math.inf
    return torch.log_softmax(logits, dim=-1)


def _stored(lp: torch.Tensor, vmap: torch.Tensor, kind: str, k: int | None) -> torch.Tensor:
    """Teacher ids stored at one position, most probable first within the chosen set."""
    order = lp.argsort(descending=True)
    if kind == "top":
        return order[:k]
    if kind == "unmapped":
        return order[vmap[order] < 0][:k]
    return order[vmap[order] >= 0]  # mapped_only: every mapped token, the whole support


def build(
    seed: int,
    *,
    layout: list = LAYOUT,
    exact_pos: list[int] = EXACT_POS,
    chains: list[list[int]] = CHAINS,
    n_positions: int = P,
    vmap: torch.Tensor | None = None,
    vs: int = VS,
    noise: float = 0.0,
    weight: bool = False,
) -> tuple[AlignedTargets, torch.Tensor]:
    """Targets from a random teacher, and its full [P1, VT] log-probabilities (for the textbook checks)."""
    vmap = _vocab_map(seed) if vmap is None else vmap
    lp = _teacher_logprobs(seed, vmap, layout)
    g = torch.Generator().manual_seed(2000 + seed)
    ids, pos, tails = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.long)], []
    for j, (kind, k) in enumerate(layout):
        stored = _stored(lp[j], vmap, kind, k)
        ids.append(stored[torch.randperm(len(stored), generator=g)])  # the store's order is arbitrary
        pos.append(torch.full((len(stored),), j))
        rest = torch.ones(len(vmap), dtype=torch.bool)
        rest[stored] = False
        tails.append(lp[j, rest].exp().sum())  # summed directly: exact however small
    teacher_ids = torch.cat(ids)
    entry_pos = torch.cat(pos)
    entry_lp = lp[entry_pos, teacher_ids]
    entry_lp = entry_lp + noise * (2 * torch.rand(len(entry_lp), generator=g, dtype=torch.float64) - 1)
    chain_pos = torch.tensor([p for c in chains for p in c], dtype=torch.long)
    chain_group = torch.tensor([i for i, c in enumerate(chains) for _ in c], dtype=torch.long)
    # A chain's teacher log-prob: the sum of 1-3 teacher target log-probs, each of them a few nats.
    chain_lp = -(torch.rand(len(chains), 3, generator=g, dtype=torch.float64) * 1.5).sum(-1)
    targets = AlignedTargets(
        target_ids=torch.randint(0, vs, (n_positions,), generator=g),
        exact_pos=torch.tensor(exact_pos, dtype=torch.long),
        entry_ids=vmap[teacher_ids],
        entry_logprobs=entry_lp.float(),
        entry_pos=entry_pos,
        tail=torch.stack(tails).float() if tails else torch.zeros(0),
        chain_teacher_logprob=chain_lp.float(),
        chain_pos=chain_pos,
        chain_group=chain_group,
        weight=torch.rand(n_positions, generator=g) * 2 if weight else None,
    )
    return targets, lp


def _kl_term(p: torch.Tensor, log_p_over_q: torch.Tensor) -> torch.Tensor:
    """p log(p / q) with 0 log 0 = 0 (p is the teacher's: never differentiated)."""
    return torch.where(p > 0, p * log_p_over_q, 0.0)


def reference_terms(z: torch.Tensor, t: AlignedTargets) -> dict[str, list[torch.Tensor]]:
    """Per-term values from the module docstring, densely in float64, one position or group at a time."""
    z = z.double()
    log_q = torch.log_softmax(z, dim=-1)
    q = log_q.exp()
    terms = {"exact": [], "uld": [], "chain": []}
    for j, row in enumerate(t.exact_pos.tolist()):
        at = t.entry_pos == j
        ids = t.entry_ids[at]
        p = t.entry_logprobs[at].double().exp()
        tail = t.tail[j].double()
        total = p.sum() + tail  # renormalised to sum 1 with the tail
        p, tail = p / total, tail / total
        mapped = ids >= 0
        p_m, q_m = p[mapped], q[row, ids[mapped]]
        rest = torch.ones(z.shape[1], dtype=torch.bool)
        rest[ids[mapped]] = False
        r_t = p[~mapped].sum() + tail
        r_s = q[row, rest].sum()
        exact = _kl_term(p_m, p_m.log() - q_m.log()).sum() + _kl_term(r_t, r_t.log() - r_s.log())
        u = torch.sort(p[~mapped], descending=True).values
        v = torch.sort(q[row, rest], descending=True).values
        k = len(u)
        v_k = torch.cat([v[:k], torch.zeros(max(k - len(v), 0), dtype=v.dtype)])  # zero-padded past the vocabulary
        uld = (u - v_k).abs().sum() + (tail - (r_s - v_k.sum())).abs()
        terms["exact"].append(exact)
        terms["uld"].append(uld)
    for gi in range(len(t.chain_teacher_logprob)):
        at = t.chain_pos[t.chain_group == gi]
        log_ps = log_q[at, t.target_ids[at]].sum()
        log_pt = t.chain_teacher_logprob[gi].double()
        p_t, p_s = log_pt.exp(), log_ps.exp()
        terms["chain"].append(p_t * (log_pt - log_ps) + (1 - p_t) * ((1 - p_t).log() - (1 - p_s).log()))
    return terms


def reference(z: torch.Tensor, t: AlignedTargets, *, uld_weight: float = 1.0) -> dict[str, torch.Tensor]:
    """kd and its parts, weighted and divided by P."""
    terms = reference_terms(z, t)
    w = t.weight.double() if t.weight is not None else torch.ones(t.n_positions, dtype=torch.float64)
    first = [int(t.chain_pos[t.chain_group == g][0]) for g in range(len(terms["chain"]))]
    weights = {"exact": w[t.exact_pos], "uld": w[t.exact_pos], "chain": w[first]}
    n = max(t.n_positions, 1)
    parts = {
        name: (torch.stack(terms[name]) * weights[name]).sum() / n if terms[name] else z.double().sum() * 0
        for name in PARTS
    }
    parts["kd"] = parts["exact"] + uld_weight * parts["uld"] + parts["chain"]
    return parts


def _grad(fn, z: torch.Tensor) -> tuple[float, torch.Tensor]:
    z = z.detach().clone().requires_grad_()
    value = fn(z)
    (grad,) = torch.autograd.grad(value, z)
    assert torch.isfinite(grad).all()
    return float(value.detach()), grad.double()


def _assert_matches_reference(z: torch.Tensor, t: AlignedTargets, *, uld_weight: float = 1.0, tol: float = 1e-5):
    _, parts = aligned_kd(z, t, uld_weight=uld_weight)
    want = reference(z.detach(), t, uld_weight=uld_weight)
    for name in ("kd", *PARTS):
        assert parts[name] == pytest.approx(float(want[name]), abs=tol), name
    # The gradient of each part separately (uld_weight 0 and 1 isolate uld), then of the whole.
    got_kd, got_grad = _grad(lambda x: aligned_kd(x, t, uld_weight=uld_weight)[0], z)
    want_kd, want_grad = _grad(lambda x: reference(x, t, uld_weight=uld_weight)["kd"], z.double())
    assert got_kd == pytest.approx(want_kd, abs=tol)
    assert (got_grad - want_grad).abs().max() < tol
    _, got_uld = _grad(lambda x: aligned_kd(x, t, uld_weight=1.0)[0] - aligned_kd(x, t, uld_weight=0.0)[0], z)
    _, want_uld = _grad(lambda x: reference(x, t)["uld"], z.double())
    assert (got_uld - want_uld).abs().max() < tol


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("noise", [0.0, 0.01])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_dense_reference(seed, noise, weight):
    t, _ = build(seed, noise=noise, weight=weight)
    _assert_matches_reference(_student_logits(seed), t)


def test_layout_covers_the_edge_cases():
    """The default layout has a position with no entries, one with none mapped, one with all mapped and
    tail 0, one with every teacher token stored (tail 0), and chains of one and two positions."""
    t, _ = build(0)
    per_pos = [t.entry_ids[t.entry_pos == j] for j in range(len(EXACT_POS))]
    assert len(per_pos[0]) == 0 and float(t.tail[0]) == pytest.approx(1.0)
    assert len(per_pos[3]) > 0 and (per_pos[3] < 0).all()
    assert len(per_pos[4]) == N_MAPPED and (per_pos[4] >= 0).all() and float(t.tail[4]) == 0.0
    assert len(per_pos[2]) == VT and float(t.tail[2]) == 0.0
    assert all((ids[ids >= 0].unique().numel() == (ids >= 0).sum()) for ids in per_pos)  # injective


@pytest.mark.parametrize("uld_weight", [0.0, 0.3, 2.0])
def test_uld_weight_scales_only_the_uld_part(uld_weight):
    t, _ = build(3, weight=True)
    z = _student_logits(3)
    _assert_matches_reference(z, t, uld_weight=uld_weight)
    kd, parts = aligned_kd(z, t, uld_weight=uld_weight)
    assert parts["kd"] == pytest.approx(parts["exact"] + uld_weight * parts["uld"] + parts["chain"], abs=1e-6)
    assert float(kd.detach()) == pytest.approx(parts["kd"], abs=1e-6)
    assert set(parts) == {"kd", *PARTS} and all(isinstance(v, float) for v in parts.values())


# (4, 3): more unmapped teacher tokens (9) than the whole student vocabulary, so topk's k is capped.
@pytest.mark.parametrize(("vs", "n_mapped"), [(VS, N_MAPPED), (4, 3)])
def test_everything_stored_is_exact_kl_plus_textbook_uld(vs, n_mapped):
    """Tail 0: exact is the KL between the bucketed full distributions and uld is ULD's zero-padded
    sorted L1 over the unmatched tokens of both vocabularies, built here from the full distributions."""
    layout = [("top", VT)] * 4
    vmap = _vocab_map(4, vs=vs, n_mapped=n_mapped)
    t, lp = build(4, layout=layout, exact_pos=[0, 1, 2, 3], chains=[], n_positions=4, vmap=vmap, vs=vs)
    assert float(t.tail.abs().max()) == 0.0
    image = vmap[vmap >= 0]
    student_unmatched = torch.ones(vs, dtype=torch.bool)
    student_unmatched[image] = False

    def textbook(z):
        log_q = torch.log_softmax(z.double(), dim=-1)
        q, p = log_q.exp(), lp.exp()
        exact = []
        uld = []
        for j in range(4):
            p_m, lq_m = p[j, vmap >= 0], log_q[j, vmap[vmap >= 0]]
            r_t, r_s = p[j, vmap < 0].sum(), q[j, student_unmatched].sum()
            exact.append((p_m * (p_m.log() - lq_m)).sum() + r_t * (r_t.log() - r_s.log()))
            u = torch.sort(p[j, vmap < 0], descending=True).values
            v = torch.sort(q[j, student_unmatched], descending=True).values
            width = max(len(u), len(v))
            u, v = (torch.nn.functional.pad(x, (0, width - len(x))) for x in (u, v))
            uld.append((u - v).abs().sum())
        return torch.stack(exact).mean(), torch.stack(uld).mean()

    z = _student_logits(4, rows=4, vs=vs)
    _, parts = aligned_kd(z, t)
    want_exact, want_uld = textbook(z.detach())
    assert parts["exact"] == pytest.approx(float(want_exact), abs=1e-5)
    assert parts["uld"] == pytest.approx(float(want_uld), abs=1e-5)
    got, got_grad = _grad(lambda x: aligned_kd(x, t)[0], z)
    want, want_grad = _grad(lambda x: sum(textbook(x)), z.double())
    assert got == pytest.approx(want, abs=1e-5)
    assert (got_grad - want_grad).abs().max() < 1e-5


@pytest.mark.parametrize("k", [0, 1, 3, 6, 9])
def test_uld_with_top_entries_is_a_lower_bound_on_the_sorted_l1_outside_the_mapped_entries(k):
    """The docstring's claim: with the teacher's top k entries stored, uld is at most the zero-padded
    sorted L1 between all of the teacher's and the student's tokens outside the stored mapped ones (the
    tail's tokens rank below the stored ones; one bucket's difference is at most its ranks' sum)."""
    t, lp = build(5, layout=[("top", k)] * 6, chains=[])
    vmap = _vocab_map(5)
    z = _student_logits(5).detach()
    q = torch.softmax(z.double(), dim=-1)
    full = []
    for j, row in enumerate(EXACT_POS):
        stored_mapped = t.entry_ids[(t.entry_pos == j) & (t.entry_ids >= 0)]
        teacher_out = torch.ones(VT, dtype=torch.bool)
        teacher_out[torch.isin(vmap, stored_mapped)] = False
        student_out = torch.ones(VS, dtype=torch.bool)
        student_out[stored_mapped] = False
        u = torch.sort(lp[j, teacher_out].exp(), descending=True).values
        v = torch.sort(q[row, student_out], descending=True).values
        width = max(len(u), len(v))
        u, v = (torch.nn.functional.pad(x, (0, width - len(x))) for x in (u, v))
        full.append((u - v).abs().sum())
    _, parts = aligned_kd(z, t)
    bound = float(sum(full)) / P
    assert parts["uld"] <= bound + 1e-6
    if k == 0:  # no entries: only the tail bucket, |1 - 1| = 0
        assert parts["uld"] == pytest.approx(0.0, abs=1e-6)


def test_student_vocabulary_entirely_mapped():
    """Every student id is in the map: at a position storing all of them the masked logsumexp is over
    nothing (r_S = 0, clamped) and the teacher's rest is empty too (r_T = 0)."""
    n_mapped = 7
    vmap = _vocab_map(15, vs=n_mapped, n_mapped=n_mapped)
    layout = [("mapped_only", None), ("unmapped", 3), ("top", 0)]
    t, _ = build(15, layout=layout, exact_pos=[0, 1, 2], chains=[[3]], n_positions=4, vmap=vmap, vs=n_mapped)
    _assert_matches_reference(_student_logits(15, rows=4, vs=n_mapped), t)


def test_chain_term_is_the_binary_kl_of_the_chain_probabilities():
    t, _ = build(6, chains=[[1], [4, 7], [9, 0, 3]])
    t.weight = torch.zeros(P)
    t.weight[[1, 4, 9]] = torch.tensor([0.5, 2.0, 1.5])  # each group's first position; the others must not count
    t.weight[[7, 0, 3]] = 100.0
    t.weight[t.exact_pos] = 0.0  # the 1:1 terms drop out
    z = _student_logits(6)
    log_q = torch.log_softmax(z.detach().double(), dim=-1)
    want = 0.0
    for g, (group, w) in enumerate(zip([[1], [4, 7], [9, 0, 3]], [0.5, 2.0, 1.5])):
        p_t = math.exp(float(t.chain_teacher_logprob[g]))
        p_s = math.exp(sum(float(log_q[p, t.target_ids[p]]) for p in group))
        want += w * (p_t * math.log(p_t / p_s) + (1 - p_t) * math.log((1 - p_t) / (1 - p_s)))
    _, parts = aligned_kd(z, t)
    assert parts["chain"] == pytest.approx(want / P, rel=1e-5)
    assert parts["exact"] == 0.0 and parts["uld"] == 0.0
    _assert_matches_reference(z, t)


def test_terms_are_non_negative():
    """Each term alone (a one-hot weight picks one position's terms) on random inputs, noise included."""
    for seed in range(4):
        t, _ = build(10 + seed, noise=0.01, chains=[[1], [4], [7, 9]])
        z = _student_logits(10 + seed) * (1 + seed)
        for p in range(P):
            t.weight = torch.nn.functional.one_hot(torch.tensor(p), P).float()
            _, parts = aligned_kd(z, t)
            assert all(parts[name] >= -1e-7 for name in PARTS), (seed, p, parts)


def test_student_matching_the_teacher_on_a_chain_has_zero_chain_term():
    t, _ = build(7, chains=[[1], [4, 7]])
    z = _student_logits(7).detach()
    log_q = torch.log_softmax(z.double(), dim=-1)
    t.chain_teacher_logprob = torch.stack(
        [log_q[1, t.target_ids[1]], log_q[4, t.target_ids[4]] + log_q[7, t.target_ids[7]]]
    ).float()
    _, parts = aligned_kd(z, t)
    assert abs(parts["chain"]) < 1e-6


def test_no_one_to_one_positions():
    t, _ = build(8, layout=[], exact_pos=[], chains=[[0, 1], [2], [3, 4, 5]], n_positions=6)
    _assert_matches_reference(_student_logits(8, rows=6), t)
    assert aligned_kd(_student_logits(8, rows=6), t)[1]["exact"] == 0.0


def test_no_chains():
    t, _ = build(9, chains=[], weight=True)
    _assert_matches_reference(_student_logits(9), t)
    assert aligned_kd(_student_logits(9), t)[1]["chain"] == 0.0


def test_empty_micro_batch_gives_zero():
    t, _ = build(0, layout=[], exact_pos=[], chains=[], n_positions=0)
    z = torch.zeros(0, VS, requires_grad=True)
    kd, parts = aligned_kd(z, t)
    kd.backward()
    assert parts == {"kd": 0.0, "exact": 0.0, "uld": 0.0, "chain": 0.0}
    assert z.grad.shape == (0, VS)


def test_extreme_inputs_give_finite_values_and_gradients():
    """Saturated student logits (probabilities exactly 0 and 1 in fp32), a teacher certain of a chain
    (log P_T = 0), one far from it, log-probs of -inf and just above 0 from quantization."""
    t, _ = build(11, chains=[[1], [4], [7, 9]])
    t.chain_teacher_logprob = torch.tensor([0.0, -500.0, 1e-3])
    t.entry_logprobs[0] = -math.inf
    for scale in (1e2, 1e4):
        z = _student_logits(11).detach() * scale
        z[1, t.target_ids[1]] = 10 * scale  # P_S = 1 exactly on the first chain: log(1 - P_S) = -inf unclamped
        z[4, t.target_ids[4]] = -10 * scale  # P_S = 0 exactly on the second
        z.requires_grad_()
        kd, parts = aligned_kd(z, t, uld_weight=0.5)
        kd.backward()
        assert all(math.isfinite(v) for v in parts.values()), parts
        assert all(parts[name] >= -1e-6 for name in PARTS), parts
        assert torch.isfinite(z.grad).all()


def test_bf16_logits_are_computed_in_fp32():
    t, _ = build(12, noise=0.01, weight=True)
    z = _student_logits(12).detach().bfloat16().requires_grad_()
    kd, parts = aligned_kd(z, t)
    _, want = aligned_kd(z.detach().float(), t)
    assert parts == pytest.approx(want, abs=1e-6)
    assert kd.dtype == torch.float32
    kd.backward()
    assert z.grad.dtype == torch.bfloat16 and torch.isfinite(z.grad.float()).all()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("tail", torch.zeros(2), "exact_pos and tail"),
        ("entry_pos", torch.zeros(1, dtype=torch.long), "entry arrays"),
        ("chain_group", torch.zeros(1, dtype=torch.long), "chain_pos and chain_group"),
        ("chain_teacher_logprob", torch.zeros(3, 1), "chain_teacher_logprob"),
        ("weight", torch.ones(P + 1), "weight"),
        ("target_ids", torch.zeros(P + 1, dtype=torch.long), "student_logits"),
    ],
)
def test_mismatched_shapes_are_refused_with_the_shapes(field, value, match):
    t, _ = build(13)
    setattr(t, field, value)
    with pytest.raises(ValueError, match=match):
        aligned_kd(_student_logits(13), t)


@pytest.mark.parametrize("uld_weight", [-1.0, math.inf, math.nan, "1", True])
def test_invalid_uld_weight_is_refused(uld_weight):
    t, _ = build(14)
    with pytest.raises(ValueError, match="uld_weight"):
        aligned_kd(_student_logits(14), t, uld_weight=uld_weight)
