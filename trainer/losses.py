"""Distillation losses on the teacher's stored sparse entries.

One call covers every supervised position of a micro-batch, flattened: P positions, E stored teacher
entries in all. The student's logits z [P, V] exist anyway and are used directly; the teacher side
stays sparse (per-entry and per-position arrays only). Every per-position sum is a segment sum over
`entry_pos` (`index_add`), so no dense [P, V] teacher tensor is ever built and nothing loops in Python.

Each position's stored entries and one tail bucket for every other token are compared with the
student's softmax over the same buckets (the tail as a masked logsumexp, accurate however small):

    forward_kl   sum_b p_b (log p_b - log q_b)            (default) a lower bound on the full KL
    topk_renorm  both sides renormalised over the stored entries only, no tail bucket
    reverse_kl   sum_b q_b (log q_b - log p_b)
    jsd          beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q  (`--jsd-beta`)

    loss = (1/P) sum_t w_t T^2 kd_t + alpha * mean_t ce_t        (w_t = 1 without weights)

A sampled store's draw counts give forward_kl's unbiased estimator (Anshumann et al. 2025); the other
kinds refuse them. `kd_term` and `ce_term` give the two terms apart, for a trainer that sums several
teachers' KD terms (this one's and `aligned_losses.aligned_kd`'s) with one CE term; `distill_loss` is
their sum. Numerics: fp32 throughout, log space, logs of masses below 1e-30 clamped to log(1e-30).

The buckets, the temperature's one-bucket tail approximation, the sampled estimator, the position
weights and the numerics in full: docs/architecture.md, "The losses in detail".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from logitstore.streaming.targets import SparseTargets
from logitstore.trainer.config import LOSS_NAMES, LossConfig, LossConfigError, LossName

TINY = 1e-30
LOG_TINY = math.log(TINY)
# Written over the student's log-probabilities at the stored ids before the tail's logsumexp: far below
# any real one, yet finite, so a position whose entries cover the whole vocabulary gives a finite
# logsumexp and a finite (zero) gradient instead of exp(-inf - -inf) = NaN.
MASKED_LOGIT = -1e30


def distill_loss(student_logits: Tensor, targets: SparseTargets, cfg: LossConfig) -> tuple[Tensor, dict[str, float]]:
    """Mean over positions. Returns (loss, parts) with parts {"kd", "ce", "loss"} as python floats (one
    device sync; `distill_terms` gives them as tensors)."""
    loss, values = distill_terms(student_logits, targets, cfg)
    return loss, as_floats(values)


def distill_terms(
    student_logits: Tensor, targets: SparseTargets, cfg: LossConfig, *, total: int | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """`distill_loss` with its parts as detached scalar tensors on the logits' device: nothing is read
    back. `total`: the mean's denominator (default: these targets' positions; a chunk of a larger batch
    passes the batch's, so the chunks' values add up to the batch's)."""
    _check_shapes(student_logits, targets)
    logits = student_logits.float()  # fp32 math even for bf16 logits; converted once for both terms
    log_q = student_log_softmax(logits)  # the KD's (at temperature 1) and the CE's
    kd = _kd_term(logits, targets, cfg, total=total, log_q=log_q)
    if cfg.alpha > 0:
        ce = _ce_term(logits, targets.target_ids, total=total, log_q=log_q)
        loss = kd + cfg.alpha * ce
    else:
        with torch.no_grad():  # reported only: no [P, V] gradient of zeros to carry back
            ce = _ce_term(logits, targets.target_ids, total=total, log_q=log_q)
        loss = kd
    return loss, {"kd": kd.detach(), "ce": ce.detach(), "loss": loss.detach()}


def as_floats(values: dict[str, Tensor]) -> dict[str, float]:
    """Scalar tensors as python floats, read back in one device sync."""
    if not values:
        return {}
    return dict(zip(values, torch.stack([v.float() for v in values.values()]).tolist()))


def chunked_distill_loss(
    hidden: Tensor, weight: Tensor, targets: SparseTargets, cfg: LossConfig, *, chunk: int | None = None
) -> tuple[Tensor, dict[str, float]]:
    """`distill_loss(hidden @ weight.T, targets, cfg)`, the same value and gradients, without the [P, V]
    logits: the head is applied `chunk` positions at a time (default `CHUNK_ELEMENTS // V`), and each
    chunk's loss and gradients are computed at once and its logits let go (Liger-kernel's fused linear
    cross-entropy, for every loss here). hidden [P, d] (the final hidden states at the supervised
    positions), weight [V, d] (the output embedding). Memory: one chunk's logits, their gradient and the
    loss's temporaries instead of [P, V] several times over. Parts as floats (one device sync)."""
    n = targets.n_positions
    if hidden.ndim != 2 or hidden.shape[0] != n or weight.ndim != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"hidden must be [P, d] with P = {n} and weight [V, d]; got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    bounds = chunk_bounds(n, chunk=chunk or chunk_positions(weight))
    slice_at = position_slicer(targets, bounds)
    total = max(n, 1)
    loss, parts = chunked_head_loss(
        hidden, weight, lambda logits, a, b: distill_terms(logits, slice_at(a, b), cfg, total=total), bounds=bounds
    )
    return loss, {"kd": 0.0, "ce": 0.0, "loss": 0.0, **as_floats(parts)}  # an empty micro-batch: zeros


def chunk_positions(weight: Tensor) -> int:
    """Positions per chunk for a head of `weight` [V, d]: `CHUNK_ELEMENTS` logits."""
    return max(1, CHUNK_ELEMENTS // weight.shape[0])


def chunk_bounds(n: int, *, chunk: int, allowed=None) -> list[tuple[int, int]]:
    """[a, b) spans of about `chunk` positions covering [0, n); with `allowed` (a bool array over the
    cut points 0..n), every cut is an allowed one (the nearest at or below the size, else the next)."""
    ok = np.flatnonzero(np.ones(n + 1, dtype=bool) if allowed is None else allowed)
    bounds, a = [], 0
    while a < n:  # one step per chunk
        below = ok[(ok > a) & (ok <= a + chunk)]
        b = int(below[-1]) if len(below) else int(ok[ok > a][0])
        bounds.append((a, b))
        a = b
    return bounds


def chunked_head_loss(
    hidden: Tensor, weight: Tensor, loss_of_chunk, *, bounds: list[tuple[int, int]]
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of the logits `hidden @ weight.T`, computed a chunk of positions at a time:
    `loss_of_chunk(logits [b - a, V] fp32, a, b)` gives (the chunk's share of the loss, its parts, "loss" among them, as
    scalar tensors, their shares likewise, read with grad off); the result is their sum over the chunks,
    the parts likewise (detached tensors on the device: nothing is read back), and the gradients of
    hidden and weight. Only one chunk's logits exist at a time."""
    parts: dict[str, Tensor] = {}
    loss = _ChunkedHead.apply(hidden, weight, loss_of_chunk, bounds, parts)
    return loss, parts


# Elements of one chunk's [positions, V] logits in the chunked head: 64M, 256 MB in fp32. With their
# gradient and the loss's temporaries a chunk holds about 1 GB, far below what a step's activations take
# at the sizes that need chunking (the whole [P, V] at seq 2048 x 8 and 49k tokens: 805M logits, 3.2 GB
# a copy in fp32), while the per-chunk work (~60 ops and launches) is spread over 64M logits.
CHUNK_ELEMENTS = 1 << 26


class _ChunkedHead(torch.autograd.Function):
    """Forward computes each chunk's loss and its gradients with respect to the hidden states and the
    weight (autograd on the chunk alone, so every loss kind is exact); backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, loss_of_chunk, bounds, parts):
        device = hidden.device.type
        # The matmuls in the forward's compute dtype (bf16 under autocast), the loss in fp32 without it.
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        h_all, w = hidden.to(dtype), weight.to(dtype)
        grad_hidden = torch.empty_like(h_all)  # the chunks cover every row
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        w_t = w.t()
        total, keys = None, []
        for a, b in bounds:
            h = h_all[a:b]
            logits = (h @ w_t).float().requires_grad_()  # grad mode is off here: a leaf of its own
            with torch.enable_grad(), torch.autocast(device, enabled=False):
                loss, values = loss_of_chunk(logits, a, b)
                (grad_logits,) = torch.autograd.grad(loss, logits)
            g = grad_logits.to(dtype)
            torch.mm(g, w, out=grad_hidden[a:b])
            if g.dtype == grad_weight.dtype:
                grad_weight.addmm_(g.t(), h)
            else:  # bf16 products, summed in fp32
                grad_weight.add_(g.t() @ h)
            keys = list(values)
            stacked = torch.stack(list(values.values()))  # grad mode is off: no graph, nothing to detach
            total = stacked if total is None else total.add_(stacked)
        ctx.save_for_backward(grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype))
        if total is None:  # no positions
            return torch.zeros((), dtype=torch.float32, device=hidden.device)
        parts.update(zip(keys, total.unbind()))
        return parts["loss"].clone()

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_output.to(grad_hidden.dtype),
            grad_weight * grad_output.to(grad_weight.dtype),
            None,
            None,
            None,
        )


def position_slicer(t: SparseTargets, bounds: list[tuple[int, int]], *, host: SparseTargets | None = None):
    """`slice_at(a, b)`: the targets at positions [a, b) of the chunk spans `bounds`, renumbered from 0.
    The entries of every span are found on the host, in `host` (the same targets as the stream made them,
    before they were moved to the device; default `t` itself, read back if it is on a device)."""
    entry_pos = (host if host is not None else t).entry_pos.cpu().numpy()
    cuts = np.searchsorted(entry_pos, [a for a, _ in bounds] + [t.n_positions]).tolist()
    entries = {a: (cuts[i], cuts[i + 1]) for i, (a, _) in enumerate(bounds)}
    return lambda a, b: t if (a, b) == (0, t.n_positions) else t.cut(a, b, entries=entries[a])


def kd_term(
    student_logits: Tensor, targets: SparseTargets, cfg: LossConfig, *, total: int | None = None, log_q=None
) -> Tensor:
    """The KD term alone: (1/P) sum_t w_t T^2 kd_t, a scalar with grad (cfg.alpha is not used). `total`:
    the denominator instead of P (see `distill_terms`); `log_q`: `student_log_softmax(student_logits)`,
    if computed already."""
    _check_shapes(student_logits, targets)
    return _kd_term(student_logits.float(), targets, cfg, total=total, log_q=log_q)


def ce_term(student_logits: Tensor, target_ids: Tensor, *, total: int | None = None, log_q=None) -> Tensor:
    """The cross-entropy alone: mean_t -log softmax(z)[target_t] at temperature 1, a scalar with grad
    (`total`, `log_q`: as for `kd_term`)."""
    if student_logits.ndim != 2 or target_ids.shape != student_logits.shape[:1]:
        raise ValueError(
            f"student_logits must be [P, V] and target_ids [P]; got {tuple(student_logits.shape)} "
            f"and {tuple(target_ids.shape)}"
        )
    return _ce_term(student_logits.float(), target_ids, total=total, log_q=log_q)


def student_log_softmax(logits: Tensor) -> Tensor:
    """[P, V] log-probabilities of fp32 logits: one fused kernel forward and one backward, where a
    logsumexp subtracted from gathered logits takes several passes over [P, V] each way."""
    return torch.log_softmax(logits, dim=-1)


def _kd_term(logits: Tensor, t: SparseTargets, cfg: LossConfig, *, total: int | None, log_q) -> Tensor:
    terms, pos = _kd_terms(logits, t, cfg=cfg, log_q=log_q if cfg.temperature == 1 else None)
    if t.weight is not None:
        terms = terms * t.weight.float()[pos]
    n = total or max(t.n_positions, 1)  # an empty micro-batch gives 0, not NaN
    return terms.sum() * (cfg.temperature**2 / n)


def _ce_term(logits: Tensor, target_ids: Tensor, *, total: int | None = None, log_q=None) -> Tensor:
    log_q = student_log_softmax(logits) if log_q is None else log_q
    n = total or max(len(target_ids), 1)
    return -log_q.gather(1, target_ids[:, None]).sum() / n


def _kd_terms(logits: Tensor, t: SparseTargets, *, cfg: LossConfig, log_q) -> tuple[Tensor, Tensor]:
    """The divergence's terms, before the T^2 factor, and the position of each: they sum to each
    position's divergence over its buckets (`log_q`: the log-softmax of the logits at temperature 1, or None)."""
    divergence = DIVERGENCES[cfg.kind]
    z = logits / cfg.temperature if cfg.temperature != 1 else logits
    if t.entry_counts is not None:
        if not divergence.sampled:
            raise LossConfigError(
                f"--loss {cfg.kind} needs the teacher's distribution over the stored entries, which a sampled "
                "store's draw counts do not give; use --loss forward_kl (the unbiased sampled estimator)"
            )
        return _sampled_forward_kl_terms(_or_log_softmax(log_q, z), t), t.entry_pos
    if divergence.tail_bucket:
        log_p, log_q_b, pos = _tail_buckets(_or_log_softmax(log_q, z), t, temperature=cfg.temperature)
    else:  # the entries' logits alone: no softmax over the vocabulary
        log_p, log_q_b, pos = _entry_buckets(z, t, temperature=cfg.temperature)
    return divergence.terms(log_p, log_q_b, cfg.jsd_beta), pos


def _or_log_softmax(log_q: Tensor | None, z: Tensor) -> Tensor:
    return student_log_softmax(z) if log_q is None else log_q


def _tail_buckets(log_q_all: Tensor, t: SparseTargets, *, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """Normalised log-masses of the entries then the P tail buckets, for teacher and student (from the
    student's log-softmax `log_q_all` [P, V]), and the position of each bucket ([E + P] each)."""
    n = t.n_positions
    device = log_q_all.device
    pos = torch.cat([t.entry_pos, torch.arange(n, device=device)])
    log_q_entries = log_q_all[t.entry_pos, t.entry_ids]
    masked = log_q_all.index_put(
        (t.entry_pos, t.entry_ids), torch.tensor(MASKED_LOGIT, dtype=log_q_all.dtype, device=device)
    )
    log_q_tail = torch.logsumexp(masked, dim=-1).clamp_min(LOG_TINY)
    log_q = torch.cat([log_q_entries, log_q_tail])
    raw_p = torch.cat([_teacher_logprobs(t), t.tail.float().clamp_min(TINY).log()])
    log_p = normalise(raw_p / temperature, pos, n=n)
    return log_p, log_q, pos


def _entry_buckets(z: Tensor, t: SparseTargets, *, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """Like `_tail_buckets`, both sides renormalised over the stored entries alone ([E] each)."""
    n = t.n_positions
    # softmax(z / T) restricted to the entries and renormalised is a softmax of the entries' logits.
    log_q = normalise(z[t.entry_pos, t.entry_ids], t.entry_pos, n=n)
    log_p = normalise(_teacher_logprobs(t) / temperature, t.entry_pos, n=n)
    return log_p, log_q, t.entry_pos


# -- the losses: one `Divergence` each, named in `DIVERGENCES` ------------------------------------------
# Each gives per-bucket terms from the teacher's and the student's normalised log-masses over the same
# buckets (log p, log q [B]); they sum to the divergence over a position's buckets.


def _forward_kl(log_p: Tensor, log_q: Tensor, beta: float) -> Tensor:
    return log_p.exp() * (log_p - log_q)


def _reverse_kl(log_p: Tensor, log_q: Tensor, beta: float) -> Tensor:
    return log_q.exp() * (log_q - log_p)


def _jsd(log_p: Tensor, log_q: Tensor, beta: float) -> Tensor:
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
    return beta * log_p.exp() * (log_p - log_m) + (1 - beta) * log_q.exp() * (log_q - log_m)


@dataclass(frozen=True)
class Divergence:
    """A distillation loss (`--loss`): its per-bucket terms and what it compares them over."""

    terms: Callable[[Tensor, Tensor, float], Tensor]  # (log p, log q, --jsd-beta) -> per-bucket terms
    tail_bucket: bool = True  # each position's tail is a bucket; False: both sides renormalised over the entries
    sampled: bool = False  # a sampled store's draw counts give its unbiased estimator (`_sampled_forward_kl_terms`)
    cross_tokenizer: bool = False  # `aligned_losses.aligned_kd` computes it for a teacher of another tokenizer


DIVERGENCES: dict[LossName, Divergence] = {
    "forward_kl": Divergence(_forward_kl, sampled=True, cross_tokenizer=True),
    "topk_renorm": Divergence(_forward_kl, tail_bucket=False),
    "reverse_kl": Divergence(_reverse_kl),
    "jsd": Divergence(_jsd),
}
assert set(DIVERGENCES) == set(LOSS_NAMES), "one divergence per --loss name"


def _sampled_forward_kl_terms(log_q_all: Tensor, t: SparseTargets) -> Tensor:
    """[E] terms w_i (lp_i - log q_i) of the unbiased sampled estimator (`log_q_all`: the student's
    log-softmax [P, V])."""
    assert t.entry_counts is not None  # sampled targets only (`_kd_terms`)
    log_q = log_q_all[t.entry_pos, t.entry_ids]
    counts = t.entry_counts.float()
    if t.n_draws is not None:
        weights = counts / float(t.n_draws)
    else:
        weights = counts / segment_sum(counts, t.entry_pos, n=t.n_positions)[t.entry_pos]
    return weights * (_teacher_logprobs(t) - log_q)


def _teacher_logprobs(t: SparseTargets) -> Tensor:
    # A -inf entry (probability 0) would make 0 * -inf = NaN in the terms.
    return t.entry_logprobs.float().clamp_min(LOG_TINY)


def normalise(x: Tensor, index: Tensor, *, n: int) -> Tensor:
    """x - logsumexp of x's segment: log-masses renormalised to sum 1 per position."""
    return x - segment_logsumexp(x, index, n=n)[index]


def segment_logsumexp(x: Tensor, index: Tensor, *, n: int) -> Tensor:
    """[n] logsumexp of x over each segment of `index`; an empty segment gives LOG_TINY."""
    # The shift is a constant for the result's value, so it needs no gradient.
    shift = torch.full((n,), -math.inf, dtype=x.dtype, device=x.device)
    shift = shift.scatter_reduce(0, index, x.detach(), reduce="amax", include_self=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    total = segment_sum((x - shift[index]).exp(), index, n=n)
    # A non-empty segment sums to >= 1 (its max term is exp(0)); only an empty one is clamped.
    return shift + total.clamp_min(TINY).log()


def segment_sum(x: Tensor, index: Tensor, *, n: int) -> Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, index, x)


def _check_shapes(logits: Tensor, t: SparseTargets) -> None:
    """Mismatched arrays are a caller's bug; fail with the shapes rather than a scatter error."""
    if logits.ndim != 2 or logits.shape[0] != t.n_positions:
        raise ValueError(f"student_logits must be [P, V] with P = {t.n_positions} positions; got {tuple(logits.shape)}")
    n_entries = {len(t.entry_ids), len(t.entry_logprobs), len(t.entry_pos)}
    if t.entry_counts is not None:
        n_entries.add(len(t.entry_counts))
    if len(n_entries) != 1:
        raise ValueError(f"entry arrays of different lengths: {sorted(n_entries)}")
    if {len(t.target_ids), len(t.target_logprobs)} != {t.n_positions}:
        raise ValueError(f"target arrays must have P = {t.n_positions} elements (one per tail)")
    if t.weight is not None and tuple(t.weight.shape) != (t.n_positions,):
        raise ValueError(f"weight must be [P] with P = {t.n_positions}; got {tuple(t.weight.shape)}")
