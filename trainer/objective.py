"""What the student is trained and evaluated on: one micro-batch -> the student's final hidden states at
the supervised positions -> one loss. Training and evaluation both go through `student_outputs` and
`batch_loss`, for one teacher, several teachers and cross-tokenizer teachers alike.

The student runs its own forward (so FSDP's hooks gather its weights) with the segment attention
(`trainer/attention.py`: no L x L mask) and without its head: `logits_to_keep` of no positions, the
final hidden states taken from the decoder's output. The head is applied by the loss, `mixed_loss`, a
few hundred positions at a time (`losses.chunked_head_loss`), so the [P, V] logits never exist at once
(in fp32 or at all), with every teacher's terms per chunk: one teacher is a mix of one, whose value and
gradients are those of `losses.chunked_distill_loss`; the cuts never split a cross-tokenizer teacher's
many-token group.

The head's weight is read after the forward: FSDP2 leaves the root module's parameters (embeddings,
final norm, head) unsharded after the forward, for the backward that follows, so the weight read here is
the full one, and its gradient reaches FSDP's reduce-scatter like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from logitstore.streaming.batch import on_device
from logitstore.streaming.targets import AlignedTargets, SparseTargets
from logitstore.trainer.aligned_losses import aligned_kd_terms
from logitstore.trainer.attention import SegmentPlan, plan_segments
from logitstore.trainer.losses import (
    LossConfig,
    as_floats,
    ce_term,
    chunk_bounds,
    chunk_positions,
    chunked_head_loss,
    kd_term,
    position_slicer,
    student_log_softmax,
)


def evaluation_loss(cfg: LossConfig) -> LossConfig:
    """What evaluation measures: the forward KL to the teacher (tail as a bucket), CE reported beside it,
    with the run's weighting of cross-tokenizer terms."""
    return LossConfig(kind="forward_kl", alpha=1.0, uld_weight=cfg.uld_weight)


@dataclass
class StudentOutputs:
    hidden: Tensor  # [P, d] final hidden states at the batch's supervised positions
    weight: Tensor  # [V, d] the output embedding (the head)

    def logits(self) -> Tensor:
        """[P, V] fp32 logits at every supervised position at once: for references and benchmarks (the
        trainer never builds them)."""
        return (self.hidden @ self.weight.T).float()


def student_outputs(model, batch, device) -> StudentOutputs:
    """Run the student on a packed micro-batch: its hidden states at the supervised positions."""
    captured: dict[str, Tensor] = {}
    inner = getattr(model, "module", model)  # the model inside a DDP wrapper (Trainer's); FSDP2 wraps none
    decoder = inner.get_decoder()
    hook = decoder.register_forward_hook(lambda _m, _args, out: captured.__setitem__("hidden", out.last_hidden_state))
    try:
        model(
            input_ids=batch.input_ids.to(device, non_blocking=True),
            position_ids=batch.position_ids.to(device, non_blocking=True),
            segment_plan=segment_plan(batch).to(device, non_blocking=True),
            use_cache=False,
            logits_to_keep=torch.zeros(0, dtype=torch.long, device=device),
        )  # no logits: the loss applies the head
    finally:
        hook.remove()
    hidden = captured["hidden"]
    hidden = hidden.reshape(-1, hidden.shape[-1])[batch.positions.to(device, non_blocking=True)]
    return StudentOutputs(hidden=hidden, weight=inner.get_output_embeddings().weight)


def segment_plan(batch) -> SegmentPlan:
    """The batch's segments, as the stream planned them (a batch made elsewhere: planned here, on the host)."""
    return batch.segment_plan if batch.segment_plan is not None else plan_segments(batch.position_ids)


def batch_loss(
    outputs: StudentOutputs, batch, cfg: LossConfig, *, device, evaluation: bool = False
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """(loss, parts) of one micro-batch, for one teacher or a mix alike: `kd`, `ce`, `loss` and, for a mix
    (`batch.mixed`), `kl/<name>` and the signal shares. `evaluation` reports each teacher's mean KL over
    the positions it teaches. The parts stay on the device (`host_values` reads them back)."""
    loss, parts = mixed_loss(outputs, batch, cfg, device=device, indicator=evaluation)
    return loss, parts if batch.mixed else {key: parts[key] for key in ("kd", "ce", "loss")}


def host_values(parts: dict[str, Tensor | float]) -> dict[str, float]:
    """Parts as python floats: the tensors read back in one device sync, the host floats as they are."""
    tensors = {k: v for k, v in parts.items() if isinstance(v, Tensor)}
    read = as_floats(tensors)
    return {k: read[k] if k in read else float(v) for k, v in parts.items()}


@torch.no_grad()
def held_out_metrics(
    model, batches, cfg: LossConfig, *, device, weights: dict[str, float] | None = None, limit: int | None = None
) -> dict[str, float]:
    """Held-out means over `batches` (at most `limit`) and over every rank, per supervised position:
    `eval_kl`, the forward KL to the teacher (tail as a bucket), and `eval_ce`. With several or
    cross-tokenizer teachers, each one's mean KL over the positions it teaches (`eval_kl/<name>`; for a
    cross-tokenizer teacher its 1:1-aligned positions), and `eval_kl` their mean by `weights`."""
    totals: dict[str, float] = {"n": 0.0}
    for i, batch in enumerate(batches):
        if limit is not None and i >= limit:
            break
        _, found = batch_loss(
            student_outputs(model, batch, device), batch, evaluation_loss(cfg), device=device, evaluation=True
        )
        parts = host_values(found)  # evaluation reads its values back, once per batch
        if not batch.mixed:
            parts = {"kd": parts["kd"], "ce": parts["ce"]}
        else:
            assert weights is not None, "several teachers: their weights are needed for eval_kl"
            total_weight = sum(weights.values())
            parts = {
                "kd": sum(w * parts[f"kl/{name}"] for name, w in weights.items()) / total_weight,
                "ce": parts["ce"],
                **{k: v for k, v in parts.items() if k.startswith("kl/") or k.endswith("_share")},
            }
        weight = len(batch.positions)  # per-position means: a short (padded) last batch counts less
        for k, v in parts.items():
            totals[k] = totals.get(k, 0.0) + v * weight
        totals["n"] += weight
    reduced = all_reduce_mean(totals)  # a mean of sums over ranks: the ratio below is the global mean
    n = max(reduced.pop("n"), 1e-9)
    out = {"eval_kl": reduced.pop("kd") / n, "eval_ce": reduced.pop("ce") / n}
    out.update({f"eval_{k}": v / n for k, v in reduced.items()})
    # A divergence is never negative, yet float32 sums at a near-perfect match (or the sampled estimator's
    # noise) can come out at -1e-8; 0 is nearer the truth than any negative number.
    return {k: max(v, 0.0) if k == "eval_kl" or k.startswith("eval_kl/") else v for k, v in out.items()}


def all_reduce_mean(values: dict[str, float]) -> dict[str, float]:
    """The mean over the ranks of each value (the values themselves without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return dict(values)
    keys = sorted(values)
    # NCCL reduces device tensors only; gloo takes CPU ones
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return {k: float(v) / dist.get_world_size() for k, v in zip(keys, t.tolist())}


def sparse_targets(batch, device) -> SparseTargets:
    """The targets of a batch of one same-tokenizer teacher, on `device`."""
    return on_device(batch.targets, device, non_blocking=True)


def mixed_loss(
    outputs: StudentOutputs, batch, cfg: LossConfig, *, device, indicator: bool = False, chunk: int | None = None
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Sum of every teacher's weighted KD term, plus alpha * CE once, the head applied in chunks of
    positions (`losses.chunked_head_loss`; a cross-tokenizer teacher's many-token group never straddles
    two chunks). `indicator` (evaluation) replaces the weights by 1 wherever a teacher has signal and
    reports each teacher's mean KL over its positions. The parts are scalar tensors on the device (the
    signal shares, host floats): the chunks are cut from the batch's host arrays, and nothing is read back."""
    host = batch.signals  # as the stream made them: where the chunks' cuts are found
    signals = [(name, on_device(targets, device, non_blocking=True)) for name, targets in host]
    if indicator:
        for _, targets in signals:
            targets.weight = (_weight(targets) > 0).float()
    P = len(batch.positions)
    total = max(P, 1)
    target_ids = batch.target_ids.to(device, non_blocking=True)
    bounds = chunk_bounds(P, chunk=chunk or chunk_positions(outputs.weight), allowed=_whole_groups(host, P))
    slicers = {
        name: position_slicer(targets, bounds, host=on_host)
        for (name, targets), (_, on_host) in zip(signals, host)
        if not isinstance(targets, AlignedTargets)
    }
    each_teacher = batch.mixed or indicator  # one teacher's KL is the KD itself

    def loss_of_chunk(logits: Tensor, a: int, b: int) -> tuple[Tensor, dict[str, Tensor]]:
        log_q = student_log_softmax(logits)  # every same-tokenizer teacher's (at temperature 1) and the CE's
        kd: Tensor | None = None
        values = {}
        for name, targets in signals:
            if isinstance(targets, AlignedTargets):
                term, sub = aligned_kd_terms(logits, targets.cut(a, b), uld_weight=cfg.uld_weight, total=total)
                if each_teacher:
                    values[f"kl/{name}"] = sub["exact"] if indicator else sub["kd"]
            else:
                term = kd_term(logits, slicers[name](a, b), cfg, total=total, log_q=log_q)
                if each_teacher:
                    values[f"kl/{name}"] = term
            kd = term if kd is None else kd + term
        assert kd is not None  # a batch has at least one teacher
        if cfg.alpha > 0:
            ce = ce_term(logits, target_ids[a:b], total=total, log_q=log_q)
            loss = kd + cfg.alpha * ce
        else:
            with torch.no_grad():  # reported only: no gradient of zeros to carry back
                ce = ce_term(logits, target_ids[a:b], total=total, log_q=log_q)
            loss = kd
        values.update({"kd": kd, "ce": ce, "loss": loss})  # stacked with grad off (`chunked_head_loss`)
        return loss, values

    loss, found = chunked_head_loss(outputs.hidden, outputs.weight, loss_of_chunk, bounds=bounds)
    keys = ["kd", "ce", "loss", *(f"kl/{name}" for name, _ in signals if each_teacher)]
    # an empty micro-batch: zeros
    parts: dict[str, Tensor | float] = {k: found[k] if k in found else torch.zeros((), device=device) for k in keys}
    if indicator:  # each teacher's mean over the positions it teaches, not over all P
        for name, targets in host:
            weight = _weight(targets)
            taught = weight[targets.exact_pos] if isinstance(targets, AlignedTargets) else weight
            parts[f"kl/{name}"] = parts[f"kl/{name}"] * (P / max(int((taught > 0).sum()), 1))
    counts = batch.signal_counts
    if counts:  # a mix: how much of the batch its teachers teach
        parts.update(
            {
                "signal_share": counts["signal_positions"] / max(counts["positions"], 1),
                "exact_share": counts["exact_positions"] / max(counts["positions"], 1),
            }
        )
    return loss, parts


def _weight(targets) -> Tensor:
    """A teacher's weight per position: its own, or 1 everywhere (one teacher's targets carry none)."""
    return targets.weight if targets.weight is not None else torch.ones(targets.n_positions, device=targets.tail.device)


def _whole_groups(signals, P: int):
    """[P + 1] bool: the cuts between positions that split no cross-tokenizer many-token group."""
    inside = np.zeros(P + 2, dtype=np.int64)  # +1 at a group's second position, -1 past its last
    for _, t in signals:
        if isinstance(t, AlignedTargets) and len(t.chain_group):
            g = int(t.chain_teacher_logprob.shape[0])
            first = torch.full((g,), P, dtype=torch.long, device=t.chain_pos.device).scatter_reduce(
                0, t.chain_group, t.chain_pos, reduce="amin"
            )
            last = torch.zeros(g, dtype=torch.long, device=t.chain_pos.device).scatter_reduce(
                0, t.chain_group, t.chain_pos, reduce="amax"
            )
            np.add.at(inside, first.cpu().numpy() + 1, 1)
            np.add.at(inside, last.cpu().numpy() + 1, -1)
    return np.cumsum(inside)[: P + 1] <= 0
