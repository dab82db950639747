"""`logitstore export --what entries` throughput: positions per second from a store to a Parquet file
on local disk.

Writes a synthetic store through the real writer (`stream.py`'s `SyntheticTeacher`: sampled-16 over a
49,152-token vocabulary by default, parts of ~16k tokens), then exports it with `entries.write_entries`
(read, decode, order by probability, Arrow arrays, Parquet with zstd, fsync and rename) and reports the
best of `--repeat` timed exports after a warm-up export (numba's first compile and lazy imports):

    python benchmarks/export.py                   # 2M tokens, sampled-16, a local store in a temporary folder
    python benchmarks/export.py --mode topk --k 64
    python benchmarks/export.py --smoke           # a toy size, seconds (tests/test_benchmarks.py runs it)

It prints one JSON object on stdout: `positions_per_second` and `tokens_per_second` (wall clock),
`positions_per_cpu_second` (the process's CPU time, both of its threads: less bent by other processes
on a shared machine), the one-minute load average at the end, the output's bytes per position and the
shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
from _timing import timed  # benchmarks/ is on sys.path when a script here runs
from stream import (  # the streaming benchmark's synthetic store, written through the real writer
    WRITER_THREADS,
    write_store,
)

from logitstore.store.entries import write_entries
from logitstore.store.store import Store

TARGET = 1_000_000  # positions/s to local disk for sampled-16, on a 2-core machine
SMOKE = {"tokens": 32_768, "sample_len": 512, "part_tokens": 4096, "repeat": 1}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2_000_000, help="tokens in the store (default 2M)")
    p.add_argument("--vocab", type=int, default=49_152)
    p.add_argument("--sample-len", type=int, default=1024)
    p.add_argument("--mode", choices=("topk", "sampled"), default="sampled")
    p.add_argument("--k", type=int, default=16, help="entries per position (topk) or draws (sampled)")
    p.add_argument("--part-tokens", type=int, default=16_384)
    p.add_argument("--repeat", type=int, default=3, help="timed exports, the best kept")
    p.add_argument("--folder", help="where the store and the file go (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help=f"a toy size: {SMOKE}")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        result = run(args, Path(folder))
    print(json.dumps(result, indent=2))
    return result


def run(args, folder: Path) -> dict:
    uri = str(folder / "store")
    shapes = SimpleNamespace(
        **vars(args), commit_every=64, part_layout="packed+students", writer_threads=WRITER_THREADS
    )
    written = write_store(uri, shapes, log=lambda line: print(line, file=sys.stderr))
    view = Store.open(uri).read()
    out = folder / "entries.parquet"
    write_entries(view, out, force=True)  # warm-up: numba's compile, lazy imports, the page cache
    cpu: list[float] = []

    def export() -> dict:
        start = time.process_time()
        summary = write_entries(Store.open(uri).read(), out, force=True)
        cpu.append(time.process_time() - start)
        return summary

    seconds, summary = timed(export, repeat=args.repeat)
    positions = summary["positions"]
    meta = pq.read_metadata(out)
    return {
        "positions_per_second": positions / seconds,
        "tokens_per_second": summary["tokens"] / seconds,
        "target_positions_per_second": TARGET,
        "seconds": seconds,
        # CPU seconds of the process (both threads), the least of the runs: what the export costs however
        # busy the machine is, where the wall clock counts the other processes' share of the cores too
        "positions_per_cpu_second": positions / min(cpu),
        "load_average": os.getloadavg()[0],
        "positions": positions,
        "samples": summary["samples"],
        "row_groups": meta.num_row_groups,
        "file_bytes_per_position": out.stat().st_size / positions,
        "shapes": {
            "mode": args.mode,
            "k": args.k,
            "vocab": args.vocab,
            "tokens": written["tokens"],
            "parts": written["parts"],
            "entries_per_position": written["entries_per_position"],
        },
        "measured_at": time.strftime("%Y-%m-%d"),
    }


if __name__ == "__main__":
    main()
