"""Distillation loss for a teacher whose tokenizer differs from the student's.

The data side aligns the teacher's and the student's tokenizations of the same text into groups of
tokens that cover the same bytes, and hands over, flattened over the P student positions of a
micro-batch (rows of the student's logits z [P, V_s]; position p predicts the student's next token
target_ids[p]), one `AlignedTargets`:

  - 1:1 groups (P1 positions, `exact_pos`): one teacher token and one student token, same bytes after the
    same text. There both models predict the same thing, so the teacher's next-token distribution is
    comparable to the student's. It is stored sparsely as in `losses` (E entries + a tail per position),
    each entry carrying the student id of its token through the exact vocabulary map (same bytes), or -1.
  - many-token groups (1:n, n:1, n:m; G of them): the teacher's and the student's next-token distributions
    are over different units, so only the probability each gives to the observed chain of bytes is
    compared (C chain positions, `chain_pos`/`chain_group`).

1:1 positions get the hybrid of TRL's GOLD trainer: the exact KL on the matched vocabulary (bucketed as
{each mapped token} + {everything else}) plus the Universal Logit Distillation distance (Boizard et al.
2024) on the sorted probabilities of the rest. Many-token groups get the binary KL between the teacher's
and the student's probabilities of the observed chain of bytes.

    kd = (1/P) [sum_j w exact_j + uld_weight * sum_j w uld_j + sum_g w chain_g]

The mean is over all P student positions, as in `losses`, so this and a same-tokenizer teacher's
`kd_term` add up on one scale. Temperature is not supported (T = 1). Nothing teacher-vocabulary-sized
is built and nothing loops in Python. The formulas, the weights and the numerics in full:
docs/architecture.md, "The losses in detail".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from logitstore.streaming.targets import AlignedTargets
from logitstore.trainer.config import is_real
from logitstore.trainer.losses import (
    LOG_TINY,
    MASKED_LOGIT,
    TINY,
    as_floats,
    normalise,
    segment_logsumexp,
    segment_sum,
)

_LN2 = math.log(2.0)


def aligned_kd(
    student_logits: Tensor, targets: AlignedTargets, *, uld_weight: float = 1.0
) -> tuple[Tensor, dict[str, float]]:
    """The cross-tokenizer KD term, a scalar with grad, and parts {"kd", "exact", "uld", "chain"} as floats
    (one device sync; `aligned_kd_terms` gives them as tensors)."""
    kd, parts = aligned_kd_terms(student_logits, targets, uld_weight=uld_weight)
    return kd, as_floats(parts)


def aligned_kd_terms(
    student_logits: Tensor, targets: AlignedTargets, *, uld_weight: float = 1.0, total: int | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """`aligned_kd` with its parts as detached scalar tensors. `total`: the mean's denominator instead of
    P (a chunk of a larger batch passes the batch's)."""
    _check_shapes(student_logits, targets)
    if not is_real(uld_weight) or not 0 <= uld_weight < math.inf:
        raise ValueError(f"uld_weight must be a finite number >= 0; got {uld_weight!r}")
    t = targets
    logits = student_logits.float()  # fp32 math even for bf16 logits
    n = total or max(t.n_positions, 1)  # an empty micro-batch gives 0, not NaN
    w = t.weight.float() if t.weight is not None else torch.ones(t.n_positions, device=logits.device)
    lse = torch.logsumexp(logits, dim=-1)

    exact, uld = _one_to_one_terms(logits, lse, t)
    w_exact = w[t.exact_pos]
    exact = (w_exact * exact).sum() / n
    uld = (w_exact * uld).sum() / n
    chain = (_chain_weights(w, t) * _chain_terms(logits, lse, t)).sum() / n
    kd = exact + uld_weight * uld + chain
    return kd, {"kd": kd.detach(), "exact": exact.detach(), "uld": uld.detach(), "chain": chain.detach()}


def _one_to_one_terms(logits: Tensor, lse: Tensor, t: AlignedTargets) -> tuple[Tensor, Tensor]:
    """[P1] exact and uld terms of the 1:1 positions."""
    n1 = int(t.exact_pos.shape[0])
    mapped = t.entry_ids >= 0
    # Teacher: entries then tails renormalised to sum 1 per position, as in `losses`.
    pos = torch.cat([t.entry_pos, torch.arange(n1, device=logits.device)])
    raw_p = torch.cat([t.entry_logprobs.float().clamp_min(LOG_TINY), t.tail.float().clamp_min(TINY).log()])
    log_p = normalise(raw_p, pos, n=n1)
    log_p_entries, log_p_tail = log_p[: len(t.entry_pos)], log_p[len(t.entry_pos) :]

    # Student rows of the 1:1 positions with each position's mapped ids masked: their logsumexp gives r_S,
    # their topk the sorted unmapped probabilities. Only the rows needed are copied, and the unmasked copy
    # is dropped at once: the masked one is the single [P1, V_s] tensor kept for the backward.
    m_pos, m_ids = t.entry_pos[mapped], t.entry_ids[mapped]
    masked_logit = torch.tensor(MASKED_LOGIT, dtype=logits.dtype, device=logits.device)
    masked = logits[t.exact_pos].index_put((m_pos, m_ids), masked_logit)
    lse_rows = lse[t.exact_pos]
    log_r_s = (torch.logsumexp(masked, dim=-1) - lse_rows).clamp_min(LOG_TINY)

    # exact: the mapped buckets, then the rest bucket on both sides.
    log_q_mapped = logits[t.exact_pos[m_pos], m_ids] - lse_rows[m_pos]
    log_p_mapped = log_p_entries[mapped]
    mapped_terms = segment_sum(log_p_mapped.exp() * (log_p_mapped - log_q_mapped), m_pos, n=n1)
    # r_T from the teacher's own rest (unmapped entries + tail), not 1 - sum p: accurate however small.
    unmapped = ~mapped
    log_r_t = segment_logsumexp(
        torch.cat([log_p_entries[unmapped], log_p_tail]),
        torch.cat([t.entry_pos[unmapped], torch.arange(n1, device=logits.device)]),
        n=n1,
    )
    exact = mapped_terms + log_r_t.exp() * (log_r_t - log_r_s)

    # uld: rank each position's unmapped entries by descending probability (a stable sort by probability,
    # then a stable sort by position keeps that order inside each position), scatter them to [P1, k].
    u_pos, u_p = t.entry_pos[unmapped], log_p_entries[unmapped].exp()
    counts = torch.bincount(u_pos, minlength=n1)
    k = int(counts.max()) if n1 > 0 else 0  # topk needs k on the host
    by_p = torch.argsort(u_p, descending=True, stable=True)
    order = by_p[torch.argsort(u_pos[by_p], stable=True)]
    u_pos, u_p = u_pos[order], u_p[order]
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(u_pos), device=logits.device) - starts[u_pos]
    u = torch.zeros(n1, k, dtype=u_p.dtype, device=logits.device).index_put((u_pos, rank), u_p)
    # The student's unmapped probabilities in descending order; past its vocabulary, padding zeros.
    k_s = min(k, masked.shape[-1])
    v = (torch.topk(masked, k_s, dim=-1).values - lse_rows[:, None]).exp()
    v = torch.nn.functional.pad(v, (0, k - k_s))
    in_rank = torch.arange(k, device=logits.device)[None, :] < counts[:, None]
    ranked = torch.where(in_rank, (u - v).abs(), 0.0).sum(-1)
    v_ranked = torch.where(in_rank, v, 0.0).sum(-1)
    # The student's mass past rank k_j; a rounding below 0 would only be noise.
    student_rest = (log_r_s.exp() - v_ranked).clamp_min(0.0)
    uld = ranked + (log_p_tail.exp() - student_rest).abs()
    return exact, uld


def _chain_terms(logits: Tensor, lse: Tensor, t: AlignedTargets) -> Tensor:
    """[G] binary KL(Bern(P_T) || Bern(P_S)) per many-token group."""
    g = int(t.chain_teacher_logprob.shape[0])
    log_q = logits[t.chain_pos, t.target_ids[t.chain_pos]] - lse[t.chain_pos]
    log_ps = segment_sum(log_q, t.chain_group, n=g)
    # A quantized teacher log-prob may land just above 0 or below log(1e-30); the clamp keeps P_T in [0, 1].
    log_pt = t.chain_teacher_logprob.float().clamp(LOG_TINY, 0.0)
    log_p = torch.stack([log_pt, _log1mexp(log_pt)])
    # log P_S is not clamped: a student far below the teacher on the chain keeps its gradient.
    log_q = torch.stack([log_ps, _log1mexp(log_ps)])
    return (log_p.exp() * (log_p - log_q)).sum(0)


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, clamped to >= log(1e-30)."""
    # At x = 0 (P = 1 in fp32) the value is -inf and its gradient infinite: evaluate just below 0
    # instead, where the clamp passes no gradient back (0, not 0 * inf = NaN).
    x = x.clamp_max(-TINY)
    near = x > -_LN2
    # Each branch sees only inputs where it is stable; the other gets -ln2 (finite in both), so the
    # unselected branch's gradient is 0 rather than 0 * inf.
    a = torch.log(-torch.expm1(torch.where(near, x, -_LN2)))
    b = torch.log1p(-torch.exp(torch.where(near, -_LN2, x)))
    return torch.where(near, a, b).clamp_min(LOG_TINY)


def _chain_weights(w: Tensor, t: AlignedTargets) -> Tensor:
    """[G] the weight of each group's first chain position (chain_group is non-decreasing)."""
    g = int(t.chain_teacher_logprob.shape[0])
    first = torch.ones_like(t.chain_group, dtype=torch.bool)
    first[1:] = t.chain_group[1:] != t.chain_group[:-1]
    return torch.zeros(g, dtype=w.dtype, device=w.device).index_put((t.chain_group[first],), w[t.chain_pos[first]])


def _check_shapes(logits: Tensor, t: AlignedTargets) -> None:
    """Mismatched arrays are a caller's bug; fail with the shapes rather than a scatter error."""
    n = t.n_positions
    if logits.ndim != 2 or logits.shape[0] != n:
        raise ValueError(f"student_logits must be [P, V] with P = {n} positions; got {tuple(logits.shape)}")
    if t.weight is not None and tuple(t.weight.shape) != (n,):
        raise ValueError(f"weight must be [P] with P = {n}; got {tuple(t.weight.shape)}")
    n1 = {tuple(t.exact_pos.shape), tuple(t.tail.shape)}
    if len(n1) != 1 or len(next(iter(n1))) != 1:
        raise ValueError(f"exact_pos and tail must be [P1] each; got {sorted(n1)}")
    n_entries = {tuple(t.entry_ids.shape), tuple(t.entry_logprobs.shape), tuple(t.entry_pos.shape)}
    if len(n_entries) != 1 or len(next(iter(n_entries))) != 1:
        raise ValueError(f"entry arrays must be [E] each; got {sorted(n_entries)}")
    if t.chain_teacher_logprob.ndim != 1:
        raise ValueError(f"chain_teacher_logprob must be [G]; got {tuple(t.chain_teacher_logprob.shape)}")
    n_chain = {tuple(t.chain_pos.shape), tuple(t.chain_group.shape)}
    if len(n_chain) != 1 or len(next(iter(n_chain))) != 1:
        raise ValueError(f"chain_pos and chain_group must be [C] each; got {sorted(n_chain)}")
