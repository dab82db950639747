"""Student tokens/s in live mode (teacher process beside the trainer; shared memory on CPU, CUDA IPC on a GPU) versus
store mode (the same teacher's output read from a store), same node, same data, seed and student.

The store is built first (not timed). Both runs then train the same steps; the rate is the median of
the steps' tokens/s after the first (which pays start-up). Both variants run in this one invocation,
one after the other, so machine noise hits them alike.

    python benchmarks/live.py                      # llama-small, 10 steps of 2 x 256 tokens, ~5 minutes on 2 cores
    python benchmarks/live.py --steps 30 --student llama-tiny
    python benchmarks/live.py --smoke              # a toy teacher, llama-tiny, 2 steps of 2 x 64 tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs

from logitstore.data import SAMPLE_CORPUS
from logitstore.format.sparsity import Sparsity
from logitstore.live.config import LiveConfig
from logitstore.pipelines.build import BuildConfig, run_build
from logitstore.pipelines.teacher import resolve_teacher
from logitstore.trainer.config import TrainConfig
from logitstore.trainer.train import launch

SMOKE = {"steps": 2, "student": "llama-tiny", "seq_len": 64, "docs": 2, "max_length": 128}


def rates(out: Path) -> tuple[float, float]:
    """(median tokens/s after the first step, median data wait per step in seconds)."""
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r][1:]
    return statistics.median(r["tokens_per_second"] for r in rows), statistics.median(
        r["data_wait_seconds"] for r in rows
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--student", default="llama-small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--docs", type=int, default=24, help="documents of the sample corpus to use")
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=512, help="the teacher's window, in tokens")
    smoke.add_teacher_option(parser)
    args = smoke.parse_args(parser, sizes=SMOKE)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        teacher = smoke.smoke_teacher(args, tmp)
        data = tmp / "corpus.jsonl"
        data.write_text("\n".join(SAMPLE_CORPUS.read_text().splitlines()[: args.docs]) + "\n")
        sparsity = Sparsity(k=args.top_k)
        store = str(tmp / "store")
        run_build(
            BuildConfig(
                store=store,
                data=str(data),
                teacher=teacher,
                max_length=args.max_length,
                sparsity=sparsity,
                progress=False,
            ),
            log=lambda _: None,
        )
        common = dict(
            student=args.student,
            steps=args.steps,
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            warmup_steps=2,
            eval_fraction=0.05,
            log_every=10**9,
        )
        launch(TrainConfig.from_flags(store=store, out=str(tmp / "store-run"), **common))
        live = LiveConfig(data=str(data), teacher=teacher, max_length=args.max_length, sparsity=sparsity)
        launch(TrainConfig.from_flags(store=None, live=live, out=str(tmp / "live-run"), **common))
        (store_rate, store_wait), (live_rate, live_wait) = rates(tmp / "store-run"), rates(tmp / "live-run")
        header = json.loads((tmp / "live-run" / "metrics.jsonl").read_text().splitlines()[0])
        transport = header["live_transport"].replace("_", " ")
        teacher_name = resolve_teacher(teacher).name

    print(
        f"{args.student}, {args.steps} steps of {args.micro_batch} x {args.seq_len} tokens, "
        f"teacher {teacher_name} top-{args.top_k}, 1 process\n"
    )
    print("| signal | student tokens/s | data wait per step |")
    print("|---|---:|---:|")
    print(f"| store | {store_rate:,.0f} | {store_wait * 1000:,.0f} ms |")
    print(f"| live ({transport}) | {live_rate:,.0f} | {live_wait * 1000:,.0f} ms |")
    print(f"\nlive / store throughput: {live_rate / store_rate:.2f}x")


if __name__ == "__main__":
    main()
