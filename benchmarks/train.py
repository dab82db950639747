"""The student's step time three ways, in one process and one run (machine noise hits all alike):

  store      batches streamed from the store (background prefetch), as `logitstore train` does
  memory     the same batches decoded beforehand and held in memory: the data-wait overhead is store/memory
  online     the same batches, with the teacher's forward pass run in the loop every step (the usual
             online distillation): the speed-up of the offline design is online/store

    python benchmarks/train.py                       # builds a small store with the default teacher first
    python benchmarks/train.py --store STORE --steps 40
    python benchmarks/train.py --smoke               # a toy teacher, llama-tiny, 2 steps of 2 x 64 tokens

`--scaling` measures the step itself at long sequences instead: `llama-small` (vocabulary 49,152,
sampled-16 synthetic store of 200k tokens in samples of up to 1,024) at --seq-len 512, 2048 and 8192 with
the same 8,192 tokens per step, the trainer's step (segment attention, chunked loss from the hidden
states; `new`) against a reference step without them (eager attention with a dense [B, 1, L, L]
block-causal mask, the full [B, L, V] logits cast to fp32 before the loss; `old`). Each configuration runs in its own process, so its
peak RSS is its own; the loss alone is measured the same way (P = 8,192 positions, d = 256). Prints a
table, writes benchmarks/results/train-scaling.{json,md}.

    python benchmarks/train.py --scaling             # ~15 minutes on 2 CPU cores
    python benchmarks/train.py --scaling --smoke     # toy shapes (train_scaling.py's SMOKE), seconds
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs
import torch
import torch.distributed as dist
import train_scaling as scaling  # as _smoke
from torch.distributed.device_mesh import init_device_mesh

from logitstore.data import SAMPLE_CORPUS
from logitstore.pipelines.build import BuildConfig, run_build
from logitstore.pipelines.engines.torch_engine import load_teacher_once, shared_teachers
from logitstore.store.store import Store
from logitstore.streaming.spec import StreamSpec
from logitstore.streaming.stream import store_stream
from logitstore.trainer.config import LossConfig
from logitstore.trainer.model import build_student, shard
from logitstore.trainer.objective import batch_loss, student_outputs

SMOKE = {"student": "llama-tiny", "steps": 2, "seq_len": 64, "micro_batch": 2, "build_tokens": 300, "max_length": 128}


def small_store(tmp: Path, *, tokens: int, teacher: str | None, max_length: int) -> str:
    lines, total = [], 0
    for line in SAMPLE_CORPUS.read_text().splitlines():
        lines.append(line)
        total += len(json.loads(line)["text"]) // 4  # ~4 characters per token
        if total >= tokens:
            break
    (tmp / "data.jsonl").write_text("\n".join(lines) + "\n")
    uri = str(tmp / "store")
    run_build(
        BuildConfig(
            store=uri,
            data=str(tmp / "data.jsonl"),
            id_column="id",
            teacher=teacher,
            max_length=max_length,
            progress=False,
        ),
        log=lambda _: None,
    )
    return uri


def run_steps(model, optimizer, batches, *, teacher_model=None) -> float:
    """Seconds per step over `batches` (the first step is a warm-up and not counted)."""
    times = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        if teacher_model is not None:
            with torch.inference_mode():  # the online baseline: the teacher runs every step
                teacher_model(
                    input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.block_causal_mask()
                )
        optimizer.zero_grad(set_to_none=True)
        loss, _ = batch_loss(student_outputs(model, batch, "cpu"), batch, LossConfig(), device="cpu")
        loss.backward()
        optimizer.step()
        if i:
            times.append(time.perf_counter() - start)
    return sum(times) / len(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scaling", action="store_true", help="the long-sequence table (train_scaling.py)")
    parser.add_argument("--store")
    parser.add_argument("--student", default="llama-small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--build-tokens", type=int, default=6000)
    parser.add_argument("--max-length", type=int, default=512, help="the build's window, in teacher tokens")
    smoke.add_teacher_option(parser)
    args = smoke.parse_args(parser, sizes=SMOKE)
    if args.scaling:
        scaling.main(["--smoke"] if args.smoke else [])
        return

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo")
    with tempfile.TemporaryDirectory() as tmp:
        teacher_path = smoke.smoke_teacher(args, Path(tmp))
        uri = args.store or small_store(
            Path(tmp), tokens=args.build_tokens, teacher=teacher_path, max_length=args.max_length
        )
        view = Store.open(uri).read()
        teacher = view.teacher_name(None)
        meta = view.teachers[teacher]
        model, _ = build_student(args.student, vocab_size=meta.vocab_size, seed=0)
        model = shard(model, mesh=init_device_mesh("cpu", (1,)), offload_optimizer=False, cuda=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def stream():
            spec = StreamSpec(
                teacher=teacher,
                seq_len=args.seq_len,
                micro_batch=args.micro_batch,
                rank=0,
                world_size=1,
                eval_fraction=0.05,
            )
            return store_stream(view, spec)

        s = stream()
        it = iter(s)
        store_s = run_steps(model, optimizer, (next(it) for _ in range(args.steps + 1)))
        wait = s.wait_seconds
        s.close()
        s = stream()
        it = iter(s)
        in_memory = [next(it) for _ in range(args.steps + 1)]
        s.close()
        memory_s = run_steps(model, optimizer, in_memory)
        from logitstore.pipelines.teacher import resolve_teacher

        teacher_model = load_teacher_once(resolve_teacher(teacher_path), "cpu", "auto").model
        online_s = run_steps(model, optimizer, in_memory, teacher_model=teacher_model)
    dist.destroy_process_group()
    tokens = args.seq_len * args.micro_batch
    print(f"student {args.student}, {tokens} tokens per step, {args.steps} steps each, CPU")
    print(
        f"store  (streamed)  : {store_s * 1000:8.1f} ms/step  {tokens / store_s:8,.0f} tokens/s  (waited {wait:.2f} s on data in all)"
    )
    print(f"memory (no I/O)    : {memory_s * 1000:8.1f} ms/step  {tokens / memory_s:8,.0f} tokens/s")
    print(f"online (teacher)   : {online_s * 1000:8.1f} ms/step  {tokens / online_s:8,.0f} tokens/s")
    print(f"data-wait overhead : {store_s / memory_s - 1:+.1%} (target < 2%)")
    print(f"offline speed-up   : {online_s / store_s:.2f}x over online distillation")


if __name__ == "__main__":
    with shared_teachers():  # the benchmark's own forward passes and its builds use one load
        main()
