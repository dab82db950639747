"""What the store side costs a build: teacher forward alone versus the whole `logitstore build`.

Both run in one process on the same samples and the same batches (the teacher is loaded once and
shared), alternating, so machine noise hits both alike. The difference is everything that is not the
teacher: reading and tokenizing, windowing, entry selection, encoding, compression, writing, commits.
Target: the store side adds under 5% to the teacher's time.

    python benchmarks/build.py                   # ~8k tokens of the sample corpus, CPU
    python benchmarks/build.py --tokens 50000 --device cuda
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from logitstore.data import SAMPLE_CORPUS
from logitstore.pipelines.build import BuildConfig, run_build
from logitstore.pipelines.data import window
from logitstore.pipelines.teacher import describe_teacher, sparse_topk_forward
from logitstore.pipelines.workers import _load_teacher_once, token_budget_batches


def corpus_slice(path: Path, *, tokens: int, tokenizer) -> int:
    """Write the first documents of the sample corpus holding about `tokens` tokens; returns the count."""
    total, lines = 0, []
    for line in SAMPLE_CORPUS.read_text().splitlines():
        n = len(tokenizer(json.loads(line)["text"])["input_ids"])
        lines.append(line)
        total += n
        if total >= tokens:
            break
    path.write_text("\n".join(lines) + "\n")
    return total


def forward_only(model, tokenizer, data: Path, *, max_length: int, batch_tokens: int, k: int) -> float:
    """The teacher's share: the same windows and batches as the build, forward passes only."""
    windows = [w for line in data.read_text().splitlines()
               for w in window(np.array(tokenizer(json.loads(line)["text"])["input_ids"]), max_length=max_length)]
    lengths = np.array([len(w) for w in windows])
    order = np.argsort(-lengths, kind="stable")
    start = time.perf_counter()
    for rows in token_budget_batches(lengths[order], order, budget=batch_tokens):
        ids = torch.zeros((len(rows), lengths[rows].max()), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, : lengths[i]] = torch.as_tensor(windows[i])
            mask[r, : lengths[i]] = 1
        sparse_topk_forward(model, ids, mask, k=k)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    info = describe_teacher(None)
    model = _load_teacher_once(info.spec, args.device, "auto").model
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        n_tokens = corpus_slice(data, tokens=args.tokens, tokenizer=info.tokenizer)
        forward_s, build_s = [], []
        for r in range(args.repeats):
            forward_s.append(forward_only(model, info.tokenizer, data, max_length=args.max_length,
                                          batch_tokens=args.batch_tokens, k=args.k))
            cfg = BuildConfig(store=str(Path(tmp) / f"store-{r}"), data=str(data), id_column="id",
                              max_length=args.max_length, batch_tokens=args.batch_tokens, device=args.device,
                              progress=False)
            summary = run_build(cfg, log=lambda _: None)
            build_s.append(summary.seconds)
    f, b = min(forward_s), min(build_s)
    print(f"{n_tokens:,} tokens, top-{args.k}, max length {args.max_length}, device {args.device}; best of {args.repeats}")
    print(f"teacher forward alone : {f:8.2f} s  ({n_tokens / f:,.0f} tokens/s)")
    print(f"full build            : {b:8.2f} s  ({n_tokens / b:,.0f} tokens/s, {summary.bytes_per_token:.1f} bytes/token)")
    print(f"store side overhead   : {b / f - 1:+.1%} of the teacher's time (target < +5%)")


if __name__ == "__main__":
    main()
