"""`python benchmarks/train.py --scaling` (or `python benchmarks/train_scaling.py`): the student's step at long
sequences, the trainer's step (segment attention, chunked head) against one with a dense mask and full logits, at
the same tokens per step. See benchmarks/train.py's docstring for the shapes.

Each configuration runs in a process of its own (`train_scaling.py --measure PATH:SEQ`), so the peak RSS it
reports (`ru_maxrss`) is its own: the model, the optimizer state, the stream's buffers and the step.

    python benchmarks/train_scaling.py --smoke      # toy shapes (SMOKE below); writes no results unless --out
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs
import torch

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Shapes:
    tokens_per_step: int
    seq_lens: tuple[int, ...]  # shortest first; the ratios compare the longest with the shortest
    vocab: int
    student: str
    store_tokens: int  # the synthetic sampled-16 store's
    sample_len: int
    part_tokens: int
    steps: int  # timed steps per configuration (after one warm-up step)
    # The replaced path at the longest sequence takes about a minute a step here: fewer steps (so its reported
    # last-step loss is one step earlier than the others').
    old_longest_steps: int
    loss_width: int  # the hidden size of the loss-alone measurement


FULL = Shapes(
    tokens_per_step=8192,
    seq_lens=(512, 2048, 8192),
    vocab=49_152,
    student="llama-small",
    store_tokens=200_000,
    sample_len=1024,
    part_tokens=16_384,
    steps=3,
    old_longest_steps=2,
    loss_width=256,
)
SMOKE = Shapes(
    tokens_per_step=256,
    seq_lens=(64, 256),
    vocab=1024,
    student="llama-tiny",
    store_tokens=4096,
    sample_len=256,
    part_tokens=1024,
    steps=1,
    old_longest_steps=1,
    loss_width=64,
)
# Targets, by ratio (named in the results after the shapes): memory at the longest <= 1.5x at the shortest,
# tokens/s at the longest >= 80% of the shortest, loss memory <= 1/8.
TARGETS = {"memory": 1.5, "speed": 0.8, "loss_memory_ratio": 1 / 8}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"write train-scaling.json and .md here ({RESULTS})")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one configuration, in this process
    parser.add_argument("--store", help=argparse.SUPPRESS)  # with --measure: the synthetic store
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)  # with --measure: timed steps
    args = smoke.parse_args(parser, argv, sizes={"out": None})  # the smoke leaves the recorded results alone
    shapes = SMOKE if args.smoke else FULL
    if args.measure:
        print(json.dumps(measure(args.measure, store=args.store, steps=args.steps, shapes=shapes)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        _write_store(store, shapes)
        rows = []
        for path in ("new", "old"):
            for seq in shapes.seq_lens:
                longest_old = (path, seq) == ("old", shapes.seq_lens[-1])
                steps = shapes.old_longest_steps if longest_old else shapes.steps
                rows.append(_run(f"{path}:{seq}", store=store, steps=steps, smoke=args.smoke))
        loss = [_run(f"loss-{path}:0", store=store, steps=1, smoke=args.smoke) for path in ("new", "old")]
    result = _summarise(rows, loss, shapes)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "train-scaling.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "train-scaling.md").write_text(result["table"] + "\n")
    print(result["table"])


def _write_store(uri: str, shapes: Shapes) -> None:
    import stream as stream_benchmark  # benchmarks/stream.py: its synthetic teacher and writer

    stream_benchmark.write_synthetic(
        uri,
        vocab=shapes.vocab,
        tokens=shapes.store_tokens,
        sample_len=shapes.sample_len,
        part_tokens=shapes.part_tokens,
        commit_every=8,
    )


def _run(what: str, *, store: str, steps: int, smoke: bool) -> dict:
    started = time.perf_counter()
    command = [sys.executable, __file__, "--measure", what, "--store", store, "--steps", str(steps)]
    out = subprocess.run(command + (["--smoke"] if smoke else []), capture_output=True, text=True)
    if out.returncode != 0:  # the replaced path at the longest may not fit in memory: that is a result too
        print(f"  {what}: failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        path, seq = what.split(":")
        return {"path": path.removeprefix("loss-"), "seq_len": int(seq), "failed": f"exit {out.returncode}"}
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  {what:>12}: {json.dumps(row)} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    return row


def measure(what: str, *, store: str, steps: int, shapes: Shapes) -> dict:
    """One configuration, in this process: `new:SEQ`/`old:SEQ` (training steps) or `loss-new`/`loss-old`."""
    path, seq = what.split(":")
    torch.manual_seed(0)
    if path.startswith("loss-"):
        return _measure_loss(path.removeprefix("loss-"), shapes)
    return _measure_steps(path, seq_len=int(seq), store=store, steps=steps, shapes=shapes)


def _measure_steps(path: str, *, seq_len: int, store: str, steps: int, shapes: Shapes) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from logitstore.store.store import Store
    from logitstore.streaming.spec import StreamSpec
    from logitstore.streaming.stream import store_stream
    from logitstore.trainer.config import LossConfig
    from logitstore.trainer.model import build_student, shard
    from logitstore.trainer.objective import batch_loss, student_outputs

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + seq_len % 97))
    dist.init_process_group("gloo")
    view = Store.open(store).read()
    model, _ = build_student(shapes.student, vocab_size=shapes.vocab, seed=0)
    model.config.max_position_embeddings = max(seq_len, model.config.max_position_embeddings)
    if path == "old":
        model.config._attn_implementation = "eager"
    model = shard(model, mesh=init_device_mesh("cpu", (1,)), offload_optimizer=False, cuda=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    micro_batch = shapes.tokens_per_step // seq_len
    spec = StreamSpec(seq_len=seq_len, micro_batch=micro_batch, rank=0, world_size=1, seed=0, eval_fraction=0.0)
    stream = store_stream(view, spec)
    batches = iter(stream)
    cfg = LossConfig()
    times = []
    for i in range(steps + 1):  # the first step warms up and is not timed
        batch = next(batches)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if path == "new":
            loss, _ = batch_loss(student_outputs(model, batch, "cpu"), batch, cfg, device="cpu")
        else:
            loss = _old_loss(model, batch, cfg)
        loss.backward()
        optimizer.step()
        if i:
            times.append(time.perf_counter() - start)
    stream.close()
    dist.destroy_process_group()
    seconds = sum(times) / len(times)
    return {
        "path": path,
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "seconds_per_step": seconds,
        "tokens_per_second": shapes.tokens_per_step / seconds,
        "peak_rss_bytes": _peak_rss(),
        "loss": float(loss),
    }


def _old_loss(model, batch, cfg):
    """The replaced path: eager attention over a dense block-causal mask, full logits cast to fp32."""
    from logitstore.trainer.losses import distill_loss
    from logitstore.trainer.objective import sparse_targets

    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.block_causal_mask())
    logits = out.logits.reshape(-1, out.logits.shape[-1])[batch.positions].float()
    loss, _ = distill_loss(logits, sparse_targets(batch, "cpu"), cfg)
    return loss


def _measure_loss(path: str, shapes: Shapes) -> dict:
    """The loss alone at P = tokens per step positions, hidden `loss_width` (256), sampled-16 targets: value
    and gradients, the head applied in chunks (new) or as one [P, V] matmul (old). Peak RSS over the
    process's RSS before the call."""
    from logitstore.streaming.targets import SparseTargets
    from logitstore.trainer.config import LossConfig
    from logitstore.trainer.losses import chunked_distill_loss, distill_loss

    P, d, per, V = shapes.tokens_per_step, shapes.loss_width, 12, shapes.vocab
    hidden = torch.randn(P, d, requires_grad=True)
    weight = (torch.randn(V, d) * 0.02).requires_grad_()
    targets = SparseTargets(
        entry_ids=torch.randint(0, V, (P * per,)),
        entry_logprobs=torch.full((P * per,), -3.0),
        entry_pos=torch.arange(P).repeat_interleave(per),
        tail=torch.full((P,), 0.1),
        target_ids=torch.randint(0, V, (P,)),
        target_logprobs=torch.full((P,), -2.0),
        entry_counts=torch.ones(P * per),
    )
    before = _current_rss()
    start = time.perf_counter()
    if path == "new":
        loss, _ = chunked_distill_loss(hidden, weight, targets, LossConfig())
    else:
        loss, _ = distill_loss((hidden @ weight.T).float(), targets, LossConfig())
    loss.backward()
    return {
        "path": path,
        "positions": P,
        "vocab": V,
        "seconds": time.perf_counter() - start,
        "loss_peak_bytes": _peak_rss() - before,
    }


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _summarise(rows: list[dict], loss: list[dict], shapes: Shapes) -> dict:
    by = {(r["path"], r["seq_len"]): r for r in rows}
    short, long = shapes.seq_lens[0], shapes.seq_lens[-1]
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    lines = [
        f"`{shapes.student}` (vocab {shapes.vocab:,}), {shapes.tokens_per_step:,} tokens per step, CPU, "
        f"{time.strftime('%Y-%m-%d')}",
        "",
        "| seq_len | micro-batch | new tokens/s | new peak RSS | old tokens/s | old peak RSS |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    cell = lambda r, key, fmt: "failed (" + r["failed"] + ")" if "failed" in r else fmt(r[key])
    for seq in shapes.seq_lens:
        new, old = by[("new", seq)], by[("old", seq)]
        lines.append(
            f"| {seq} | {shapes.tokens_per_step // seq} | {cell(new, 'tokens_per_second', '{:,.0f}'.format)} "
            f"| {cell(new, 'peak_rss_bytes', gib)} | {cell(old, 'tokens_per_second', '{:,.0f}'.format)} "
            f"| {cell(old, 'peak_rss_bytes', gib)} |"
        )
    new_loss, old_loss = (next(r for r in loss if r["path"] == p) for p in ("new", "old"))

    def ratio(a, b, key):
        return None if "failed" in a or "failed" in b else a[key] / max(b[key], 1)

    memory, speed = f"memory_{long}_over_{short}", f"speed_{long}_over_{short}"
    ratios = {
        memory: ratio(by[("new", long)], by[("new", short)], "peak_rss_bytes"),
        speed: ratio(by[("new", long)], by[("new", short)], "tokens_per_second"),
        "loss_memory_ratio": ratio(new_loss, old_loss, "loss_peak_bytes"),
        f"old_memory_{long}_over_{short}": ratio(by[("old", long)], by[("old", short)], "peak_rss_bytes"),
        f"new_over_old_speed_{long}": ratio(by[("new", long)], by[("old", long)], "tokens_per_second"),
    }
    targets = {memory: TARGETS["memory"], speed: TARGETS["speed"], "loss_memory_ratio": TARGETS["loss_memory_ratio"]}
    lines += [
        "",
        f"loss alone (P = {shapes.tokens_per_step:,}, d = {shapes.loss_width}): chunked "
        f"{cell(new_loss, 'loss_peak_bytes', gib)}, full logits {cell(old_loss, 'loss_peak_bytes', gib)} "
        "(peak RSS over the RSS before the call)",
        "",
    ]
    for key, value in ratios.items():
        if value is None:
            lines.append(f"- {key}: not measured (a run failed)")
            continue
        target = targets.get(key)
        verdict = (
            ""
            if target is None
            else (
                " (target <= {:.3g}: {})".format(target, "met" if value <= target else "MISSED")
                if key != speed
                else " (target >= {:.3g}: {})".format(target, "met" if value >= target else "MISSED")
            )
        )
        lines.append(f"- {key}: {value:.3f}{verdict}")
    return {"rows": rows, "loss": loss, "ratios": ratios, "targets": targets, "table": "\n".join(lines)}


if __name__ == "__main__":
    main()
