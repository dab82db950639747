"""One command that proves the GPU paths: run it first whenever a GPU is lent.

    python benchmarks/gpu.py --out DIR            # on a GPU machine: every section, ~5-8 min on one H100
    python benchmarks/gpu.py --smoke --out DIR    # the same code on CPU at toy shapes (the test suite runs it)
    python benchmarks/gpu.py --sections train,live

It writes `gpu-<device>-<date>.json` and `.md` under `--out` (default benchmarks/results/) after every
section (a run cut off keeps what it measured), and exits 1 when a check fails (0 when all pass). Each
section runs the project's own code: `run_build` (what `logitstore build` calls), `launch` (what
`logitstore train` calls), its step (`step.train_step`) on the CPU for the fp32 reference,
`DistillationTrainer`, the segment attention and the chunked loss; the leak checks are the live tests'
own helpers (tests/test_live.py). A section that raises is recorded with its traceback and counts as a
failed check; the next section still runs.

Sections: build (the torch engine in bf16 and fp32 against a CPU fp32 build), oom (a build whose
--batch-tokens does not fit, under a memory limit; on CPU a hook emulates it), train (`logitstore train`
with smollm2-135m on one rank from a synthetic store, no teacher needed: throughput, MFU, the plain loop
of benchmarks/_plain.py beside it eager and compiled, micro-batch 32, the CPU's first-step loss, segment
attention, the chunked head, the levers), live (CUDA IPC), trainer (`DistillationTrainer`) and vllm
(where `import vllm` works). Each check's bound stands next to its value in the JSON. What each section checks, the
MFU formula (`PEAK_BF16`) and the targets (`TARGETS`, recorded with whether they were met, never
asserted): docs/benchmarks.md, "GPU acceptance".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import _plain as baselines  # benchmarks/_plain.py: the plain loop the train section measures against
import numpy as np
import psutil
import stream as stream_benchmark  # benchmarks/stream.py: the synthetic store the train section reads
import torch

import build as build_benchmark  # benchmarks/build.py, beside this file: its corpus of N tokens
from logitstore.format.sparsity import Sparsity
from logitstore.live.config import LiveConfig
from logitstore.pipelines.build import BuildConfig, run_build
from logitstore.pipelines.engines.torch_engine import load_teacher_once, shared_teachers
from logitstore.pipelines.teacher import describe_teacher, resolve_teacher
from logitstore.store.store import Store
from logitstore.streaming.spec import StreamSpec
from logitstore.streaming.stream import store_stream
from logitstore.testing.shm import leaked_shm, shm_entries
from logitstore.testing.teachers import save_toy_teacher
from logitstore.trainer.attention import ATTENTION, packed_attention, plan_segments
from logitstore.trainer.config import LossConfig, TrainConfig
from logitstore.trainer.losses import chunked_distill_loss, distill_loss
from logitstore.trainer.model import build_student
from logitstore.trainer.objective import sparse_targets
from logitstore.trainer.step import make_optimizer, train_step
from logitstore.trainer.train import launch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

SECTIONS = ("build", "oom", "train", "live", "trainer", "vllm")
SMOKE_VOCAB = 1024
PLANTS = ("build-reference", "train-reference")  # --plant: a wrong reference, to see a check fail

# Dense bf16 FLOP/s from the data sheets, by a piece of the device's name (first match wins).
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12), ("A100", 312e12))
# Numerical bounds beyond the value grid's rounding, by the teacher's or student's dtype (nats, or relative).
# Calibrated for bf16 on the default teacher, CPU bf16 vs CPU fp32 on 2,552 positions: top-1
# 0.996, max |d log p| 0.60 (>= -5) and 1.0 (< -5), mean 0.052, mean |d tail| 0.0016; bounds ~2x that.
BUILD_ERROR = {"float32": 2e-3, "bfloat16": 1.0}  # max |d log p| of a stored entry beyond one grid step
MEAN_ERROR = {"float32": 0.03, "bfloat16": 0.1}  # mean |d log p| of entries >= -5, the grid's rounding included
TOP1_AGREEMENT = {"float32": 0.999, "bfloat16": 0.98}  # positions whose top-1 is the reference's (ties count)
TAIL_ERROR = {"float32": 1e-3, "bfloat16": 0.005}  # mean |d tail mass|
STEP_LOSS_RTOL = {"cpu": 1e-4, "cuda": 1e-2}  # first-step loss vs the CPU fp32 step (bf16 under FSDP2 on CUDA)
LIVE_LOSS_RTOL = {"cpu": 1e-4, "cuda": 1e-3}  # live vs store first loss: same weights, same teacher distributions
# Live vs store over the first steps. The two teachers' fp32 values round to the grid from different batch
# shapes, so a few entries differ by a step, and bf16 steps on CUDA (non-deterministic atomics in backward)
# amplify that over updates at lr 5e-3: on an H200 the first loss agreed to 1e-6 and step 10 drifted by 1.5%.
LIVE_TRAJECTORY_RTOL = {"cpu": 1e-4, "cuda": 5e-2}
TRAINER_LOSS_TOL = {"cpu": ("abs", 1e-3), "cuda": ("rel", 1e-2)}  # Trainer rounds to 4 digits; bf16 autocast on CUDA
ATTENTION_RTOL = 1e-3  # fp32 segment vs eager, relative to the largest value (or gradient)
HEAD_RTOL = {"float32": 1e-4, "bfloat16": 2e-2}  # chunked head vs full fp32 logits: loss, and gradients by norm
TARGETS = {
    "train_tokens_per_second": (">=", 300_000),
    "train_data_wait_share": ("<", 0.02),
    "memory_8192_over_512": ("<=", 1.2),
    "speed_8192_over_512": (">=", 0.9),
    "build_tokens_per_second": (">=", 100_000),
    # the plain forward pass and selection in the same process, on the build's own windows and batches
    "build_over_plain_top64": (">=", 0.9),
    "build_over_plain_sampled16": (">=", 0.9),
    # the plain loop (benchmarks/_plain.py) in the same process, on the same GPU and the same batches
    "train_over_plain_eager": (">=", 1.0),  # at seq 2048 x 8
    "compile_over_plain_compiled": (">=", 1.0),
    "train_memory_over_plain": ("<=", 1.0),
    "micro_batch_32_over_8_per_token": (">", 1.0),  # 0 when micro-batch 32 does not fit
}


@dataclass(frozen=True)
class Shapes:
    build_tokens: int  # section 1's timed builds (default sparsity)
    reference_tokens: int  # the CPU fp32 reference and the device builds compared with it (top-64)
    max_length: int
    unit_tokens: int
    batch_tokens: int
    oom_fit_samples: int  # section 2: a batch of this many samples fits; the build asks for oom_factor times it
    oom_factor: int
    student: str
    seq_len: int
    micro_batch: int
    steps: int  # the headline training run
    warmup: int  # its first steps, not measured (start-up, autotuning, compiles)
    scaling: tuple[tuple[int, int], tuple[int, int]]  # (seq_len, micro_batch) at equal tokens per step
    scaling_steps: int
    lever_steps: int
    check_micro_batch: int  # the first-step comparisons (CPU reference, DistillationTrainer)
    live_tokens: int
    live_seq_len: int
    live_micro_batch: int
    live_steps: int
    trainer_steps: int
    doc_chars: int | None  # the reference, OOM and live corpora: documents cut to this many characters
    student_tokens: int  # the train section's synthetic store (benchmarks/stream.py's writer, sampled-16)
    student_vocab: int
    large_micro_batch: int  # the train section's micro-batch that must fit and beat `micro_batch` per token


GPU = Shapes(
    build_tokens=800_000,  # ~100 parts: a tenth of the stored bytes holds two parts in memory (~2.7x stored)
    reference_tokens=2048,
    max_length=1024,
    unit_tokens=8192,
    batch_tokens=8192,
    oom_fit_samples=4,
    oom_factor=32,
    student="smollm2-135m",
    seq_len=2048,
    micro_batch=8,
    steps=20,
    warmup=3,
    scaling=((512, 16), (8192, 1)),
    scaling_steps=10,
    lever_steps=10,
    check_micro_batch=2,
    live_tokens=50_000,
    live_seq_len=2048,
    live_micro_batch=2,
    live_steps=10,
    trainer_steps=20,
    doc_chars=None,
    student_tokens=1_000_000,
    student_vocab=49_152,
    large_micro_batch=32,
)
SMOKE = Shapes(
    build_tokens=10_000,
    reference_tokens=300,
    max_length=128,
    unit_tokens=128,
    batch_tokens=512,
    oom_fit_samples=2,
    oom_factor=8,
    student="llama-tiny",
    seq_len=128,
    micro_batch=2,
    steps=4,
    warmup=1,
    scaling=((32, 8), (256, 1)),
    scaling_steps=3,
    lever_steps=3,
    check_micro_batch=2,
    live_tokens=2_000,
    live_seq_len=64,
    live_micro_batch=2,
    live_steps=4,
    trainer_steps=3,
    doc_chars=500,
    student_tokens=40_000,
    student_vocab=SMOKE_VOCAB,
    large_micro_batch=8,
)


@dataclass(frozen=True)
class Baseline:
    """Section 1's build against the plain forward pass and selection: the same teacher, windows, batches
    (the build's planning) and sparsity, in the same process."""

    tokens: int
    max_length: int
    batch_tokens: int  # one unit is one batch: batches of batch_tokens / max_length full windows
    dtype: str


GPU_BASELINE = Baseline(tokens=1_280_000, max_length=2048, batch_tokens=65_536, dtype="bfloat16")
SMOKE_BASELINE = Baseline(tokens=4_000, max_length=128, batch_tokens=512, dtype="float32")


def quiet(_: str) -> None:
    pass


# -- the run: its device, its data, what sections share ----------------------------------------------


class Run:
    """The device, the shapes, a scratch folder, the report; and what several sections use, made once."""

    def __init__(self, *, smoke: bool, out: Path, plant: str | None, tmp: Path):
        self.smoke, self.plant, self.tmp = smoke, plant, tmp
        self.shapes = SMOKE if smoke else GPU
        self.device = "cpu" if smoke else "cuda"
        self.cuda = self.device == "cuda"
        self.report = Report(out=out, device=device_info(self.device), smoke=smoke, shapes=self.shapes)
        self.teacher = self._smoke_teacher() if smoke else None  # None: the default teacher
        self._cache: dict[str, object] = {}

    def _smoke_teacher(self) -> str:
        """The toy teacher (`save_toy_teacher`: a 1-layer random Llama over a BPE of SMOKE_VOCAB tokens): toy
        shapes down to the vocabulary, the same build, stream and trainer code."""
        return save_toy_teacher(self.tmp / "tiny-teacher", vocab=SMOKE_VOCAB, max_position_embeddings=1024)

    def once(self, key: str, make: Callable[[], object]):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def corpus(self, name: str, tokens: int, *, chars: int | None = None) -> Path:
        """The sample corpus cut (or repeated under new ids) to about `tokens` teacher tokens, each
        document cut to `chars` characters if given."""

        def make() -> Path:
            path = self.tmp / f"{name}.jsonl"
            tokenizer = describe_teacher(self.teacher).tokenizer
            build_benchmark.corpus(path, tokens=tokens, tokenizer=tokenizer, chars=chars)
            return path

        return self.once(f"corpus-{name}", make)  # type: ignore[return-value]

    def build(self, name: str, *, data: Path, **options) -> dict:
        """`run_build` into tmp/<name>; the summary plus the store's URI."""
        uri = str(self.tmp / name)
        cfg = BuildConfig(store=uri, data=str(data), teacher=self.teacher, id_column="id", progress=False, **options)
        summary = run_build(cfg, log=quiet).to_json()
        return {"uri": uri, **summary}

    def train_store(self) -> dict:
        """The bf16 store of section 1 (the default sparsity)."""
        return self.once("train-store", lambda: self.build_throughput("bfloat16"))  # type: ignore[return-value]

    def build_throughput(self, dtype: str) -> dict:
        s = self.shapes
        with shared_teachers():
            load_teacher_once(resolve_teacher(self.teacher), self.device, dtype)  # loaded before the clock starts
            return self.build(
                f"store-{dtype}",
                data=self.corpus("build", s.build_tokens),
                max_length=s.max_length,
                unit_tokens=s.unit_tokens,
                batch_tokens=s.batch_tokens,
                device=self.device,
                dtype=dtype,
            )

    def student_store(self) -> dict:
        """What sections 3 and 5 train from, without a teacher: benchmarks/stream.py's synthetic store
        (sampled-16, samples of up to 1,024 tokens), written through the store's writer."""

        def make() -> dict:
            uri = str(self.tmp / "student-store")
            s = self.shapes
            # ~120 parts (~80 at --smoke): a tenth of the stored bytes holds two parts in memory (~2.7x stored)
            flags = ["--tokens", str(s.student_tokens), "--vocab", str(s.student_vocab), "--part-tokens", "8192"]
            if self.smoke:
                flags += ["--part-tokens", "512", "--sample-len", "256"]
            written = stream_benchmark.write_store(uri, stream_benchmark.parse_args(flags), log=quiet)
            info = Store.open(uri).read().info()
            return {
                "uri": uri,
                "teacher": stream_benchmark.TEACHER,
                "stored_bytes": int(info["stored_bytes"]),
                **written,
            }

        return self.once("student-store", make)  # type: ignore[return-value]

    def memory_budget(self) -> int:
        """1/10 of the student store's stored bytes: the store is 10x the stream's budget."""
        return self.student_store()["stored_bytes"] // 10

    def train_flags(self, **overrides) -> dict:
        s = self.shapes
        flags = dict(
            store=self.student_store()["uri"],
            student=s.student,
            seq_len=s.seq_len,
            micro_batch=s.micro_batch,
            memory_budget=str(self.memory_budget()),
            warmup_steps=2,
            lr=1e-3,
        )
        return {**flags, **overrides}

    def train(self, name: str, **overrides) -> dict:
        """`launch` (what `logitstore train` runs) in this process; its step records and peak memory."""
        out = self.tmp / name
        reset_peak_memory(self.device)
        started = time.perf_counter()
        # Quiet (nothing read back before the last step) and a short held-out evaluation at the end.
        launch(TrainConfig.from_flags(out=str(out), log_every=10**9, eval_batches=2, **self.train_flags(**overrides)))
        peak = peak_memory(self.device)
        seconds = time.perf_counter() - started  # the whole launch: start-up, steps, evaluation, export
        free_memory()
        print(f"gpu.py:   {name}: {seconds:.1f} s", file=sys.stderr, flush=True)
        return {"out": out, "records": metrics(out), "peak_memory_bytes": peak, "seconds": seconds}

    def first_step(self) -> dict:
        """One step of `logitstore train` on the device, and the same step in fp32 on the CPU from the same
        initial weights and first batch (`cpu_first_step`): the first loss of each. Eval fraction 0, so
        section 5's Trainer sees the same first batch."""

        def make() -> dict:
            s = self.shapes
            flags = dict(steps=1, micro_batch=s.check_micro_batch, eval_fraction=0.0)
            # Its own cache entry: a failed CPU reference must not rerun the device step into the same --out.
            device_run = self.once("first-step-device", lambda: self.train("first-step", **flags))
            reference = cpu_first_step(self.train_flags(**flags), device=self.device)
            return {"device": device_run["records"][0]["loss"], "cpu": reference}

        return self.once("first-step", make)  # type: ignore[return-value]


def cpu_first_step(flags: dict, *, device: str) -> float:
    """The first step's loss of `logitstore train` with `flags` in fp32 on the CPU (`step.train_step` on
    the first batch of the same stream), from the initial weights the run on `device` draws: a student
    built as `launch` builds it, on `device` (a CUDA run draws from the GPU's generator, which the CPU
    cannot replay), then copied to the CPU."""
    cfg = TrainConfig.from_flags(out="-", **flags)
    assert cfg.data.store is not None  # the student store
    view = Store.open(cfg.data.store).read()
    model, _ = build_student(cfg.student.student, vocab_size=store_vocab(view), seed=cfg.student.seed, device=device)
    model, cpu = model.float().cpu(), torch.device("cpu")
    with store_stream(view, cfg.stream_spec(rank=0, world_size=1, split="train")) as batches:
        values, _ = train_step(model, make_optimizer(model, cfg, device=cpu), iter(batches), cfg, cpu, step=1)
    return float(values["loss"])


def metrics(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r]


def header(out: Path) -> dict:
    return next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" not in r)


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: str) -> int:
    """CUDA: the allocator's peak since the last reset. CPU: the process's peak RSS (it only grows)."""
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the report ----------------------------------------------------------------------------------------


def device_info(device: str) -> dict:
    info = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "hostname": platform.node(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_bytes=props.total_memory,
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
            nccl=str(torch.cuda.nccl.version()),
            peak_bf16_flops=peak_bf16(props.name),
        )
    else:
        info.update(name=f"CPU ({platform.processor() or platform.machine()})", peak_bf16_flops=None)
    return info


def peak_bf16(name: str) -> float | None:
    return next((flops for piece, flops in PEAK_BF16 if piece in name), None)


class Report:
    """Every section's numbers and checks; written as JSON and markdown after each section."""

    def __init__(self, *, out: Path, device: dict, smoke: bool, shapes: Shapes):
        date = datetime.date.today().isoformat()
        slug = "cpu-smoke" if smoke else device["name"].lower().replace("nvidia ", "").replace(" ", "-")
        self.path = out / f"gpu-{''.join(c for c in slug if c.isalnum() or c in '-.')}-{date}.json"
        self.started = time.perf_counter()
        self.data: dict = {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "date": date,
            "smoke": smoke,
            "device": device,
            "shapes": dataclasses.asdict(shapes),
            "bounds": {
                "build_error_nats": BUILD_ERROR,
                "build_mean_error_nats": MEAN_ERROR,
                "top1_agreement": TOP1_AGREEMENT,
                "tail_error": TAIL_ERROR,
                "step_loss_rtol": STEP_LOSS_RTOL,
                "live_loss_rtol": LIVE_LOSS_RTOL,
                "live_trajectory_rtol": LIVE_TRAJECTORY_RTOL,
                "trainer_loss_tol": TRAINER_LOSS_TOL,
                "attention_rtol": ATTENTION_RTOL,
                "head_rtol": HEAD_RTOL,
            },
            "mfu_formula": "6*N + 12*L*d*T FLOPs per token x tokens/s / peak_bf16_flops",
            "sections": {},
            "targets": {},
        }

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[dict]:
        """The section's record; an exception is recorded (with its traceback) as a failed check."""
        record: dict = {"checks": [], "error": None}
        self.data["sections"][name] = record
        started = time.perf_counter()
        print(f"gpu.py: {name} ...", file=sys.stderr, flush=True)
        try:
            yield record
        except Exception as error:  # noqa: BLE001 - one section's failure must not cost the others their run
            record["error"] = f"{type(error).__name__}: {error}"
            record["traceback"] = traceback.format_exc()
            record["checks"].append({"name": f"{name} ran", "ok": False, "value": record["error"], "bound": None})
            print(record["traceback"], file=sys.stderr, flush=True)
        record["seconds"] = round(time.perf_counter() - started, 2)
        failed = [c["name"] for c in record["checks"] if not c["ok"]]
        print(
            f"gpu.py: {name} {record['seconds']} s, {'FAILED: ' + ', '.join(failed) if failed else 'ok'}",
            file=sys.stderr,
        )
        self.write()

    def target(self, name: str, value: float | None) -> None:
        op, bound = TARGETS[name]
        met = (
            None
            if value is None
            else {">=": value >= bound, ">": value > bound, "<": value < bound, "<=": value <= bound}[op]
        )
        self.data["targets"][name] = {"value": value, "target": f"{op} {bound}", "met": met}

    @property
    def failed(self) -> list[str]:
        return [f"{s}: {c['name']}" for s, r in self.data["sections"].items() for c in r["checks"] if not c["ok"]]

    def write(self) -> None:
        self.data["seconds"] = round(time.perf_counter() - self.started, 2)
        # CPU time of this process and the children it waited for (CLI reference, live teacher): on a
        # shared machine the wall time says more about the neighbours than about the run.
        used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        self.data["cpu_seconds"] = round(sum(u.ru_utime + u.ru_stime for u in used), 2)
        self.data["failed"] = self.failed
        self.data["ok"] = not self.failed
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        self.path.with_suffix(".md").write_text(markdown(self.data))


def check(record: dict, name: str, value, bound, ok: bool) -> None:
    record["checks"].append({"name": name, "value": value, "bound": bound, "ok": bool(ok)})


def markdown(data: dict) -> str:
    d = data["device"]
    lines = [
        f"# benchmarks/gpu.py, {d['name']}, {data['date']}"
        + (" (--smoke: CPU, toy shapes, no GPU figure)" if data["smoke"] else ""),
        "",
        f"`{data['command']}`: {data['seconds']} s ({data['cpu_seconds']} s of CPU), torch {d['torch']}; "
        + ("all checks passed" if data["ok"] else f"**{len(data['failed'])} checks failed**"),
        "",
        "| section | check | value | bound | ok |",
        "|---|---|---|---|---|",
    ]
    for name, record in data["sections"].items():
        for c in record["checks"]:
            lines.append(
                f"| {name} | {c['name']} | {_cell(c['value'])} | {_cell(c['bound'])} | {'yes' if c['ok'] else '**no**'} |"
            )
    lines += ["", "| target | value | target | met |", "|---|---|---|---|"]
    for name, t in data["targets"].items():
        lines.append(f"| {name} | {_cell(t['value'])} | {t['target']} | {t['met']} |")
    lines += ["", "| section | measure | value |", "|---|---|---|"]
    for name, record in data["sections"].items():
        for key, value in _flat(record):
            lines.append(f"| {name} | {key} | {_cell(value)} |")
    return "\n".join(lines) + "\n"


def _flat(record: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in record.items():
        if key in ("checks", "traceback"):
            continue
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value).replace("|", "/")


# -- comparing two stores of the same samples ------------------------------------------------------


def compare_stores(reference: str, uri: str, *, shift: float = 0.0) -> dict:
    """Per position of every sample: the reference's top-1 id against the other's (a tie with its top
    value counts as agreement), |d log p| on the entries both hold (split at the grid's coarse step),
    |d target log p| and |d tail mass|. `shift` plants an error in the reference (--plant)."""
    ref_view, view = Store.open(reference).read(), Store.open(uri).read()
    ids = sorted(ref_view.index["sample_id"].to_pylist())
    codec = next(iter(ref_view.teachers.values())).codec
    fine, coarse, top1, target, tail, positions = [], [], [], [], [], 0
    for sid in ids:
        a, b = ref_view.sample(sid), view.sample(sid)
        assert np.array_equal(a.input_ids, b.input_ids), f"{sid}: different tokens"
        a_lp = a.entry_logprobs.astype(np.float64) + shift
        a_pos = np.repeat(np.arange(len(a.n_entries)), a.n_entries)
        b_pos = np.repeat(np.arange(len(b.n_entries)), b.n_entries)
        vocab = int(max(a.entry_ids.max(), b.entry_ids.max())) + 1
        shared, ia, ib = np.intersect1d(a_pos * vocab + a.entry_ids, b_pos * vocab + b.entry_ids, return_indices=True)
        delta = np.abs(a_lp[ia] - b.entry_logprobs[ib])
        # An entry is on the fine grid only where both stores rounded it there: one just above the boundary
        # in one store and just below in the other is one coarse step apart, the coarse grid's rounding.
        is_fine = np.minimum(a_lp[ia], b.entry_logprobs[ib]) >= codec.coarse_below
        fine.append(delta[is_fine])
        coarse.append(delta[~is_fine])
        top1.append(_top1_agrees(a_pos, a.entry_ids, a_lp, b_pos, b.entry_ids, b.entry_logprobs, len(a.n_entries)))
        target.append(np.abs(a.target_logprobs.astype(np.float64) + shift - b.target_logprobs))
        tail.append(np.abs(a.tail.astype(np.float64) - b.tail))
        positions += len(a.n_entries)
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)
    fine_d, coarse_d, target_d, tail_d = cat(fine), cat(coarse), cat(target), cat(tail)
    finite = lambda x: x[np.isfinite(x)]
    return {
        "samples": len(ids),
        "positions": positions,
        "top1_agreement": float(cat(top1).mean()),
        "shared_entries": int(len(fine_d) + len(coarse_d)),
        "max_abs_dlogp_fine": float(finite(fine_d).max(initial=0.0)),
        "max_abs_dlogp_coarse": float(finite(coarse_d).max(initial=0.0)),
        "mean_abs_dlogp_fine": float(finite(fine_d).mean()) if len(fine_d) else 0.0,
        "max_abs_dtarget": float(finite(target_d).max(initial=0.0)),
        "max_abs_dtail": float(tail_d.max(initial=0.0)),
        "mean_abs_dtail": float(tail_d.mean()) if len(tail_d) else 0.0,
        "grid_step_fine": codec.fine_step,
        "grid_step_coarse": codec.coarse_step,
    }


def _top1_agrees(a_pos, a_ids, a_lp, b_pos, b_ids, b_lp, n: int) -> np.ndarray:
    """Per position: some id at a's top value is at b's top value too (quantized values tie, so every
    id at the top value is a top-1)."""

    def top_keys(pos, ids, lp):
        top = np.full(n, -np.inf)
        np.maximum.at(top, pos, lp)
        at_top = lp == top[pos]
        return pos[at_top].astype(np.int64) * (1 << 32) + ids[at_top]

    hit = np.intersect1d(top_keys(a_pos, a_ids, a_lp), top_keys(b_pos, b_ids, b_lp)) >> 32
    agrees = np.zeros(n, dtype=bool)
    agrees[hit] = True
    return agrees


def check_build_agreement(record: dict, name: str, found: dict, *, dtype: str) -> None:
    bound_fine = found["grid_step_fine"] + BUILD_ERROR[dtype]
    bound_coarse = found["grid_step_coarse"] + BUILD_ERROR[dtype]
    check(
        record,
        f"{name}: top-1 agreement",
        found["top1_agreement"],
        TOP1_AGREEMENT[dtype],
        found["top1_agreement"] >= TOP1_AGREEMENT[dtype],
    )
    check(
        record,
        f"{name}: max |d log p| (>= -5)",
        found["max_abs_dlogp_fine"],
        bound_fine,
        found["max_abs_dlogp_fine"] <= bound_fine,
    )
    check(
        record,
        f"{name}: max |d log p| (< -5)",
        found["max_abs_dlogp_coarse"],
        bound_coarse,
        found["max_abs_dlogp_coarse"] <= bound_coarse,
    )
    check(
        record,
        f"{name}: mean |d log p| (>= -5)",
        found["mean_abs_dlogp_fine"],
        MEAN_ERROR[dtype],
        found["mean_abs_dlogp_fine"] <= MEAN_ERROR[dtype],
    )
    check(
        record,
        f"{name}: mean |d tail|",
        found["mean_abs_dtail"],
        TAIL_ERROR[dtype],
        found["mean_abs_dtail"] <= TAIL_ERROR[dtype],
    )


# -- 1. build ------------------------------------------------------------------------------------------


def section_build(run: Run, record: dict) -> None:
    s = run.shapes
    record["throughput"] = {}
    for dtype in ("bfloat16", "float32"):
        summary = run.train_store() if dtype == "bfloat16" else run.build_throughput(dtype)
        record["throughput"][dtype] = {
            k: summary[k] for k in ("tokens", "seconds", "tokens_per_second", "bytes_per_token", "stored_bytes")
        }
    run.report.target("build_tokens_per_second", record["throughput"]["bfloat16"]["tokens_per_second"])
    check(
        record,
        "bf16 build holds >= the tokens asked",
        record["throughput"]["bfloat16"]["tokens"],
        s.build_tokens,
        record["throughput"]["bfloat16"]["tokens"] >= s.build_tokens,
    )

    build_against_plain(run, record)
    data = run.corpus("reference", s.reference_tokens, chars=s.doc_chars)
    top64 = dict(max_length=s.max_length, sparsity=Sparsity(k=64), batch_tokens=s.batch_tokens)
    with shared_teachers():  # one teacher load per (device, dtype)
        built = {
            dtype: run.build(f"ref-{dtype}", data=data, device=run.device, dtype=dtype, **top64)
            for dtype in ("bfloat16", "float32")
        }
    with shared_teachers():
        reference = run.build("ref-cpu", data=data, device="cpu", dtype="float32", **top64)
    record["reference"] = {"tokens": reference["tokens"], "device": "cpu", "dtype": "float32", "sparsity": "top-64"}
    shift = 1.0 if run.plant == "build-reference" else 0.0
    for dtype, summary in built.items():
        found = compare_stores(reference["uri"], summary["uri"], shift=shift)
        record["reference"][dtype] = found
        check_build_agreement(record, f"{run.device} {dtype} vs cpu fp32", found, dtype=dtype)


SPARSITIES = {"top64": Sparsity(k=64), "sampled16": Sparsity(mode="sampled", n=16)}


def build_against_plain(run: Run, record: dict) -> None:
    """`logitstore build` (`run_build`) against the plain forward pass and selection over the same batches:
    tokens/s of each and their ratio, for top-64 and sampled-16."""
    b = SMOKE_BASELINE if run.smoke else GPU_BASELINE
    data = run.corpus("baseline", b.tokens)
    options = dict(max_length=b.max_length, batch_tokens=b.batch_tokens, unit_tokens=b.batch_tokens, dtype=b.dtype)
    record["baseline"] = {**dataclasses.asdict(b), "plain": {}, "build": {}, "build_over_plain": {}}
    for name, sparsity in SPARSITIES.items():
        with shared_teachers():  # loaded once, before either clock starts
            model = load_teacher_once(resolve_teacher(run.teacher), run.device, b.dtype).model
            cfg = BuildConfig(
                store=build_benchmark.PLANNING_STORE,
                data=str(data),
                teacher=run.teacher,
                id_column="id",
                sparsity=sparsity,
                progress=False,
                device=run.device,
                **options,
            )
            plain = plain_throughput(
                model, build_benchmark.batches(cfg, describe_teacher(run.teacher).tokenizer), sparsity
            )
            built = run.build(f"baseline-{name}", data=data, device=run.device, sparsity=sparsity, **options)
        record["baseline"]["plain"][name] = plain
        record["baseline"]["build"][name] = {k: built[k] for k in ("tokens", "seconds", "tokens_per_second")}
        ratio = built["tokens_per_second"] / plain["tokens_per_second"]
        record["baseline"]["build_over_plain"][name] = ratio
        run.report.target(f"build_over_plain_{name}", ratio)


def plain_throughput(model, planned, sparsity: Sparsity) -> dict:
    """The plain way over the planned batches: the model's forward pass, log-softmax in fp32 over the whole
    vocabulary, top-k (or n draws with their log-probabilities), the result copied to the host. The first
    batch warms up, untimed."""
    generator = torch.Generator(device=model.device).manual_seed(0)

    def step(ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        with torch.inference_mode():
            logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits
            logprobs = torch.log_softmax(logits.float(), dim=-1).flatten(0, 1)
            if sparsity.sampled:
                draws = torch.multinomial(logprobs.exp(), sparsity.n, replacement=True, generator=generator)
                picked = [draws, logprobs.gather(1, draws)]
            else:
                picked = list(torch.topk(logprobs, sparsity.k, dim=-1))
            return [t.cpu() for t in picked]

    batches = [batch for _, unit in planned for batch in unit]
    step(*batches[0])
    tokens, start = 0, time.perf_counter()
    for ids, mask in batches:
        step(ids, mask)
        tokens += int(mask.sum())
    seconds = time.perf_counter() - start  # each step ends in its copy to the host: the device is done
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": tokens / seconds}


# -- 2. out of memory ----------------------------------------------------------------------------------


@contextlib.contextmanager
def memory_limit(run: Run, model, *, limit_bytes: int | None, limit_tokens: int) -> Iterator[dict]:
    """CUDA: the allocator may hold at most `limit_bytes` (set_per_process_memory_fraction); an allocation
    beyond raises torch.OutOfMemoryError (counted in memory_stats()['num_ooms']). CPU: a hook on the
    teacher's decoder raises it for a batch of more than `limit_tokens` tokens. On both, hooks count the
    decoder's forward passes begun and finished, and the largest batch that finished."""
    found = {"allocator_ooms": None, "failed_forwards": 0, "largest_batch_done": 0}
    begun = []

    def begin(_module, _args, kwargs):
        tokens = kwargs["input_ids"].numel()
        begun.append(tokens)
        if not run.cuda and tokens > limit_tokens:
            raise torch.OutOfMemoryError(f"emulated: {tokens} tokens > {limit_tokens}")

    def done(_module, _args, kwargs, _output):
        found["largest_batch_done"] = max(found["largest_batch_done"], begun.pop())

    hooks = [
        model.get_decoder().register_forward_pre_hook(begin, with_kwargs=True),
        model.get_decoder().register_forward_hook(done, with_kwargs=True),
    ]
    before = torch.cuda.memory_stats().get("num_ooms", 0) if run.cuda else 0
    if run.cuda:
        assert limit_bytes is not None
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, limit_bytes / torch.cuda.get_device_properties(0).total_memory)
        )
    try:
        yield found
    finally:
        for hook in hooks:
            hook.remove()
        if run.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
            found["allocator_ooms"] = torch.cuda.memory_stats().get("num_ooms", 0) - before
        found["failed_forwards"] = len(begun)  # begun and never finished: out of memory (or an error)


def section_oom(run: Run, record: dict) -> None:
    s = run.shapes
    fit = s.oom_fit_samples * s.max_length
    data = run.corpus("oom", fit * s.oom_factor, chars=s.doc_chars)
    options = dict(
        max_length=s.max_length,
        sparsity=Sparsity(k=16),
        unit_tokens=fit * s.oom_factor,
        device=run.device,
        dtype="float32",
    )
    with shared_teachers():
        teacher = load_teacher_once(resolve_teacher(run.teacher), run.device, "float32")
        free_memory()
        base = torch.cuda.memory_allocated() if run.cuda else 0
        reset_peak_memory(run.device)
        fits = run.build("oom-fits", data=data, batch_tokens=fit, **options)
        peak = peak_memory(run.device) - base if run.cuda else None
        limit = base + int(1.5 * peak) if peak is not None else None
        free_memory()
        with memory_limit(run, teacher.model, limit_bytes=limit, limit_tokens=2 * fit) as found:
            halved = run.build("oom-halved", data=data, batch_tokens=fit * s.oom_factor, **options)
    record.update(
        batch_tokens_fits=fit,
        batch_tokens_asked=fit * s.oom_factor,
        fit_peak_bytes=peak,
        limit_bytes=limit,
        limit="set_per_process_memory_fraction" if run.cuda else f"emulated: batches above {2 * fit} tokens",
        **found,
        tokens=halved["tokens"],
    )
    # The decoder's or the head's allocation may be the one that fails: either counts.
    ooms = max(found["failed_forwards"], found["allocator_ooms"] or 0)
    check(record, "out-of-memory errors (failed forwards, allocator's count)", ooms, ">= 1", ooms >= 1)
    check(
        record,
        "largest batch that finished (tokens)",
        found["largest_batch_done"],
        f"<= {fit * s.oom_factor // 2}",
        found["largest_batch_done"] <= fit * s.oom_factor // 2,
    )
    check(
        record,
        "the halved build holds every token",
        halved["tokens"],
        fits["tokens"],
        halved["tokens"] == fits["tokens"],
    )
    found_cmp = compare_stores(fits["uri"], halved["uri"])
    record["vs_fitting_build"] = found_cmp
    check_build_agreement(record, "halved vs fitting", found_cmp, dtype="float32")


# -- 3. training ---------------------------------------------------------------------------------------


def measured(records: list[dict], *, warmup: int) -> dict:
    """tokens/s (median of the steps after `warmup`) and the data-wait share of those steps' time."""
    steps = records[warmup:] or records[-1:]
    seconds = [r["tokens"] / r["tokens_per_second"] for r in steps]
    return {
        "steps_measured": len(steps),
        "tokens_per_step": steps[0]["tokens"],
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in steps),
        "data_wait_share": sum(r["data_wait_seconds"] for r in steps) / sum(seconds),
    }


def flops_per_token(student: str, *, vocab_size: int, seq_len: int) -> tuple[int, float]:
    """(N, 6 N + 12 L d T): see the module's docstring."""
    model, _ = build_student(student, vocab_size=vocab_size, seed=0)
    n = sum(p.numel() for p in model.parameters())
    c = model.config
    width = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return n, 6 * n + 12 * c.num_hidden_layers * width * seq_len


def section_train(run: Run, record: dict) -> None:
    s = run.shapes
    store = run.student_store()
    record["store"] = {**stream_windows(run, store), "stored_bytes": store["stored_bytes"], "tokens": store["tokens"]}
    record["store"]["store_to_budget"] = store["stored_bytes"] / run.memory_budget()
    windows = record["store"]["parts"] / record["store"]["window_parts"]
    check(record, "the budget holds 1/10 of the parts or less (windows per epoch)", windows, ">= 10", windows >= 10)

    headline = run.train("headline", steps=s.steps)
    m = measured(headline["records"], warmup=s.warmup)
    vocab = Store.open(store["uri"]).read().teachers[store["teacher"]].vocab_size
    n, flops = flops_per_token(s.student, vocab_size=vocab, seq_len=s.seq_len)
    peak = run.report.data["device"]["peak_bf16_flops"]
    record["headline"] = {
        **m,
        "student": s.student,
        "parameters": n,
        "flops_per_token": flops,
        "mfu": None if peak is None else flops * m["tokens_per_second"] / peak,
        "peak_memory_bytes": headline["peak_memory_bytes"],
        "seq_len": s.seq_len,
        "micro_batch": s.micro_batch,
    }
    run.report.target("train_tokens_per_second", m["tokens_per_second"])
    run.report.target("train_data_wait_share", m["data_wait_share"])
    losses = [r["loss"] for r in headline["records"]]
    check(record, "losses finite", max(losses), "finite", all(np.isfinite(losses)))

    record["plain"] = {
        "eager": plain_loop(run, compile=False),
        "compiled": plain_loop(run, compile=True),
    }
    record["vs_plain"] = {
        "tokens_per_second": m["tokens_per_second"] / record["plain"]["eager"]["tokens_per_second"],
        "peak_memory": headline["peak_memory_bytes"] / record["plain"]["eager"]["peak_memory_bytes"],
    }
    run.report.target("train_over_plain_eager", record["vs_plain"]["tokens_per_second"])
    run.report.target("train_memory_over_plain", record["vs_plain"]["peak_memory"])
    record["large_micro_batch"] = large_micro_batch(run, per_token=m["tokens_per_second"])
    run.report.target("micro_batch_32_over_8_per_token", record["large_micro_batch"]["over_micro_batch"])

    record["scaling"] = {}
    for which, (seq, micro) in zip(("short", "long"), s.scaling):
        got = run.train(f"scaling-{which}", steps=s.scaling_steps, seq_len=seq, micro_batch=micro)
        record["scaling"][which] = {
            "seq_len": seq,
            "micro_batch": micro,
            **measured(got["records"], warmup=s.warmup),
            "peak_memory_bytes": got["peak_memory_bytes"],
        }
    short, long = record["scaling"]["short"], record["scaling"]["long"]
    record["scaling"]["memory_long_over_short"] = long["peak_memory_bytes"] / short["peak_memory_bytes"]
    record["scaling"]["speed_long_over_short"] = long["tokens_per_second"] / short["tokens_per_second"]
    run.report.target("memory_8192_over_512", record["scaling"]["memory_long_over_short"])
    run.report.target("speed_8192_over_512", record["scaling"]["speed_long_over_short"])

    first = run.first_step()
    cpu = first["cpu"] * (1.5 if run.plant == "train-reference" else 1.0)
    rel = abs(first["device"] - cpu) / abs(cpu)
    record["first_step"] = {"device_loss": first["device"], "cpu_fp32_loss": cpu, "relative_difference": rel}
    check(record, "first-step loss vs CPU fp32", rel, STEP_LOSS_RTOL[run.device], rel <= STEP_LOSS_RTOL[run.device])

    record["attention"] = segment_vs_eager(run, store)
    free_memory()
    for dtype, found in record["attention"].items():
        for what in ("values", "gradients"):
            if dtype == "float32":
                check(
                    record,
                    f"segment vs eager attention, fp32 {what}",
                    found[what],
                    ATTENTION_RTOL,
                    found[what] <= ATTENTION_RTOL,
                )
            else:  # bf16: the segment path no less accurate than the eager path, both against fp32 eager
                bound = 2 * found[f"eager_{what}"] + 1e-3
                check(
                    record,
                    f"segment vs eager attention, bf16 {what} (error vs fp32 eager)",
                    found[what],
                    bound,
                    found[what] <= bound,
                )

    record["chunked_head"] = chunked_head(run, store)
    for dtype, found in record["chunked_head"].items():
        for what in ("loss", "grad_hidden", "grad_weight"):
            check(
                record,
                f"chunked head {dtype} vs fp32 logits: {what}",
                found[what],
                HEAD_RTOL[dtype],
                found[what] <= HEAD_RTOL[dtype],
            )

    record["levers"] = {
        "plain": {"tokens_per_second": m["tokens_per_second"], "peak_memory_bytes": headline["peak_memory_bytes"]}
    }
    for lever in ("compile", "activation_checkpointing"):
        got = run.train(f"lever-{lever}", steps=s.lever_steps, **{lever: True})
        record["levers"][lever] = {
            **measured(got["records"], warmup=s.warmup),
            "peak_memory_bytes": got["peak_memory_bytes"],
        }
        record["levers"][lever]["first_loss"] = got["records"][0]["loss"]
    compiled = record["levers"]["compile"]["tokens_per_second"] / record["plain"]["compiled"]["tokens_per_second"]
    record["vs_plain"]["compiled_tokens_per_second"] = compiled
    run.report.target("compile_over_plain_compiled", compiled)
    plain_first = headline["records"][0]["loss"]
    for lever in ("compile", "activation_checkpointing"):
        rel = abs(record["levers"][lever]["first_loss"] - plain_first) / abs(plain_first)
        check(
            record,
            f"--{lever.replace('_', '-')} leaves the first loss",
            rel,
            STEP_LOSS_RTOL[run.device],
            rel <= STEP_LOSS_RTOL[run.device],
        )


def plain_loop(run: Run, *, compile: bool) -> dict:
    """benchmarks/_plain.py's loop on the batches `logitstore train` reads at the headline's shape, in this
    process on the same device: tokens/s (B x L a step) over the steps after the warm-up (the compile
    happens in the warm-up), and its peak memory."""
    s = run.shapes
    cfg = TrainConfig.from_flags(out="-", **run.train_flags())
    assert cfg.data.store is not None  # the student store
    view = Store.open(cfg.data.store).read()
    with store_stream(view, cfg.stream_spec(rank=0, world_size=1, split="train")) as stream:
        batches = iter(stream)
        taken = [next(batches) for _ in range(s.steps)]
    reset_peak_memory(run.device)
    loop = baselines.PlainLoop(
        s.student, vocab_size=store_vocab(view), device=torch.device(run.device), compile=compile
    )
    for batch in taken[: s.warmup]:
        loop.step(batch)
    synchronize(run.device)
    started = time.perf_counter()
    losses = [loop.step(batch) for batch in taken[s.warmup :]]
    synchronize(run.device)
    seconds = time.perf_counter() - started
    found = {
        "compiled": compile,
        "steps_measured": len(losses),
        "tokens_per_second": len(losses) * s.seq_len * s.micro_batch / seconds,
        "peak_memory_bytes": peak_memory(run.device),
        "last_loss": float(losses[-1]),
    }
    del loop
    free_memory()
    return found


def large_micro_batch(run: Run, *, per_token: float) -> dict:
    """`logitstore train` at `large_micro_batch` rows: whether it fits, and its tokens/s over the headline's
    (`per_token`; 0 where it does not fit)."""
    s = run.shapes
    try:
        got = run.train("large-micro-batch", steps=s.lever_steps, micro_batch=s.large_micro_batch)
    except torch.OutOfMemoryError as error:
        free_memory()
        return {"micro_batch": s.large_micro_batch, "fits": False, "error": str(error)[:200], "over_micro_batch": 0.0}
    m = measured(got["records"], warmup=s.warmup)
    return {
        "micro_batch": s.large_micro_batch,
        "fits": True,
        "tokens_per_second": m["tokens_per_second"],
        "peak_memory_bytes": got["peak_memory_bytes"],
        "over_micro_batch": m["tokens_per_second"] / per_token,
    }


def store_vocab(view) -> int:
    return view.teachers[view.teacher_name(None)].vocab_size


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def stream_windows(run: Run, store: dict) -> dict:
    """How the train stream reads the store at the run's budget: parts, and parts per window (those it holds)."""
    view = Store.open(store["uri"]).read()
    options = dict(seq_len=run.shapes.seq_len, micro_batch=run.shapes.micro_batch, rank=0, world_size=1, seed=0)
    with store_stream(view, StreamSpec(memory_budget=run.memory_budget(), eval_fraction=0.05, **options)) as stream:
        window_parts = stream.window_parts
    parts = len(set(view.index["part"].to_pylist()))
    return {"memory_budget": run.memory_budget(), "parts": parts, "window_parts": window_parts}


def one_batch(run: Run, store: dict, *, micro_batch: int):
    view = Store.open(store["uri"]).read()
    spec = StreamSpec(
        seq_len=run.shapes.seq_len, micro_batch=micro_batch, rank=0, world_size=1, seed=0, eval_fraction=0.0
    )
    with store_stream(view, spec) as stream:
        return next(iter(stream)), view.teachers[store["teacher"]].vocab_size


def segment_vs_eager(run: Run, store: dict) -> dict:
    """The student's decoder on a real packed batch: segment attention against the eager block-causal
    mask, final hidden states and every parameter's gradient of their mean square. fp32: relative to
    the largest value; bf16: each path's error against the fp32 eager path."""
    batch, vocab = one_batch(run, store, micro_batch=2)
    model, _ = build_student(run.shapes.student, vocab_size=vocab, seed=0)
    model = model.to(run.device)
    ids, pos = batch.input_ids.to(run.device), batch.position_ids.to(run.device)
    mask = batch.block_causal_mask().to(run.device)
    plan = plan_segments(batch.position_ids).to(run.device)

    def outputs(dtype, attention: str):
        model.to(dtype).zero_grad(set_to_none=True)
        model.config._attn_implementation = attention
        extra = {"attention_mask": mask.to(dtype)} if attention == "eager" else {"segment_plan": plan}
        hidden = model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False, **extra).last_hidden_state
        hidden.float().square().mean().backward()
        return hidden.detach().float(), [p.grad.detach().float() for p in model.parameters() if p.grad is not None]

    reference = outputs(torch.float32, "eager")
    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        segment = outputs(dtype, ATTENTION)
        eager = reference if dtype == torch.float32 else outputs(dtype, "eager")
        found[str(dtype).removeprefix("torch.")] = {
            "kernel": packed_attention(run.device, dtype),
            "values": _relative(segment[0], reference[0]),
            "gradients": max(_relative(g, r) for g, r in zip(segment[1], reference[1])),
            "eager_values": _relative(eager[0], reference[0]),
            "eager_gradients": max(_relative(g, r) for g, r in zip(eager[1], reference[1])),
        }
    return found


def _relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


def chunked_head(run: Run, store: dict) -> dict:
    """`chunked_distill_loss` on a real batch's targets, hidden states and head in fp32 and bf16 (as under
    FSDP2's mixed precision), against `distill_loss` on the full fp32 logits: relative loss difference and
    gradient differences by norm."""
    batch, vocab = one_batch(run, store, micro_batch=run.shapes.micro_batch)
    targets = sparse_targets(batch, run.device)
    model, _ = build_student(run.shapes.student, vocab_size=vocab, seed=0)
    weight = model.get_output_embeddings().weight.detach().to(run.device)
    del model
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(targets.n_positions, weight.shape[1], generator=generator).to(run.device)

    def loss_and_grads(fn, dtype):
        h, w = (x.to(dtype).detach().clone().requires_grad_() for x in (hidden, weight))
        loss, _ = fn(h, w)
        loss.backward()
        return float(loss.detach()), h.grad.float(), w.grad.float()

    reference = loss_and_grads(lambda h, w: distill_loss((h @ w.T).float(), targets, LossConfig()), torch.float32)
    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        loss, gh, gw = loss_and_grads(lambda h, w: chunked_distill_loss(h, w, targets, LossConfig()), dtype)
        found[str(dtype).removeprefix("torch.")] = {
            "loss": abs(loss - reference[0]) / abs(reference[0]),
            "grad_hidden": float((gh - reference[1]).norm() / reference[1].norm()),
            "grad_weight": float((gw - reference[2]).norm() / reference[2].norm()),
            "positions": targets.n_positions,
        }
    free_memory()
    return found


# -- 4. live mode --------------------------------------------------------------------------------------


def section_live(run: Run, record: dict) -> None:
    """Teacher in fp32 on both sides, so the two runs' teacher values differ by rounding only (the
    build's and live mode's batches differ); the student trains in bf16 on CUDA in both."""
    s = run.shapes
    data = run.corpus("live", s.live_tokens, chars=s.doc_chars)
    sparsity = Sparsity(k=16)
    with shared_teachers():
        store = run.build(
            "live-store", data=data, max_length=s.max_length, sparsity=sparsity, device=run.device, dtype="float32"
        )
    common = dict(
        steps=s.live_steps,
        seq_len=s.live_seq_len,
        micro_batch=s.live_micro_batch,
        warmup_steps=2,
        lr=5e-3,
        eval_fraction=0.05,
        student=s.student,
        log_every=10**9,
    )
    launch(TrainConfig.from_flags(store=store["uri"], out=str(run.tmp / "live-store-run"), **common))
    before = shm_entries()
    live = LiveConfig(
        teacher=run.teacher,
        data=str(data),
        id_column="id",
        max_length=s.max_length,
        sparsity=sparsity,
        device=run.device,
        dtype="float32",
    )
    launch(TrainConfig.from_flags(store=None, live=live, out=str(run.tmp / "live-run"), **common))
    free_memory()
    store_losses = [r["loss"] for r in metrics(run.tmp / "live-store-run")]
    live_losses = [r["loss"] for r in metrics(run.tmp / "live-run")]
    first = header(run.tmp / "live-run")
    rel = float(np.max(np.abs(np.subtract(live_losses, store_losses)) / np.abs(store_losses)))
    new = leaked_shm(before)
    leaked = sorted(new - held_by_other_processes())  # on a shared machine, others' live files are theirs
    pid = first["live_teacher_pid"]
    teacher_alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    record.update(
        transport=first["live_transport"],
        steps=len(live_losses),
        max_relative_loss_difference=rel,
        store_losses=store_losses,
        live_losses=live_losses,
        new_shm=sorted(new),
        leaked_shm=leaked,
        teacher_alive=teacher_alive,
        gpu_processes=other_gpu_processes() if run.cuda else None,
    )
    transport = "cuda_ipc" if run.cuda else "shared_memory"
    check(record, "transport", first["live_transport"], transport, first["live_transport"] == transport)
    first_rel = abs(live_losses[0] - store_losses[0]) / abs(store_losses[0])
    check(
        record,
        "first loss: live vs store",
        first_rel,
        LIVE_LOSS_RTOL[run.device],
        first_rel <= LIVE_LOSS_RTOL[run.device],
    )
    check(
        record,
        f"first {len(live_losses)} losses: live vs store",
        rel,
        LIVE_TRAJECTORY_RTOL[run.device],
        rel <= LIVE_TRAJECTORY_RTOL[run.device] and len(live_losses) == s.live_steps,
    )
    check(record, "nothing left in /dev/shm", leaked, "[]", not leaked)
    check(record, "the teacher process is gone", teacher_alive, False, not teacher_alive)
    if run.cuda:
        # NVML may list processes of other namespaces on a shared host: only the teacher's pid is a finding.
        held = record["gpu_processes"] is not None and pid in record["gpu_processes"]
        check(record, "the teacher holds no GPU memory (NVML)", held, False, not held)


def held_by_other_processes() -> set[str]:
    """Names under /dev/shm that a process other than this one has open or mapped (/proc/*/fd, maps).
    What this run's teacher leaked nobody holds (the teacher is gone), or this process does."""
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    held.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)").strip())
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    held.add(target.removeprefix("/dev/shm/"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return held


def other_gpu_processes() -> list[int] | None:
    """Processes other than this one holding GPU memory, by NVML (nvidia-ml-py, in the GPU image); None
    where NVML is not there."""
    try:
        import pynvml  # only on a GPU machine (nvidia-ml-py); not a dependency of the project
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid != os.getpid()]
    finally:
        pynvml.nvmlShutdown()


# -- 5. DistillationTrainer ----------------------------------------------------------------------------


def section_trainer(run: Run, record: dict) -> None:
    """transformers.Trainer with logitstore's stream and loss: the same first batch and student as the
    first-step run of `logitstore train` (section 3), so the same first loss."""
    from transformers import TrainingArguments  # transformers' Trainer machinery: only this section needs it

    from logitstore.trainer.hf import DistillationTrainer  # as above

    s = run.shapes
    store = run.student_store()
    reference = run.first_step()["device"]
    vocab = Store.open(store["uri"]).read().teachers[store["teacher"]].vocab_size
    # the initial weights of `logitstore train` on this device (drawn there from the same seed)
    model, _ = build_student(s.student, vocab_size=vocab, seed=0, device=run.device)
    args = TrainingArguments(
        output_dir=str(run.tmp / "trainer"),
        max_steps=s.trainer_steps,
        per_device_train_batch_size=s.check_micro_batch,
        learning_rate=1e-3,
        warmup_steps=2,
        logging_steps=1,
        seed=0,
        report_to=[],
        save_strategy="no",
        use_cpu=not run.cuda,
        bf16=run.cuda,
    )
    trainer = DistillationTrainer(
        model, args, store=store["uri"], seq_len=s.seq_len, eval_fraction=0.0, memory_budget=run.memory_budget()
    )
    output = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "kd" in h]
    del trainer, model
    free_memory()
    kind, bound = TRAINER_LOSS_TOL[run.device]
    diff = abs(losses[0] - reference) / (abs(reference) if kind == "rel" else 1.0)
    record.update(
        steps=len(losses),
        first_loss=losses[0],
        logitstore_train_first_loss=reference,
        difference=diff,
        difference_kind=kind,
        tokens_per_second=output.metrics.get("train_samples_per_second", 0.0) * s.seq_len,
        last_loss=losses[-1],
    )
    check(record, "steps", len(losses), s.trainer_steps, len(losses) == s.trainer_steps)
    check(record, f"first loss vs logitstore train ({kind})", diff, bound, diff <= bound)


# -- 6. vLLM -------------------------------------------------------------------------------------------


def section_vllm(run: Run, record: dict) -> None:
    """Only where vLLM imports: the vLLM engine's build against the torch engine's (top-16, fp32)."""
    try:
        import vllm  # optional, and not on the GPU image: its wheel is far over one transfer
    except ImportError as error:
        record.update(installed=False, reason=f"import vllm: {error}")
        return
    record.update(installed=True, version=vllm.__version__)
    s = run.shapes
    data = run.corpus("reference", s.reference_tokens, chars=s.doc_chars)
    options = dict(max_length=s.max_length, sparsity=Sparsity(k=16), device=run.device, dtype="float32")
    with shared_teachers():
        torch_build = run.build("vllm-torch", data=data, **options)
    vllm_build = run.build("vllm-vllm", data=data, engine="vllm", **options)
    found = compare_stores(torch_build["uri"], vllm_build["uri"])
    record.update(
        vs_torch=found,
        tokens_per_second={"torch": torch_build["tokens_per_second"], "vllm": vllm_build["tokens_per_second"]},
    )
    check_build_agreement(record, "vllm vs torch engine", found, dtype="float32")


RUNNERS = {
    "build": section_build,
    "oom": section_oom,
    "train": section_train,
    "live": section_live,
    "trainer": section_trainer,
    "vllm": section_vllm,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, toy shapes: the test suite's run (no GPU figure)")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="folder for the JSON and markdown (default: %(default)s)"
    )
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, of: " + ", ".join(SECTIONS))
    parser.add_argument("--keep", type=Path, help="keep the scratch stores and runs in this folder")
    parser.add_argument("--plant", choices=PLANTS, help=argparse.SUPPRESS)  # the tests: a wrong reference must fail
    args = parser.parse_args(argv)
    args.sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; the sections are {', '.join(SECTIONS)}")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or --smoke for the CPU run at toy shapes")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = args.keep
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="logitstore-gpu-")))
        run = Run(smoke=args.smoke, out=args.out, plant=args.plant, tmp=tmp)
        for name in args.sections:
            with run.report.section(name) as record:
                RUNNERS[name](run, record)
        run.report.write()
    print(f"gpu.py: wrote {run.report.path} and {run.report.path.with_suffix('.md').name}", file=sys.stderr)
    for failure in run.report.failed:
        print(f"gpu.py: FAILED {failure}", file=sys.stderr)
    return 1 if run.report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
