"""What the store side costs a build: the teacher's forward passes alone versus the whole `logitstore build`.

Like with like: both sides use the same sparsity (default `--sample 16`, the build's default; `--top-k K`
for top-k), the same windows, units and batches (the build's own planning, `build.plan_units`, and
batching, `engines.token_budget_batches`), and per unit the same sampling seed. The forward side is the
teacher's forward pass, the selection in stored types on its device and the copy to the host
(`sparsify.forward_selected`, `to_host`); the difference is the host side: reading and tokenizing, the
selected rows as samples (`HostSelected.samples`), encoding, compression, writing, merging and commits.
Runs alternate (forward alone, then build) and each side keeps its best of `--repeats`. Target: the store
side adds < 5%.

Two teachers, side by side:

- the real default teacher (SmolLM2-135M, 49,152-token vocabulary) on `--device`;
- stand-ins as fast as a GPU (`--standin-rate`, tokens/s; default 250k and 1M): the real teacher's selected
  rows (computed once, before any timing, over one unit's worth of the corpus: real entries, draws and
  tails in stored types) replayed at that rate. A stand-in batch takes exactly tokens / rate seconds:
  the rest of that time it sleeps, as a host thread waits on a GPU, so the CPU is free meanwhile. The
  build runs its own host side on what it returns. Its rows cycle through the pool, which holds a
  whole unit, so no part holds a row twice and compression sees real data.

    python benchmarks/build.py                              # sampled-16, CPU teacher, stand-ins at 250k and 1M tokens/s
    python benchmarks/build.py --top-k 64 --device cuda --tokens 65536
    python benchmarks/build.py --host-cores 1 2             # the host side alone on 1, then 2 cores

`--generate N` measures `build --generate N` instead: `--prompts` prompts (the sample corpus's documents
cut to `--prompt-chars`) answered by the teacher itself. The engine alone is the same generator on the
same prompts and seeds (`Generation.answer`, timed around `generate` only), then the teacher's forward
passes over the answered samples, batched as the build batches them; the build is `run_build`. Store
side: build / (generation + forward) - 1.

    python benchmarks/build.py --generate 64 --prompts 32
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs
import numpy as np
import torch

from logitstore.data import SAMPLE_CORPUS
from logitstore.format.sparsity import Sparsity
from logitstore.pipelines import build as build_module
from logitstore.pipelines import sparsify
from logitstore.pipelines.build import BuildConfig, run_build
from logitstore.pipelines.engines.shared import token_budget_batches
from logitstore.pipelines.engines.torch_engine import load_teacher_once, right_padded, shared_teachers
from logitstore.pipelines.generate import Generation
from logitstore.pipelines.plan import plan_units
from logitstore.pipelines.summary import BuildSummary
from logitstore.pipelines.teacher import describe_teacher
from logitstore.pipelines.workers import settled_settings, unit_seed

# Toy sizes: 4 units of stand-in tokens, so the steady state (units 3 on) has two.
SMOKE = {
    "tokens": 256,
    "standin_tokens": 2048,
    "standin_rate": [1_000_000],
    "doc_chars": 400,
    "max_length": 128,
    "batch_tokens": 256,
    "unit_tokens": 512,
    "repeats": 1,
    "prompts": 4,
    "prompt_chars": 100,
}


def corpus(path: Path, *, tokens: int, tokenizer, chars: int | None = None) -> int:
    """Documents of the sample corpus holding about `tokens` tokens, repeated under new ids when the
    corpus is shorter (each cut to its first `chars` characters, if given); returns the token count."""
    docs = [json.loads(line) for line in SAMPLE_CORPUS.read_text().splitlines()]
    docs = [{**d, "text": d["text"][:chars]} for d in docs]
    lengths = [len(ids) for ids in tokenizer([d["text"] for d in docs])["input_ids"]]
    total, lines, copy = 0, [], 0
    while total < tokens:
        for doc, n in zip(docs, lengths):
            lines.append(json.dumps({"id": f"{doc['id']}~{copy}", "text": doc["text"]}))
            total += n
            if total >= tokens:
                break
        copy += 1
    path.write_text("\n".join(lines) + "\n")
    return total


# Planning alone (`batches`) writes nothing; `BuildConfig` still wants a store it could create.
PLANNING_STORE = "memory://planning-only"


def config(args, *, store: str, data: Path) -> BuildConfig:
    return BuildConfig(
        store=store,
        data=str(data),
        id_column="id",
        max_length=args.max_length,
        batch_tokens=args.batch_tokens,
        unit_tokens=args.unit_tokens,
        teacher=args.teacher,
        device=args.device,
        sparsity=args.sparsity,
        seed=0,
        progress=False,
    )


def forward(model, ids: torch.Tensor, mask: torch.Tensor, sparsity: Sparsity, generator) -> sparsify.HostSelected:
    """The teacher's forward pass, the selection in stored types and their copy to the host, as the torch
    engine runs them (`pipelines/engines/torch_engine.py`), waited for (looked up at call time, so a
    stand-in patched into the module runs here too)."""
    lengths = mask.sum(dim=1).numpy()
    selected = sparsify.forward_selected(model, ids, mask, lengths=lengths, sparsity=sparsity, generator=generator)
    host = sparsify.to_host(selected)
    if host.ready is not None:
        host.ready.synchronize()
    return host


def batches(cfg: BuildConfig, tokenizer, *, generation: Generation | None = None) -> list[tuple[int, list]]:
    """Per unit, in the build's order: its sampling seed and the (ids, mask) of each batch the build runs
    (with `generation`: the answers it generates, as the build's planner does)."""
    out = []
    for unit in plan_units(cfg, tokenizer, counts=BuildSummary(), generation=generation):
        lengths = np.array([len(t) for t in unit.tokens])
        order = np.argsort(-lengths, kind="stable")
        unit_batches = []
        for rows in token_budget_batches(lengths[order], order, budget=cfg.batch_tokens):
            unit_batches.append(right_padded([unit.tokens[i] for i in rows], lengths[rows]))
        out.append((unit_seed(cfg.seed, unit), unit_batches))
    return out


def each_batch(model, planned):
    """(ids, mask, generator) of every planned batch; one generator per unit, seeded as the build seeds it."""
    for seed, unit_batches in planned:
        generator = torch.Generator(device=model.device).manual_seed(seed)
        for ids, mask in unit_batches:
            yield ids, mask, generator


def forward_only(model, planned, sparsity: Sparsity) -> tuple[float, list[float]]:
    """(seconds, seconds of each unit) of the teacher's forward passes over the planned batches."""
    per_unit = []
    for seed, unit_batches in planned:
        start = time.perf_counter()
        for ids, mask, generator in each_batch(model, [(seed, unit_batches)]):
            forward(model, ids, mask, sparsity, generator)
        per_unit.append(time.perf_counter() - start)
    return sum(per_unit), per_unit


class StandIn:
    """A teacher as fast as a GPU: replays real selected rows at `rate` tokens/s (see the module docstring).

    It runs as a GPU's stream does: a batch is queued when it is launched (`forward_selected` returns at
    once, as kernel launches do) and is done `tokens / rate` seconds after the batch queued before it; the
    host waits for it where it reads the batch (`HostSelected.ready`, as the torch engine waits for a
    copy's event). So the host's work on one batch overlaps the next batch's forward pass, as the engine's
    queue of depth one arranges on a GPU, and a host that falls behind leaves the device idle."""

    def __init__(self, pool: dict[str, torch.Tensor], *, rate: float):
        self.pool, self.rate, self.cursor = pool, rate, 0
        self.rows = len(pool["tail"])
        self.free_at = 0.0  # when the device finishes what was queued so far (perf_counter seconds)
        self.due: dict[int, float] = {}  # id of a queued batch's `Selected` -> when it is done
        self.lock = threading.Lock()

    @classmethod
    def pool_from(cls, model, planned, sparsity: Sparsity) -> dict[str, torch.Tensor]:
        """The real teacher's selected rows (every real position of the planned batches), in stored types."""
        parts: dict[str, list[torch.Tensor]] = {}
        for ids, mask, generator in each_batch(model, planned):
            for name, rows in forward(model, ids, mask, sparsity, generator).arrays.items():
                parts.setdefault(name, []).append(rows)
        return {name: torch.cat(rows) for name, rows in parts.items()}

    def forward_selected(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, lengths, **_):
        take = (self.cursor + np.arange(int((lengths - 1).sum()))) % self.rows
        self.cursor = (self.cursor + len(take)) % self.rows
        # numpy's gather: torch's index_select on the CPU can stall ~8 ms a call in its thread pool on a busy machine
        selected = sparsify.Selected(**{name: torch.from_numpy(rows.numpy()[take]) for name, rows in self.pool.items()})
        with self.lock:  # the device's queue: this batch starts when the one before it is done
            self.free_at = max(self.free_at, time.perf_counter()) + int(attention_mask.sum()) / self.rate
            self.due[id(selected)] = self.free_at
        return selected

    def to_host(self, selected: sparsify.Selected) -> sparsify.HostSelected:
        host = sparsify.HostSelected({name: t for name, t in selected.tensors().items()})
        with self.lock:
            host.ready = _Done(self.due.pop(id(selected)))  # type: ignore[assignment]  # an event's `synchronize`
        return host

    @contextlib.contextmanager
    def installed(self):
        """The build's workers call the selection module's `forward_selected` and `to_host`: point them at
        this stand-in, from the pool's first row (so every run stores the same rows) and an idle device."""
        self.cursor, self.free_at = 0, 0.0
        saved = sparsify.forward_selected, sparsify.to_host
        sparsify.forward_selected, sparsify.to_host = self.forward_selected, self.to_host
        try:
            yield
        finally:
            sparsify.forward_selected, sparsify.to_host = saved


class _Done:
    """A stand-in batch's end, waited for as a CUDA event is: the host sleeps (its CPU free) until then."""

    def __init__(self, at: float):
        self.at = at

    def synchronize(self) -> None:
        left = self.at - time.perf_counter()
        if left > 0:
            time.sleep(left)


class UnitClock:
    """When the build's driver merges each unit (it updates its progress then, shown or not), to time the
    steady state: the units after the first two (the first is computed alone with the teacher's
    registration, the second fills the pipeline)."""

    def __init__(self):
        self.merged: list[tuple[float, int]] = []

    @contextlib.contextmanager
    def installed(self):
        saved = build_module.Progress.update

        def update(progress, *, tokens: int, samples: int, documents: int) -> None:
            self.merged.append((time.perf_counter(), tokens))
            saved(progress, tokens=tokens, samples=samples, documents=documents)

        build_module.Progress.update = update
        try:
            yield self
        finally:
            build_module.Progress.update = saved

    def steady(self) -> tuple[float, int]:
        """(seconds, tokens) from the first unit merged by the pipeline to the last."""
        if len(self.merged) < 2:
            return float("nan"), 0
        return self.merged[-1][0] - self.merged[0][0], sum(t for _, t in self.merged[1:])


def write_alone(
    args, pool: dict[str, torch.Tensor], planned, *, tmp: Path, teacher_meta, repeats: int
) -> tuple[float, int]:
    """(best seconds, tokens) of `PartWriter.write` of one unit of the stand-in's samples (read by the
    build's `HostSelected.samples`) into a store: encode, compress, hash, store, in this process."""
    from logitstore.format import codec
    from logitstore.format.samples import concat
    from logitstore.store.store import Store

    standin = StandIn(pool, rate=float("inf"))
    seed, unit_batches = planned[0]
    parts = []
    for i, (ids, mask) in enumerate(unit_batches):
        lengths = mask.sum(dim=1).numpy()
        tokens = [ids[r, :n].numpy() for r, n in enumerate(lengths)]
        host = sparsify.to_host(standin.forward_selected(None, ids, mask, lengths=lengths))
        parts.append(
            host.samples(
                sample_ids=[f"b{i}-{r}" for r in range(len(tokens))],
                lengths=lengths,
                input_ids=tokens,
                sparsity=args.sparsity,
            )
        )
    samples = concat(parts)
    store = Store.open(str(tmp / "write-alone"), create=True)
    with store.writer() as writer:
        writer.add_teacher(
            teacher_meta, code_of_id=codec.frequency_id_order(samples.entry_ids, vocab_size=teacher_meta.vocab_size)
        )
        writer.commit("teacher")
    best = float("inf")
    with store.writer() as writer:
        part_writer = writer.part_writer()
        part_writer.write(samples, teacher=teacher_meta.name)  # compiles and caches what the first write needs
        for _ in range(repeats):
            start = time.perf_counter()
            part_writer.write(samples, teacher=teacher_meta.name)
            best = min(best, time.perf_counter() - start)
    return best, int(samples.n_tokens.sum())


def prompts_file(path: Path, *, prompts: int, chars: int) -> Path:
    """`prompts` prompts: the sample corpus's documents cut to `chars` characters, under new ids when repeated."""
    docs = [json.loads(line) for line in SAMPLE_CORPUS.read_text().splitlines()]
    rows = [
        {"id": f"{docs[i % len(docs)]['id']}~{i}", "prompt": docs[i % len(docs)]["text"][:chars]}
        for i in range(prompts)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def generation_benchmark(args, info, model, *, tmp: Path) -> None:
    """`--generate N`: generated tokens/s of the engine alone, and what the whole build adds to it."""
    best = {"generate": float("inf"), "forward": float("inf"), "build": float("inf")}
    data = prompts_file(tmp / "prompts.jsonl", prompts=args.prompts, chars=args.prompt_chars)
    for r in range(args.repeats):
        cfg = dataclasses.replace(
            config(args, store=str(tmp / f"store-{r}"), data=data), prompt_column="prompt", generate=args.generate
        )
        generation = Generation(cfg, teacher=info, settings=settled_settings(cfg, teacher_spec=info.spec).settings)
        generation.generator()  # loaded (shared with the teacher) before any clock runs
        planned = batches(cfg, info.tokenizer, generation=generation)
        generated = generation.generated
        generation.close()
        forward_s, _ = forward_only(model, planned, args.sparsity)
        summary = run_build(cfg, log=lambda _: None)
        assert summary.generated_tokens == generated.tokens, "the build generated what the engine alone did"
        best["generate"] = min(best["generate"], generated.seconds)
        best["forward"] = min(best["forward"], forward_s)
        best["build"] = min(best["build"], summary.seconds)
    engine = best["generate"] + best["forward"]
    print(
        f"build --generate {args.generate}: {args.prompts} prompts of {args.prompt_chars} characters, "
        f"{generated.tokens:,} tokens generated, {summary.tokens:,} tokens scored ({args.sparsity.mode}), "
        f"{args.device}; best of {args.repeats}"
    )
    print(
        f"generation alone  {best['generate']:7.2f} s  {generated.tokens / best['generate']:8,.0f} generated tokens/s"
    )
    print(f"teacher forward   {best['forward']:7.2f} s  {summary.tokens / best['forward']:8,.0f} tokens/s")
    print(f"whole build       {best['build']:7.2f} s  store side {best['build'] / engine - 1:+.1%} (target < +5%)")


def pinned_to(cores: set[int]) -> None:
    """Every thread of this process on these cores (Linux: a thread's affinity is its own; new threads
    inherit their creator's)."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cores)


def host_benchmark(args, info, model, *, tmp: Path) -> None:
    """`--host-cores N M ...`: the host side alone, a build whose stand-in teacher takes no time, with the
    process on N, then M, ... cores, alternating; median tokens/s of `--repeats` runs each."""
    available = sorted(os.sched_getaffinity(0))
    pool_data, data = tmp / "pool.jsonl", tmp / "host.jsonl"
    corpus(pool_data, tokens=args.unit_tokens, tokenizer=info.tokenizer)
    pool = StandIn.pool_from(model, planned_batches(args, pool_data, info.tokenizer), args.sparsity)
    tokens = corpus(data, tokens=args.standin_tokens, tokenizer=info.tokenizer)
    standin = StandIn(pool, rate=float("inf"))
    seconds: dict[int, list[float]] = {n: [] for n in args.host_cores}
    for r in range(args.repeats):
        for n in args.host_cores:
            pinned_to(set(available[:n]))
            with standin.installed():
                summary = run_build(config(args, store=str(tmp / f"store-{n}-{r}"), data=data), log=lambda _: None)
            seconds[n].append(summary.seconds)
    pinned_to(set(available))
    print(
        f"host side alone ({args.sparsity.describe()}, {tokens:,} tokens, stand-in teacher taking no time); "
        f"median of {args.repeats}, alternating; load average {os.getloadavg()[0]:.1f} at the end"
    )
    base = tokens / statistics.median(seconds[args.host_cores[0]])
    for n in args.host_cores:
        rate = tokens / statistics.median(seconds[n])
        print(
            f"{n} core(s): {rate:>10,.0f} tokens/s  {rate / base:5.2f}x  (runs: {', '.join(f'{tokens / x:,.0f}' for x in seconds[n])})"
        )


def planned_batches(args, data: Path, tokenizer) -> list[tuple[int, list]]:
    """The batches a build of `data` runs (planning writes nothing: `PLANNING_STORE`)."""
    return batches(config(args, store=PLANNING_STORE, data=data), tokenizer)


def store_side_benchmark(args, info, model, *, tmp: Path) -> None:
    """The forward passes alone against the whole build, for the real teacher and each stand-in."""
    runs = []  # (label, tokens, data, planned batches, stand-in or None)
    real_data = tmp / "real.jsonl"
    real_tokens = corpus(real_data, tokens=args.tokens, tokenizer=info.tokenizer, chars=args.doc_chars)
    runs.append(
        (
            f"{info.spec.name} ({args.device})",
            real_tokens,
            real_data,
            planned_batches(args, real_data, info.tokenizer),
            None,
        )
    )
    written = None
    if args.standin_rate:
        pool_data = tmp / "pool.jsonl"
        corpus(pool_data, tokens=args.unit_tokens, tokenizer=info.tokenizer, chars=args.doc_chars)
        print(f"stand-in rows: the real teacher over {args.unit_tokens:,} tokens (once, not timed) ...", flush=True)
        pool = StandIn.pool_from(model, planned_batches(args, pool_data, info.tokenizer), args.sparsity)
        standin_data = tmp / "standin.jsonl"
        standin_tokens = corpus(
            standin_data, tokens=args.standin_tokens, tokenizer=info.tokenizer, chars=args.doc_chars
        )
        planned = planned_batches(args, standin_data, info.tokenizer)
        for rate in args.standin_rate:
            runs.append(
                (f"stand-in at {rate:,.0f} tokens/s", standin_tokens, standin_data, planned, StandIn(pool, rate=rate))
            )
        meta = info.store_meta(args.sparsity)
        written = write_alone(args, pool, planned, tmp=tmp, teacher_meta=meta, repeats=5 * args.repeats)
    best = {label: [float("inf")] * 4 + [None] for label, *_ in runs}
    for r in range(args.repeats):
        for k, (label, _, data, planned, standin) in enumerate(runs):
            with standin.installed() if standin else contextlib.nullcontext():
                f, per_unit = forward_only(model, planned, args.sparsity)
            with standin.installed() if standin else contextlib.nullcontext(), UnitClock().installed() as clock:
                summary = run_build(config(args, store=str(tmp / f"store-{k}-{r}"), data=data), log=lambda _: None)
            steady_s, steady_tokens = clock.steady()
            b = best[label]
            b[0], b[1] = min(b[0], f), min(b[1], summary.seconds)
            if steady_tokens and per_unit[2:]:  # units 2.. of the build, against the same units' forward passes
                b[2], b[3] = min(b[2], sum(per_unit[2:])), min(b[3], steady_s)
            b[4] = summary.bytes_per_token
    sparsity_name = f"top-{args.top_k}" if args.top_k else f"sampled-{args.sparsity.n}"
    print(
        f"{sparsity_name} for the forward pass and the build alike; max length {args.max_length}, batches of "
        f"{args.batch_tokens:,} tokens, units of {args.unit_tokens:,} tokens, vocab {info.vocab_size:,}; "
        f"best of {args.repeats}, alternating"
    )
    print(
        f"{'teacher':32s} {'tokens':>9s} {'forward alone':>22s} {'full build':>22s} {'B/token':>7s} "
        f"{'store side':>10s} {'steady state':>12s}"
    )
    for label, tokens, *_ in runs:
        f, b, steady_f, steady_b, bpt = best[label]
        steady = f"{steady_b / steady_f - 1:+12.1%}" if steady_f < float("inf") else f"{'-':>12s}"
        print(
            f"{label:32s} {tokens:9,d} {f:7.2f} s {tokens / f:>8,.0f} t/s {b:7.2f} s {tokens / b:>8,.0f} t/s "
            f"{bpt:7.1f} {b / f - 1:+10.1%} {steady}"
        )
    print(
        "store side: what the build adds to the teacher's time (target < +5%); steady state: the same from the "
        "third unit on (no store creation, teacher registration, first unit or pipeline fill)"
    )
    if written:
        seconds, tokens = written
        print(
            f"write side alone: PartWriter.write of one {tokens:,}-token unit of the stand-in's samples "
            f"(encode, compress, hash, store): {seconds * 1e3:.1f} ms, {tokens / seconds:,.0f} tokens/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens for the real teacher (default 8192)")
    parser.add_argument(
        "--standin-tokens", type=int, default=1 << 20, help="tokens for the stand-ins (default 1048576)"
    )
    parser.add_argument(
        "--standin-rate",
        type=float,
        nargs="*",
        default=[250_000, 1_000_000],
        help="stand-in teachers, in tokens/s (default 250000 1000000); none to skip them",
    )
    parser.add_argument("--doc-chars", type=int, default=None, help="cut each document to this many characters")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--unit-tokens", type=int, default=16384)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--sample", type=int, default=None, help="draws per position (default 16)")
    group.add_argument("--top-k", type=int, default=None)
    smoke.add_teacher_option(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generate", type=int, default=None, help="measure build --generate N instead")
    parser.add_argument("--prompts", type=int, default=32, help="with --generate: prompts (default 32)")
    parser.add_argument("--prompt-chars", type=int, default=200, help="with --generate: characters per prompt")
    parser.add_argument(
        "--host-cores", type=int, nargs="+", default=None, help="measure the host side alone on N, M, ... cores"
    )
    args = smoke.parse_args(parser, sizes=SMOKE)
    args.sparsity = Sparsity(k=args.top_k) if args.top_k else Sparsity(mode="sampled", n=args.sample or 16)
    with tempfile.TemporaryDirectory() as tmp:
        args.teacher = smoke.smoke_teacher(args, Path(tmp))
        info = describe_teacher(args.teacher)
        model = load_teacher_once(info.spec, args.device, "auto").model
        if args.generate:
            measure = generation_benchmark
        else:
            measure = host_benchmark if args.host_cores else store_side_benchmark
        measure(args, info, model, tmp=Path(tmp))


if __name__ == "__main__":
    with shared_teachers():  # the benchmark's own forward passes and its builds use one load
        main()
