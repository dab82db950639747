"""What the student is trained and evaluated on: one micro-batch -> the student's final hidden states at
the supervised positions -> one loss. Training and evaluation both go through `student_outputs` and
`batch_loss`, for one teacher, several teachers and cross-tokenizer teachers alike.

The student runs its own forward (so FSDP's hooks gather its weights) with the segment attention
(`trainer/attention.py`: no L x L mask) and without its head: `logits_to_keep` of no positions, the
final hidden states taken from the decoder's output. The head is applied by the loss:

- one teacher: `losses.chunked_distill_loss`, a few hundred positions at a time, so the [P, V] logits
  never exist at once (in fp32 or at all);
- several or cross-tokenizer teachers: the logits at the supervised positions only, [P, V] in fp32,
  then `mixed_loss` (not chunked yet: the cross-tokenizer terms group several positions).

The head's weight is read after the forward: FSDP2 leaves the root module's parameters (embeddings,
final norm, head) unsharded after the forward, for the backward that follows, so the weight read here is
the full one, and its gradient reaches FSDP's reduce-scatter like any other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from logitstore.trainer.attention import plan_segments
from logitstore.trainer.losses import LossConfig, SparseTargets, ce_term, chunked_distill_loss, kd_term


def evaluation_loss(cfg: LossConfig) -> LossConfig:
    """What evaluation measures: the forward KL to the teacher (tail as a bucket), CE reported beside it,
    with the run's weighting of cross-tokenizer terms."""
    return LossConfig(kind="forward_kl", alpha=1.0, uld_weight=cfg.uld_weight)


@dataclass
class StudentOutputs:
    hidden: Tensor  # [P, d] final hidden states at the batch's supervised positions
    weight: Tensor  # [V, d] the output embedding (the head)

    def logits(self) -> Tensor:
        """[P, V] fp32 logits at every supervised position at once (the paths not chunked yet)."""
        return (self.hidden @ self.weight.T).float()


def student_outputs(model, batch, device) -> StudentOutputs:
    """Run the student on a packed micro-batch: its hidden states at the supervised positions."""
    captured = {}
    decoder = model.get_decoder()
    hook = decoder.register_forward_hook(lambda _m, _args, out: captured.__setitem__("hidden", out.last_hidden_state))
    try:
        model(input_ids=batch.input_ids.to(device, non_blocking=True),
              position_ids=batch.position_ids.to(device, non_blocking=True),
              segment_plan=plan_segments(batch.position_ids).to(device), use_cache=False,
              logits_to_keep=torch.zeros(0, dtype=torch.long, device=device))  # no logits: the loss applies the head
    finally:
        hook.remove()
    hidden = captured["hidden"]
    hidden = hidden.reshape(-1, hidden.shape[-1])[batch.positions.to(device, non_blocking=True)]
    return StudentOutputs(hidden=hidden, weight=model.get_output_embeddings().weight)


def batch_loss(outputs: StudentOutputs, batch, cfg: LossConfig, *, device,
               evaluation: bool = False) -> tuple[Tensor, dict[str, float]]:
    """(loss, parts) of one micro-batch: `kd`, `ce`, `loss` and, with several teachers, `kl/<name>` and the
    signal shares. `evaluation` reports each teacher's mean KL over the positions it teaches."""
    if batch.signals is None:
        return chunked_distill_loss(outputs.hidden, outputs.weight, sparse_targets(batch, device), cfg)
    return mixed_loss(outputs.logits(), batch, cfg, uld_weight=cfg.uld_weight, device=device, indicator=evaluation)


def sparse_targets(batch, device) -> SparseTargets:
    """The single teacher's targets of a batch, on `device`."""
    counts = batch.entry_counts
    move = lambda t: t.to(device, non_blocking=True)
    return SparseTargets(
        entry_ids=move(batch.entry_ids), entry_logprobs=move(batch.entry_logprobs), entry_pos=move(batch.entry_pos),
        tail=move(batch.tail), target_ids=move(batch.target_ids), target_logprobs=move(batch.target_logprobs),
        entry_counts=None if counts is None else move(counts),
        n_draws=None,  # sampled stores: the loss takes each position's draw count from its counts
    )


def mixed_loss(logits, batch, loss_cfg, *, uld_weight: float, device, indicator: bool = False):
    """Sum of every teacher's weighted KD term, plus alpha * CE once. `indicator` (evaluation) replaces
    the weights by 1 wherever a teacher has signal and reports each teacher's mean KL over its positions."""
    from logitstore.trainer.aligned_losses import AlignedTargets, aligned_kd

    kd = torch.zeros((), device=device)
    parts: dict[str, float] = {}
    P = max(len(batch.positions), 1)
    for name, targets in batch.signals:
        targets = _to_device(targets, device)
        if indicator:
            targets.weight = (targets.weight > 0).float()
        if isinstance(targets, AlignedTargets):
            term, sub = aligned_kd(logits, targets, uld_weight=uld_weight)
            n = int((targets.weight[targets.exact_pos] > 0).sum()) if indicator else 0
            parts[f"kl/{name}"] = sub["exact"] * P / max(n, 1) if indicator else sub["kd"]
        else:
            term = kd_term(logits, targets, loss_cfg)
            n = int((targets.weight > 0).sum()) if indicator else 0
            parts[f"kl/{name}"] = float(term.detach()) * (P / max(n, 1) if indicator else 1.0)
        kd = kd + term
    if loss_cfg.alpha > 0:
        ce = ce_term(logits, batch.target_ids.to(device))
        loss = kd + loss_cfg.alpha * ce
    else:
        with torch.no_grad():  # reported only: no [P, V] gradient of zeros to carry back
            ce = ce_term(logits, batch.target_ids.to(device))
        loss = kd
    counts = batch.signal_counts
    parts.update({"kd": float(kd.detach()), "ce": float(ce.detach()), "loss": float(loss.detach()),
                  "signal_share": counts["signal_positions"] / max(counts["positions"], 1),
                  "exact_share": counts["exact_positions"] / max(counts["positions"], 1)})
    return loss, parts


def _to_device(targets, device):
    return dataclasses.replace(targets, **{f.name: getattr(targets, f.name).to(device)
                                           for f in dataclasses.fields(targets)
                                           if isinstance(getattr(targets, f.name), torch.Tensor)})
