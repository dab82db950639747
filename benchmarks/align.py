"""Cross-tokenizer alignment throughput: the default teacher's tokenizer (SmolLM2) against GPT-2's.

Over the shipped sample corpus, on one core (the Rust tokenizers' thread pool is switched off;
numba runs on one thread), measures separately:

  tokenize (ids only)      `tokenizer(texts)`, the build's existing cost, for reference
  tokenize + byte ends     `align.encode_with_byte_ends`: the same call with offsets, plus the
                           character -> UTF-8 byte conversion and the split-character fix-ups
  align_groups             the two-pointer numba kernel, one call per document

Tokens/s counts the tokens of the side(s) each step handles; align_groups counts teacher and
student tokens together. A warm-up call runs first, so numba's compile (or cache load) is not
timed. The last lines say how the texts split into groups.

    python benchmarks/align.py                      # ~85k teacher tokens, best of 5, ~30 s on 2 CPU cores
    python benchmarks/align.py --copies 4 --repeat 3
    python benchmarks/align.py --out benchmarks/results/align.md
    python benchmarks/align.py --smoke              # 8 documents, one run per step
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers loads: one core, like numba here

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs
import numpy as np
from _timing import timed  # as _smoke

from logitstore.data import SAMPLE_CORPUS
from logitstore.pipelines.align import align_groups, encode_with_byte_ends
from logitstore.testing.gpt2 import gpt2_tokenizer

SMOKE = {"docs": 8, "repeat": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=None, help="only the corpus's first N documents (default: all)")
    parser.add_argument("--copies", type=int, default=1, help="repeat the corpus this many times")
    parser.add_argument("--repeat", type=int, default=5, help="best of this many runs per step")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    args = smoke.parse_args(parser, sizes=SMOKE)

    from logitstore.pipelines.teacher import describe_teacher

    teacher = describe_teacher(None).tokenizer
    student = gpt2_tokenizer()
    texts = [json.loads(line)["text"] for line in SAMPLE_CORPUS.read_text().splitlines()[: args.docs]] * args.copies
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)

    def align_all(t_enc, s_enc):
        return [align_groups(te, se) for (_, te), (_, se) in zip(t_enc, s_enc)]

    # Warm-up: numba compile / cache load, tokenizer caches.
    align_all(encode_with_byte_ends(teacher, texts[:2]), encode_with_byte_ends(student, texts[:2]))

    t_ids, _ = timed(lambda: teacher(texts)["input_ids"], repeat=args.repeat)
    s_ids, _ = timed(lambda: student(texts)["input_ids"], repeat=args.repeat)
    t_off, t_enc = timed(lambda: encode_with_byte_ends(teacher, texts), repeat=args.repeat)
    s_off, s_enc = timed(lambda: encode_with_byte_ends(student, texts), repeat=args.repeat)
    t_align, groups = timed(lambda: align_all(t_enc, s_enc), repeat=args.repeat)

    nt = sum(len(ids) for ids, _ in t_enc)
    ns = sum(len(ids) for ids, _ in s_enc)
    g = np.concatenate(groups)
    t_len, s_len = g[:, 1] - g[:, 0], g[:, 3] - g[:, 2]
    rows = [
        ("teacher tokenize (ids only)", nt, t_ids),
        ("student tokenize (ids only)", ns, s_ids),
        ("teacher tokenize + byte ends", nt, t_off),
        ("student tokenize + byte ends", ns, s_off),
        ("align_groups (teacher + student tokens)", nt + ns, t_align),
    ]
    lines = [
        (
            f"SmolLM2 (teacher, {nt:,} tokens) vs GPT-2 (student, {ns:,} tokens): {len(texts)} texts, "
            f"{n_bytes:,} bytes of the sample corpus; one core, best of {args.repeat}."
        ),
        "",
        "| step | tokens | seconds | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {n:,} | {sec:.4f} | {n / sec:,.0f} |" for name, n, sec in rows]
    lines += [
        "",
        (
            f"align_groups is {(t_off + s_off) / t_align:,.0f}x faster than tokenizing both sides with offsets; "
            f"offsets + byte ends cost {t_off / t_ids:.2f}x (teacher) and {s_off / s_ids:.2f}x (student) "
            "a plain ids-only call."
        ),
        (
            f"{len(g):,} groups: {np.mean((t_len == 1) & (s_len == 1)):.1%} are one teacher token to one student "
            f"token; {nt / len(g):.2f} teacher and {ns / len(g):.2f} student tokens per group on average; "
            f"largest group {t_len.max()} teacher / {s_len.max()} student tokens."
        ),
    ]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        docs = f" --docs {args.docs}" if args.docs else ""
        cmd = f"python benchmarks/align.py{docs} --copies {args.copies} --repeat {args.repeat}"
        args.out.write_text(report + f"\n\nCommand: `{cmd}`\n")


if __name__ == "__main__":
    main()
