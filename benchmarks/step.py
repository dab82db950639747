"""`logitstore train`'s step against the plain PyTorch loop, side by side in one process, on the same
batches of one store: top-level aten ops per step, host syncs per step and tokens/s, so the step's work
can be measured and cut on a machine without a GPU.

    python benchmarks/step.py                    # llama-small, seq 512 x 4, vocabulary 49,152, CPU (minutes)
    python benchmarks/step.py --smoke            # llama-tiny at toy shapes: seconds (the test suite runs it)
    python benchmarks/step.py --device cuda --student smollm2-135m --seq-len 2048 --micro-batch 8

The store is synthetic (`benchmarks/stream.py`'s writer: sampled-16 by default, samples of up to 1,024
tokens), so nothing but the project is needed. The two loops:

  logitstore   `trainer/step.train_step` as `logitstore train` runs it on one rank: the student built and
               placed by `model.build_student`/`distribute`, `step.make_optimizer`, the segment attention
               over packed rows, the chunked head, the default loss (forward KL, sampled estimator)
  plain        `plain.PlainLoop`: LlamaForCausalLM of the same dimensions, SDPA causal over each row,
               AdamW(fused=True), the full [B, L, V] logits, the forward KL on the gathered entries

Ops and syncs are counted on one step after the warm-up with `logitstore.testing.dispatch.CountingMode`
(top-level aten ops as they reach Python dispatch; a sync is an `item`, a device-to-host copy or an op
whose output shape depends on the data). tokens/s counts B x L tokens a step for both loops, from the
median step time of `--steps` x `--repeats` steps, the loops taking turns step by step on the same
batch; logitstore / plain tokens/s is the median of those pairs' ratios (a neighbour's burst of work on
a shared machine slows both steps of a pair). `head` compares the chunked head and loss alone with
`plain.fused_linear_kd` (Liger's fused linear cross-entropy structure) at the same positions and
chunks. JSON on stdout; `--out` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _plain as baselines  # benchmarks/_plain.py, beside this file
import stream as stream_benchmark  # benchmarks/stream.py: its synthetic store writer
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from logitstore.store.store import Store
from logitstore.streaming.spec import StreamSpec
from logitstore.streaming.stream import store_stream
from logitstore.testing.dispatch import CountingMode, DispatchCount
from logitstore.trainer.config import LossConfig, TrainConfig
from logitstore.trainer.losses import chunk_positions
from logitstore.trainer.model import build_student, distribute
from logitstore.trainer.objective import StudentOutputs, mixed_loss
from logitstore.trainer.step import make_optimizer, train_step
from logitstore.trainer.train import one_process_group

FULL = dict(student="llama-small", seq_len=512, micro_batch=4, vocab=49_152, warmup=2, steps=3, repeats=3)
SMOKE = dict(student="llama-tiny", seq_len=128, micro_batch=2, vocab=4096, warmup=1, steps=1, repeats=1)


class LogitstoreLoop:
    """`train_step` on one rank, as `launch` sets it up."""

    def __init__(self, cfg: TrainConfig, *, vocab_size: int, device: torch.device):
        model, _ = build_student(cfg.student.student, vocab_size=vocab_size, seed=cfg.student.seed, device=device)
        mesh = init_device_mesh(device.type, (1,))
        self.model = distribute(model, mesh=mesh, offload_optimizer=False, cuda=device.type == "cuda")
        self.optimizer = make_optimizer(self.model, cfg, device=device)
        self.cfg, self.device = cfg, device

    def step(self, batch) -> torch.Tensor:
        values, _ = train_step(self.model, self.optimizer, iter([batch]), self.cfg, self.device, step=1)
        return values["loss"]


def write_store(folder: Path, *, vocab: int, tokens: int) -> str:
    """A sampled-16 store of `tokens` tokens from benchmarks/stream.py's synthetic teacher and writer."""
    uri = str(folder / "store")
    args = stream_benchmark.parse_args(
        ["--tokens", str(tokens), "--vocab", str(vocab), "--part-tokens", "8192", "--sample-len", "1024"]
    )
    stream_benchmark.write_store(uri, args, log=lambda _: None)
    return uri


def read_batches(uri: str, *, seq_len: int, micro_batch: int, n: int) -> list:
    spec = StreamSpec(seq_len=seq_len, micro_batch=micro_batch, rank=0, world_size=1, seed=0, eval_fraction=0.0)
    with store_stream(Store.open(uri).read(), spec) as stream:
        batches = iter(stream)
        return [next(batches) for _ in range(n)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def counted(step, batch) -> DispatchCount:
    with CountingMode() as mode:
        step(batch)
    return mode.count


def timed(step, batches: list, *, device: torch.device) -> float:
    """Seconds per step over `batches`, everything the steps queued finished."""
    synchronize(device)
    started = time.perf_counter()
    for batch in batches:
        step(batch)
    synchronize(device)
    return (time.perf_counter() - started) / len(batches)


def measure_loops(loops: dict, batches: list, *, shape: dict, device: torch.device) -> tuple[dict, float]:
    """Warm-up, one counted step, then `steps` x `repeats` timed steps, the loops taking turns step by step
    on each batch: (each loop's figures, the median over the batches of the first loop's tokens/s over
    the second's; a neighbour's burst of work slows both steps of a pair alike)."""
    warmup = shape["warmup"]
    for batch in batches[:warmup]:
        for loop in loops.values():
            loop.step(batch)
    counts = {name: counted(loop.step, batches[warmup]) for name, loop in loops.items()}
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    for batch in batches[warmup + 1 :]:
        for name, loop in loops.items():
            seconds[name].append(timed(loop.step, [batch], device=device))
    first, second = seconds.values()
    ratio = statistics.median(b / a for a, b in zip(first, second))
    tokens = shape["seq_len"] * shape["micro_batch"]
    measured = {
        name: {
            "ops_per_step": counts[name].n_ops,
            "syncs_per_step": counts[name].n_syncs,
            "syncs": dict(counts[name].syncs),
            "step_seconds": statistics.median(seconds[name]),
            "tokens_per_second": tokens / statistics.median(seconds[name]),
            "top_ops": dict(counts[name].ops.most_common(12)),
        }
        for name in loops
    }
    return measured, ratio


def measure_head(batch, *, weight: torch.Tensor, device: torch.device, repeats: int) -> dict:
    """The chunked head and loss (`objective.mixed_loss`, as the step runs it) against `fused_linear_kd`,
    forward and backward, on the batch's positions with random hidden states and the student's head."""
    targets = batch.targets
    P, chunk = len(batch.positions), chunk_positions(weight)
    hidden = torch.randn(P, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(device)
    counts, pos = targets.entry_counts, targets.entry_pos
    # the sampled estimator's weights, as the loss takes them: counts over the draws of the position
    drawn = targets.n_draws or torch.zeros(P).index_add(0, pos, counts)[pos]
    entries = [t.to(device) for t in (pos, targets.entry_ids, counts / drawn, targets.entry_logprobs)]

    def ours():
        h, w = hidden.clone().requires_grad_(), weight.detach().clone().requires_grad_()
        loss, _ = mixed_loss(StudentOutputs(hidden=h, weight=w), batch, LossConfig(), device=device, chunk=chunk)
        loss.backward()
        return loss.detach()

    def fused():
        h, w = hidden.clone().requires_grad_(), weight.detach().clone().requires_grad_()
        loss = baselines.fused_linear_kd(h, w, *entries, chunk=chunk)
        loss.backward()
        return loss.detach()

    found = {}
    for name, fn in (("logitstore", ours), ("fused_linear_kd", fused)):
        value = float(fn())  # a warm-up, and the value
        count = counted(lambda _, fn=fn: fn(), None)
        seconds = statistics.median(timed(lambda _, fn=fn: fn(), [None], device=device) for _ in range(repeats))
        found[name] = {"loss": value, "ops": count.n_ops, "syncs": count.n_syncs, "seconds": seconds}
    chunks = -(-P // chunk)
    return {
        "positions": P,
        "chunk_positions": chunk,
        "chunks": chunks,
        **found,
        "ops_per_chunk": {name: found[name]["ops"] / chunks for name in found},
        "loss_relative_difference": abs(found["logitstore"]["loss"] - found["fused_linear_kd"]["loss"])
        / abs(found["fused_linear_kd"]["loss"]),
    }


def run(args) -> dict:
    shape = {key: getattr(args, key) for key in FULL}
    device = torch.device(args.device)
    n = shape["warmup"] + 1 + shape["steps"] * shape["repeats"]
    with tempfile.TemporaryDirectory(prefix="logitstore-step-") as tmp:
        uri = write_store(Path(tmp), vocab=shape["vocab"], tokens=(n + 4) * shape["seq_len"] * shape["micro_batch"])
        batches = read_batches(uri, seq_len=shape["seq_len"], micro_batch=shape["micro_batch"], n=n)
        cfg = TrainConfig.from_flags(
            store=uri, out=str(Path(tmp) / "unused"), student=shape["student"], seq_len=shape["seq_len"]
        )
    with one_process_group():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        try:
            loops = {
                "logitstore": LogitstoreLoop(cfg, vocab_size=shape["vocab"], device=device),
                "plain": baselines.PlainLoop(shape["student"], vocab_size=shape["vocab"], device=device),
            }
            measured, speed = measure_loops(loops, batches, shape=shape, device=device)
            weight = loops["logitstore"].model.get_output_embeddings().weight.detach()
            weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight  # sharded: gathered
            head = measure_head(batches[0], weight=weight, device=device, repeats=shape["repeats"])
        finally:
            dist.destroy_process_group()
    ours, plain = measured["logitstore"], measured["plain"]
    return {
        "command": " ".join(["step.py", *sys.argv[1:]]),
        "device": args.device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_at_start": round(os.getloadavg()[0], 2),
        "shape": {**shape, "tokens_per_step": shape["seq_len"] * shape["micro_batch"]},
        "loops": measured,
        "ratios": {
            "ops": ours["ops_per_step"] / plain["ops_per_step"],
            "tokens_per_second": speed,  # the median of step-by-step ratios
        },
        "head": head,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help=f"toy shapes, seconds: {SMOKE}")
    parser.add_argument("--device", default="cpu")
    for key, value in FULL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None, help=f"default {value}")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
