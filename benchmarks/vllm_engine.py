"""Teacher engines side by side: the torch engine vs vLLM (`--vllm-output hidden` and `logprobs`) on one teacher.

The default teacher (SmolLM2-135M-Instruct, its GGUF dequantized to fp32) saved as a Hugging Face folder with
`save_pretrained`, since vLLM loads GGUF only through a plugin; windows of `--max-length` tokens of the sample
corpus; each engine's `compute` (forward passes and entry selection, what a build's worker runs; no store
writes) over units of 16,384 tokens. Tokens/s with start-up excluded (compute only) and included (the engine's
construction: loading the teacher, and for vLLM starting its engine core and worker processes). Each variant
runs in its own process, one after another.

    python benchmarks/vllm_engine.py                          # in a virtualenv with vLLM (scripts/vllm_env.sh)
    python benchmarks/vllm_engine.py --tokens 4096 --variants torch:sample vllm-hidden:sample
    python benchmarks/vllm_engine.py --smoke        # the vLLM tests' tiny teacher, 512 tokens, torch and one vLLM

The smoke runs a random 2-layer Llama with head size 32 (`logitstore.testing.teachers.save_vllm_teacher`)
instead of the converted default teacher, and two variants: vLLM's engine start (~40-120 s on 2 cores) is
most of it. Like the real run it needs vLLM (tests/test_vllm_build.py runs it in the vLLM job). Exits 1 if
a variant fails.

Needs the `if __name__ == "__main__"` guard and no logitstore import at the top: vLLM spawns its processes,
which import this file again, and vLLM 0.32's CPU build fails in a worker that has numba (llvmlite) loaded
(its Triton fallback walks every loaded module).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs

UNIT_TOKENS = 16384
DEFAULT_FOLDER = Path("/tmp/logitstore-bench/smollm2-135m-hf")
SMOKE = {"tokens": 512, "max_length": 128, "variants": ["torch:sample", "vllm-hidden:sample"]}
SPARSITIES = {"sample": {"mode": "sampled", "n": 16}, "topk": {"k": 64}}
VARIANTS = {  # name: (engine, vLLM output)
    "torch": ("torch", "hidden"),
    "vllm-hidden": ("vllm", "hidden"),
    "vllm-logprobs": ("vllm", "logprobs"),
}


def convert_default_teacher(folder: Path) -> Path:
    """The default teacher as a Hugging Face folder (fp32 safetensors and its tokenizer), once."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM

    from logitstore.pipelines.teacher import load_teacher

    teacher = load_teacher(None, device="cpu")
    # Loaded from GGUF, the model counts as quantized and save_pretrained refuses it: the same weights
    # (dequantized, fp32) in a model made from its config without the GGUF marker are saved instead.
    config = teacher.model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(teacher.model.state_dict())
    model.save_pretrained(folder)
    teacher.tokenizer.save_pretrained(folder)
    return folder


def windows(teacher: Path, *, tokens: int, max_length: int) -> list[list[int]]:
    """Windows of `max_length` tokens of the sample corpus, `tokens` in all (the corpus repeated if short)."""
    from transformers import AutoTokenizer

    from logitstore.data import SAMPLE_CORPUS

    tokenizer = AutoTokenizer.from_pretrained(teacher)
    stream: list[int] = []
    docs = [json.loads(line)["text"] for line in SAMPLE_CORPUS.read_text().splitlines()]
    while len(stream) < tokens:
        for ids in tokenizer(docs)["input_ids"]:
            stream.extend(ids)
    stream = stream[:tokens]
    return [stream[i : i + max_length] for i in range(0, len(stream), max_length)]


def run_variant(teacher: str, variant: str, sparsity: str, *, tokens: int, max_length: int) -> dict:
    """One engine in this process: construct, compute every unit, close. Seconds of each."""
    import numpy as np

    from logitstore.format.sparsity import Sparsity
    from logitstore.pipelines.engines.settings import WorkerSettings
    from logitstore.pipelines.teacher import resolve_teacher
    from logitstore.pipelines.workers import TeacherWorker

    engine, output = VARIANTS[variant]
    rows = [np.asarray(w, dtype=np.int64) for w in windows(Path(teacher), tokens=tokens, max_length=max_length)]
    settings = WorkerSettings(
        teacher_spec=resolve_teacher(teacher),
        device="cpu",
        dtype="float32",
        sparsity=Sparsity(**SPARSITIES[sparsity]),
        batch_tokens=8192,
        seed=0,
        engine=engine,
        max_length=max_length,
        vllm_output=output,
    )
    start = time.perf_counter()
    worker = TeacherWorker(settings)
    ready = time.perf_counter()
    per_unit = max(1, UNIT_TOKENS // max_length)
    for first in range(0, len(rows), per_unit):
        unit = rows[first : first + per_unit]
        worker.engine.compute([f"w{first + i}" for i in range(len(unit))], unit, seed=first)
    done = time.perf_counter()
    worker.close()
    computed = sum(len(r) for r in rows)
    return {
        "variant": variant,
        "sparsity": sparsity,
        "tokens": computed,
        "startup_s": round(ready - start, 1),
        "compute_s": round(done - ready, 1),
        "tokens_per_s_excluding_startup": round(computed / (done - ready), 1),
        "tokens_per_s_including_startup": round(computed / (done - start), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["torch:sample", "vllm-hidden:sample", "torch:topk", "vllm-hidden:topk", "vllm-logprobs:topk"],
        help="variant:sparsity, variant one of torch, vllm-hidden, vllm-logprobs; sparsity sample (16) or topk (64)",
    )
    parser.add_argument(
        "--teacher-folder",
        type=Path,
        default=None,
        help=f"where the default teacher is converted to a Hugging Face folder, once (default {DEFAULT_FOLDER}); "
        "a folder holding a model already is used as it is. With --smoke and none given: a tiny random teacher",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # variant:sparsity, run in this process
    args = smoke.parse_args(parser, sizes=SMOKE)
    if args.one:
        variant, sparsity = args.one.split(":")
        result = run_variant(
            str(args.teacher_folder), variant, sparsity, tokens=args.tokens, max_length=args.max_length
        )
        print(json.dumps(result), flush=True)
        sys.stderr.flush()
        # The engine is shut down and the result printed: leave without the interpreter's teardown, where a
        # thread vLLM's C++ side left joinable can end the process in std::terminate (SIGABRT) after a
        # correct run (seen once in CI's vLLM job, not reproduced in 9 runs since).
        os._exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke and not args.teacher_folder:
            from logitstore.testing.teachers import save_vllm_teacher  # as run_variant's imports

            teacher = Path(save_vllm_teacher(Path(tmp) / "llama-head32"))
        else:
            teacher = convert_default_teacher(args.teacher_folder or DEFAULT_FOLDER)
        failed = [spec for spec in args.variants if not run_in_own_process(spec, teacher, args)]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def run_in_own_process(spec: str, teacher: Path, args) -> bool:
    """One variant in a fresh process (no engine shares a machine with the last one's leftovers); its JSON line
    printed. Whether it ran."""
    command = [sys.executable, __file__, "--one", spec, "--teacher-folder", str(teacher)]
    command += ["--tokens", str(args.tokens), "--max-length", str(args.max_length)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
    if result.returncode:
        printed = "its result printed" if result.stdout.strip() else "nothing printed"
        print(f"{spec}: failed (exit {result.returncode}, {printed})\n{result.stderr[-2000:]}", file=sys.stderr)
        return False
    print(result.stdout.strip().splitlines()[-1], flush=True)
    return True


if __name__ == "__main__":
    main()
