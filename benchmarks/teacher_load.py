"""What loading a GGUF teacher costs, from the file against its converted folder (`teacher_files.loadable`).

Every process that loads the default teacher (a build's driver and workers, live mode's teacher, the tests'
child processes) would otherwise read the GGUF file: transformers parses its tokenizer and dequantizes its
tensors in Python. The converted folder (fp32 safetensors, written once) holds the same values. This times, alternating
in one run, the tokenizer and config (`describe`) and the whole model (`load`) both ways, and checks that the
two models give the same logits.

    python benchmarks/teacher_load.py [--repeats 2] [--teacher PATH.gguf]
    python benchmarks/teacher_load.py --smoke       # a tiny random GGUF teacher, one load each way

The smoke writes a tiny random teacher as a GGUF file (`logitstore.testing.teachers.save_tiny_gguf`: one
layer, a 512-token BPE) and converts it into a cache of its own, so the default teacher's ~1 minute GGUF
load is left to the real run.

Prints one JSON object: seconds per step (the best of the repeats), the ratios file / folder, the converted
folder's size and the 1-minute load average.
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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from logitstore.environment import environment
from logitstore.pipelines.teacher import resolve_teacher
from logitstore.pipelines.teacher_files import CACHE_VARIABLE, converted_folder
from logitstore.testing.teachers import save_tiny_gguf

SMOKE = {"repeats": 1}


def load_once(path, kwargs: dict) -> tuple[float, float, object]:
    """Seconds for the tokenizer and config, seconds for the model, and the model."""
    start = time.perf_counter()
    AutoTokenizer.from_pretrained(path, **kwargs)
    AutoConfig.from_pretrained(path, **kwargs)
    described = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    return described - start, time.perf_counter() - described, model


def load_both_ways(spec, folder, *, repeats: int) -> tuple[dict, dict]:
    ways = {"file": (spec.path, {"gguf_file": spec.gguf_file}), "folder": (folder, {})}
    seconds: dict[str, dict[str, float]] = {way: {"describe": float("inf"), "load": float("inf")} for way in ways}
    models = {}
    for _ in range(repeats):
        for way, (path, kwargs) in ways.items():
            described, loaded, models[way] = load_once(path, kwargs)
            seconds[way]["describe"] = min(seconds[way]["describe"], described)
            seconds[way]["load"] = min(seconds[way]["load"], loaded)
    return seconds, models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--teacher", default=None, help="a .gguf file (default: the default teacher)")
    args = smoke.parse_args(parser, sizes=SMOKE)
    if args.smoke and not args.teacher:
        with tempfile.TemporaryDirectory() as tmp, environment(**{CACHE_VARIABLE: tmp}):
            args.teacher = save_tiny_gguf(Path(tmp) / "tiny.gguf")
            compare(args)
    else:
        compare(args)


def compare(args) -> None:
    """Both ways, alternating; one JSON object printed."""
    spec = resolve_teacher(args.teacher)
    assert spec.gguf_file, "the teacher must be a GGUF file"
    start = time.perf_counter()
    folder = converted_folder(spec)  # made here if the cache lacks it
    converting = time.perf_counter() - start
    assert folder is not None, "the cache cannot be written (LOGITSTORE_CACHE)"
    seconds, models = load_both_ways(spec, folder, repeats=args.repeats)
    ids = torch.arange(1, 257)[None]
    with torch.inference_mode():
        same = torch.equal(models["file"](ids).logits, models["folder"](ids).logits)
    print(
        json.dumps(
            {
                "teacher": spec.name,
                "seconds": seconds,
                "ratio_describe": round(seconds["file"]["describe"] / seconds["folder"]["describe"], 1),
                "ratio_load": round(seconds["file"]["load"] / seconds["folder"]["load"], 1),
                "first_conversion_seconds": round(converting, 1),
                "folder_bytes": sum(p.stat().st_size for p in folder.iterdir()),
                "same_logits": same,
                "load_average_1m": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
