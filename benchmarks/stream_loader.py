"""The stream read in the consumer's process against a `torch.utils.data.DataLoader` with worker
processes, side by side in one run (alternating, best of `--repeats`).

Worker w of W yields the steps w, w + W, ... (logitstore/streaming/stream.py, "DataLoader workers"), so both ways
yield the same batches; this measures what the processes cost or gain. It reads a store written by
`benchmarks/stream.py --store PATH` (any store works), one epoch per run, timed after the first batch
(worker start-up excluded), no model in the loop.

    python benchmarks/stream.py --store /tmp/bench-store
    python benchmarks/stream_loader.py /tmp/bench-store --memory-budget 4100096 --workers 2
    python benchmarks/stream_loader.py --smoke      # a synthetic store of 8,192 tokens (stream.py's), one worker
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs
import stream as stream_benchmark  # as _smoke: benchmarks/stream.py's synthetic store
import torch

import logitstore

SMOKE = {"workers": 1, "seq_len": 256, "micro_batch": 2, "repeats": 1}
SMOKE_STORE = {"tokens": 8192, "sample_len": 256, "part_tokens": 1024}  # 8 parts


def epoch_tokens_per_second(view, *, workers: int, args) -> float:
    stream = logitstore.stream(
        view,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        seed=0,
        memory_budget=args.memory_budget,
        eval_fraction=0.0,
    )
    steps = stream.steps_per_epoch
    if workers:
        batches = iter(
            torch.utils.data.DataLoader(
                stream, batch_size=None, num_workers=workers, multiprocessing_context="spawn", prefetch_factor=4
            )
        )
    else:
        batches = iter(stream)
    next(batches)  # worker start-up and the first reads are not the steady state
    start, tokens = time.perf_counter(), 0
    for batch in itertools.islice(batches, steps - 1):
        tokens += batch.n_tokens
    seconds = time.perf_counter() - start
    del batches
    stream.close()
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", nargs="?", help="the store to read (with --smoke: a synthetic one if none)")
    parser.add_argument("--memory-budget", default=None, help="bytes or e.g. 512MB (default: the stream's)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = smoke.parse_args(parser, sizes=SMOKE)
    if args.store:
        compare(args)
    elif args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.store = str(Path(tmp) / "store")
            stream_benchmark.write_synthetic(args.store, **SMOKE_STORE)
            compare(args)
    else:
        parser.error("name the store to read (or --smoke)")


def compare(args) -> None:
    """Both ways, alternating, the best of each; printed."""
    view = logitstore.open(args.store)
    best = {0: 0.0, args.workers: 0.0}
    for _ in range(args.repeats):
        for workers in best:
            best[workers] = max(best[workers], epoch_tokens_per_second(view, workers=workers, args=args))
    print(
        f"store {args.store}: {view.info()['tokens']:,} tokens; seq_len {args.seq_len} x micro_batch "
        f"{args.micro_batch}; best of {args.repeats}, alternating"
    )
    print(f"in the consumer's process : {best[0]:>12,.0f} tokens/s")
    print(
        f"DataLoader, {args.workers} workers   : {best[args.workers]:>12,.0f} tokens/s "
        f"({best[args.workers] / best[0]:.2f}x)"
    )


if __name__ == "__main__":
    main()
