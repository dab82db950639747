"""`--smoke`, which every script here takes: the real run's code at toy size, seconds on 2 CPU cores, with no
network, GPU or vLLM (vllm_engine.py's smoke excepted: vLLM is its point). tests/test_benchmark_smokes.py and
the tests beside it run each script's smoke, so a change that breaks a benchmark fails the suite."""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(parser: argparse.ArgumentParser, argv=None, *, sizes: dict, aliases: tuple[str, ...] = ()):
    """`parser`'s arguments plus `--smoke` (and its `aliases`); with `--smoke`, each option named in
    `sizes` that was left at its default takes its toy value there."""
    shown = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in sizes.items())
    parser.add_argument("--smoke", *aliases, action="store_true", help=f"toy size, seconds (the tests run it): {shown}")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in sizes.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    return args


def add_teacher_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--teacher",
        default=None,
        help="the teacher (a model folder, .gguf file or Hub id; default: the default teacher, or with --smoke "
        "a toy one: one random layer over a 1,024-token BPE)",
    )


def smoke_teacher(args, folder: Path) -> str | None:
    """`--teacher`; with `--smoke` and none given, a toy teacher saved under `folder` (one random layer over a
    1,024-token BPE: the forward pass, the student's head and the loss cost next to nothing); else None, the
    default teacher."""
    if args.teacher or not args.smoke:
        return args.teacher
    # the toy teacher's torch and transformers load only where a smoke makes one
    from logitstore.testing.teachers import save_toy_teacher

    return save_toy_teacher(folder / "toy-teacher")
