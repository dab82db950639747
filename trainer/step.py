"""One optimizer step of `logitstore train` (`train_step`), and the step records it leaves (`StepLog`).

A step never makes the host wait for the device: the loss, its parts and the gradient norm stay on the
device as scalar tensors, the chunked head cuts its chunks from the batch's host arrays, the attention's
segments come planned with the batch, and the optimizer is the fused AdamW (foreach where fused is not
available), whose step count lives on the device. What the log needs is read back at logging steps only
(`--log-every`, an evaluation, a checkpoint, the last step): the values of every step since the last
one, reduced over the ranks and read in one transfer. A step's time is measured between two events on
its device's stream (CUDA) or by the host's clock (CPU), so it is the step's own time either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from logitstore.errors import DamagedDataError
from logitstore.trainer.config import TrainConfig
from logitstore.trainer.model import is_sharded, precision
from logitstore.trainer.objective import batch_loss, student_outputs


def make_optimizer(model, cfg: TrainConfig, *, device: torch.device) -> torch.optim.AdamW:
    """AdamW, fused (one kernel for every parameter, its step count on the device) where torch has it for
    the device, else foreach; the per-parameter loop of the default reads each step count back."""
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        fused=True if fused else None,
        foreach=None if fused else True,
    )


def train_step(model, optimizer, batches, cfg: TrainConfig, device: torch.device, *, step: int) -> tuple[dict, int]:
    """Optimizer step `step` over `grad_accum` micro-batches: (mean loss parts and `grad_norm`, as scalar
    tensors on `device` (a mix's signal shares as floats), tokens of this rank). Reads nothing back.
    One rank whose step holds no token (every sample of it skipped as damaged) stops before the optimizer
    steps on nothing, from the host's count; with several ranks `StepLog.flush` stops the run at the
    next read-back, from the tokens summed over the ranks (a rank alone without tokens trains on)."""
    optimizer.zero_grad(set_to_none=True)
    accum = cfg.optim.grad_accum
    sums: dict = {}
    tokens = 0
    for micro_step in range(accum):
        if cfg.optim.defer_grad_sync and is_sharded(model):  # reduce once, after the last micro-batch
            model.set_requires_gradient_sync(micro_step == accum - 1)
        batch = next(batches)
        with precision(model, device):
            loss, parts = batch_loss(student_outputs(model, batch, device), batch, cfg.loss, device=device)
        (loss / accum if accum > 1 else loss).backward()
        for k, v in parts.items():
            share = v / accum if accum > 1 else v
            sums[k] = share if k not in sums else sums[k] + share
        tokens += batch.n_tokens
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if tokens == 0 and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        raise nothing_to_train(step)
    optimizer.step()
    return {**sums, "grad_norm": grad_norm}, tokens


def nothing_to_train(step: int) -> DamagedDataError:
    """What cannot be told without reading the whole store: whether anything is left to train on."""
    return DamagedDataError(
        f"step {step}: every sample of it is damaged and was skipped (--on-error skip); nothing left to "
        "train on: `logitstore verify` names the damaged samples"
    )


@dataclass
class _Pending:
    """A step not yet read back: its values on the device, what the host knew, its time."""

    step: int
    values: dict  # name -> scalar tensor on the device, or a host float
    tokens: int  # this rank's
    host: dict  # the record's fields known on the host at the step (lr, data wait, ...)
    clock: tuple


@dataclass
class StepLog:
    """The steps since the last read-back; `flush` reads them back and returns their records."""

    device: torch.device
    pending: list[_Pending] = field(default_factory=list)

    def start(self) -> tuple:
        """Mark a step's start (an event on the device's stream, or the host's clock)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return (event,)
        return (time.perf_counter(),)

    def add(self, step: int, values: dict, *, tokens: int, host: dict, started: tuple) -> None:
        end = self.start()
        self.pending.append(_Pending(step, values, tokens, host, (*started, *end)))

    def flush(self) -> list[dict]:
        """The pending steps' records, in order: parts averaged over the ranks (the gradient norm is global
        already), tokens summed, and `tokens_per_second` from each step's own time. One read-back."""
        if not self.pending:
            return []
        steps, self.pending = self.pending, []
        names = [k for k, v in steps[0].values.items() if isinstance(v, Tensor) and k != "grad_norm"]
        on_host = [k for k in steps[0].values if k not in names and k != "grad_norm"]
        device_rows = torch.stack([torch.stack([s.values[k].float() for k in names]) for s in steps]).double()
        host_rows = torch.tensor(
            [[float(s.values[k]) for k in on_host] + [s.tokens] for s in steps], dtype=torch.float64
        )
        reduced = torch.cat([device_rows, host_rows.to(self.device, non_blocking=True)], dim=1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(reduced)
            reduced = reduced / dist.get_world_size()
        grad_norms = torch.stack([s.values["grad_norm"].float() for s in steps]).double()
        rows = torch.cat([reduced, grad_norms[:, None]], dim=1).tolist()  # the one read-back
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        records = []
        for s, row in zip(steps, rows):
            parts = dict(zip([*names, *on_host], row))
            tokens = int(round(row[len(names) + len(on_host)] * world))
            if tokens == 0:  # no rank had a token: every rank reads the same sum and stops here
                raise nothing_to_train(s.step)
            seconds = _seconds(s.clock)
            records.append(
                {
                    "step": s.step,
                    **parts,
                    "grad_norm": row[-1],
                    "lr": s.host["lr"],
                    "tokens": tokens,
                    "tokens_per_second": tokens / seconds,
                    **{k: v for k, v in s.host.items() if k != "lr"},
                }
            )
        return records


def _seconds(clock: tuple) -> float:
    start, end = clock
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1000  # the events have completed: the read-back waited for them
