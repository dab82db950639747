"""`build --engine server`'s own cost: tokens/s a client process requests, parses, converts, encodes and writes,
against a replaying server that answers at once with vLLM-shaped answers rendered before the clock starts.

The teacher is a stand-in folder: SmolLM2's tokenizer and a config of vocabulary 151,936 (Qwen's), whose
weights no build loads (the server engine describes the teacher, never runs it). The answers are synthetic
in vLLM's exact JSON (`logitstore.testing.openai_server.render_completion`): per position a Zipf-like top-K
over the 151,936 ids (distinct, spread over the vocabulary), the prompt token first with its rank, inside the
top-K at ~40% of positions, and decoded tokens of a few characters, some escaped. The server runs in a process
of its own, so its threads do not share the client's GIL; on a 2-core machine it takes about one core.

    python benchmarks/server.py --k 20 --samples 512 --length 1024
    python benchmarks/server.py --k 64 --samples 512 --length 1024

Prints one JSON line per run: build tokens/s (the whole `run_build`, from reading the input to the last
commit, after a first small build has paid the one-time costs: imports, compiled kernels), the bytes of JSON
read, the parse-and-convert rate alone on one answer (no HTTP, no writes), the cores the client and the
server kept busy, the build's tokens per CPU-second of the client (its cost, which other work on the machine
changes far less than the wall clock) and the 1-minute load average at the end.

`--vllm-ratio`: the same model through a real vLLM server against vLLM in the build's process, on vLLM's CPU
build (run by the vLLM virtualenv's python, `scripts/vllm_env.sh`):

    VLLM_CPU_KVCACHE_SPACE=1 ~/.cache/logitstore/venv-vllm/bin/python benchmarks/server.py --vllm-ratio \
        --k 16 --samples 64 --length 128

The teacher is the vLLM tests' random 2-layer Llama (head size 32, SmolLM2's tokenizer), or `--teacher`. One
`vllm serve` replica (vLLM's server module: the CPU build has no working `vllm` command) and one in-process
`--engine vllm --vllm-output logprobs` engine are both started before the clock; then, in alternating rounds,
each engine's `compute` runs the same units (16 samples of random ids each, `OVERLAP` units in flight as in a
build's worker). Prints per engine the best round's tokens/s, and the ratio server / in-process. The store's
writes, the same for both engines, are left out (the first mode measures the server build's own).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs
import numpy as np

VOCAB = 151_936
SMOKE = {"samples": 16, "length": 128, "distinct": 4, "parse_seconds": 0.2}
NAMES = ["Ġthe", "Ġof", ",", "\n", 'Ġ"', "\\", "ing", "Ġdistillation", "Ġ東京", "é", "Ġ{", "}\n"]


def synthetic_answer(prompt: list[int], *, k: int, seed: int) -> bytes:
    from logitstore.testing.openai_server import Scores, render_completion

    rng = np.random.default_rng(seed)
    positions = len(prompt) - 1
    # Zipf-like top-K: log p_r = -s * log(r + c) - log Z, a sharpness per position (peaked to flat)
    s = rng.uniform(0.6, 2.5, (positions, 1))
    ranks = np.arange(1, k + 2)[None, :]
    logits = -s * np.log(ranks + 0.5) + rng.normal(0, 0.02, (positions, k + 1))
    logits = np.sort(logits, axis=1)[:, ::-1]
    logz = np.log(np.exp(logits).sum(axis=1, keepdims=True) + rng.uniform(0.05, 3.0, (positions, 1)))
    logprobs = (logits - logz).astype(np.float32)
    base = rng.integers(0, VOCAB, (positions, 1))
    ids = (base + np.arange(k + 1)[None, :] * 7919) % VOCAB  # distinct per row
    targets = np.asarray(prompt[1:])
    inside = rng.random(positions) < 0.4
    slot = rng.integers(0, k, positions)
    clash = (ids[:, :k] == targets[:, None]).any(axis=1)
    inside &= ~clash
    ids[inside, slot[inside]] = targets[inside]
    ids[~inside & ~clash, k] = targets[~inside & ~clash]  # outside: the (k+1)-th
    rank = np.where(inside | clash, np.argmax(ids[:, :k] == targets[:, None], axis=1) + 1, k + 1 + 17)
    target_lp = logprobs[np.arange(positions), np.where(inside | clash, rank - 1, k)]
    scores = Scores(ids[:, :k], logprobs[:, :k], target_lp, rank)
    return render_completion(prompt, scores, model="stand-in", decode=lambda xs: [NAMES[x % len(NAMES)] for x in xs])


def prompts(n: int, *, length: int, distinct: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    # token ids the stand-in's tokenizer has (its tokenizer is SmolLM2's: 49,152)
    return [rng.integers(0, 49_152, length).tolist() for _ in range(min(n, distinct))]


def serve(teacher: str, k: int, length: int, distinct: int, ready) -> None:
    """The replaying server (in its own process): answers rendered once, looked up by the prompt's head."""
    from transformers import AutoTokenizer

    from logitstore.testing.openai_server import OpenAIServer

    answers = {}
    for i, prompt in enumerate(prompts(distinct, length=length, distinct=distinct)):
        answers[tuple(prompt[:16])] = synthetic_answer(prompt, k=k, seed=i)
    probe_k = {}

    def replay(prompt: list[int], asked: int) -> bytes:
        found = answers.get(tuple(prompt[:16]))
        if found is not None:
            return found
        if (len(prompt), asked) not in probe_k:  # the preflight's probe
            probe_k[(len(prompt), asked)] = synthetic_answer(prompt, k=max(asked, 1), seed=0)
        return probe_k[(len(prompt), asked)]

    tokenizer = AutoTokenizer.from_pretrained(teacher)
    server = OpenAIServer(model="stand-in", replay=replay, tokenizer=tokenizer, max_logprobs=64, max_model_len=8192)
    ready.put((server.url, sum(len(a) for a in answers.values()) / len(answers)))
    while True:
        time.sleep(3600)


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (Linux's /proc), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stand_in_teacher(folder: Path) -> str:
    from logitstore.testing.teachers import save_tiny_teacher  # a 1-layer Llama folder (never loaded by the build)

    return save_tiny_teacher(folder / "stand-in", vocab_size=VOCAB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--distinct", type=int, default=32, help="distinct prompts (answers held by the server)")
    parser.add_argument("--vllm-ratio", action="store_true", help="a real vLLM server against vLLM in-process")
    parser.add_argument("--teacher", help="--vllm-ratio: a model folder (default: a random head-size-32 Llama)")
    parser.add_argument("--rounds", type=int, default=2, help="--vllm-ratio: rounds per engine (the best counts)")
    parser.add_argument("--parse-seconds", type=float, default=2.0, help="how long the parse-and-convert rate runs")
    args = smoke.parse_args(parser, sizes=SMOKE)
    if args.vllm_ratio:
        vllm_ratio(args)
        return

    from logitstore.format.sparsity import SparsityFlags
    from logitstore.pipelines.build import BuildConfig, run_build
    from logitstore.pipelines.engines.server.completions import served_to_sparse

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        teacher = stand_in_teacher(folder)
        context = multiprocessing.get_context("spawn")
        ready = context.Queue()
        server = context.Process(target=serve, args=(teacher, args.k, args.length, args.distinct, ready), daemon=True)
        server.start()
        url, answer_bytes = ready.get(timeout=600)
        rows = prompts(args.samples, length=args.length, distinct=args.distinct)
        data = folder / "ids.jsonl"
        with data.open("w") as out:
            for i in range(args.samples):
                out.write(json.dumps({"id": f"s{i}", "ids": rows[i % len(rows)]}) + "\n")
        body = synthetic_answer(rows[0], k=args.k, seed=0)
        served_to_sparse(body, np.asarray(rows[0]), k=args.k, vocab_size=VOCAB)  # compiled before the clocks
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < args.parse_seconds:
            served_to_sparse(body, np.asarray(rows[0]), k=args.k, vocab_size=VOCAB)
            n += 1
        parse_rate = n * (args.length - 1) / (time.perf_counter() - start)
        config = dict(
            data=str(data),
            id_column="id",
            ids_column="ids",
            teacher=teacher,
            max_length=args.length,
            engine="server",
            server_urls=(url,),
            sparsity=SparsityFlags(top_k=args.k),
            progress=False,
        )
        # one-time costs off the clock (torch's and transformers' imports, the kernels' cache): a first build
        run_build(BuildConfig(store=str(folder / "warm-up"), limit=16, **config), log=lambda _: None)
        cfg = BuildConfig(
            store=str(folder / "store"),
            **config,
        )
        client_cpu, server_cpu = time.process_time(), _cpu_seconds(server.pid)
        summary = run_build(cfg, log=lambda _: None)
        client_cpu, server_cpu = time.process_time() - client_cpu, _cpu_seconds(server.pid) - server_cpu
        server.terminate()
        print(
            json.dumps(
                {
                    "k": args.k,
                    "samples": summary.samples,
                    "tokens": summary.tokens,
                    "seconds": round(summary.seconds, 2),
                    "build_tokens_per_s": round(summary.tokens_per_second),
                    "answer_mb_per_s": round(answer_bytes * summary.samples / summary.seconds / 1e6, 1),
                    "answer_bytes_per_token": round(answer_bytes / args.length),
                    "parse_convert_tokens_per_s": round(parse_rate),
                    "bytes_per_token_stored": round(summary.bytes_per_token or 0, 1),
                    # what the build took of the CPU, whatever else runs: a machine shared with other work
                    # slows the wall clock, much less these
                    "client_cores": round(client_cpu / summary.seconds, 2),
                    "server_cores": round(server_cpu / summary.seconds, 2),
                    "tokens_per_client_cpu_s": round(summary.tokens / client_cpu),
                    "load_1min": round(os.getloadavg()[0], 1),
                }
            )
        )


UNIT_SAMPLES = 16  # --vllm-ratio: samples per unit


def vllm_ratio(args) -> None:
    import concurrent.futures
    import functools
    import threading

    from logitstore.format.sparsity import SparsityFlags
    from logitstore.pipelines.build import BuildConfig
    from logitstore.pipelines.engines import engine_class
    from logitstore.pipelines.teacher import describe_teacher
    from logitstore.pipelines.workers import OVERLAP, settled_settings
    from logitstore.testing.teachers import save_vllm_teacher

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        teacher = args.teacher or save_vllm_teacher(folder / "llama-head32", max_position_embeddings=2048)
        vocab = describe_teacher(teacher).vocab_size
        rng = np.random.default_rng(0)
        rows = [rng.integers(0, vocab, args.length) for _ in range(args.samples)]
        units = [
            ([f"s{j}" for j in range(i, i + UNIT_SAMPLES)], rows[i : i + UNIT_SAMPLES])
            for i in range(0, args.samples, UNIT_SAMPLES)
        ]
        server = start_vllm_server(teacher, folder / "server.log", max_model_len=args.length + 1, max_logprobs=args.k)
        engines = {}
        try:
            wait_ready(server, folder / "server.log")
            common = dict(
                store=str(folder / "unused"),
                data=str(folder / "unused.jsonl"),
                teacher=teacher,
                max_length=args.length,
                dtype="float32",
                sparsity=SparsityFlags(top_k=args.k),
            )
            started = {}
            for name, extra in [("server", {"server_urls": (server.url,)}), ("vllm", {"vllm_output": "logprobs"})]:
                cfg = BuildConfig(engine=name, **common, **extra)
                info = describe_teacher(cfg.teacher)
                settings = settled_settings(cfg, teacher_spec=info.spec).settings
                clock = time.perf_counter()
                engines[name] = engine_class(name)(settings, lock=threading.Lock())
                started[name] = time.perf_counter() - clock
            runs = {name: functools.partial(_compute_all, engine, units) for name, engine in engines.items()}
            runs["server_fetch"] = functools.partial(_fetch_all, engines["server"], units)
            rates: dict[str, list[float]] = {name: [] for name in runs}
            with concurrent.futures.ThreadPoolExecutor(OVERLAP) as pool:
                for engine in engines.values():  # one unit each first: compiled kernels, warm caches
                    engine.compute(*units[0], seed=0)
                for _ in range(args.rounds):
                    for name, run in runs.items():
                        clock = time.perf_counter()
                        run(pool=pool)
                        rates[name].append(args.samples * args.length / (time.perf_counter() - clock))
        finally:
            for engine in engines.values():
                engine.close()
            server.stop()
        best = {name: max(r) for name, r in rates.items()}
        print(
            json.dumps(
                {
                    "k": args.k,
                    "samples": args.samples,
                    "length": args.length,
                    "tokens": args.samples * args.length,
                    "server_tokens_per_s": round(best["server"]),
                    "vllm_tokens_per_s": round(best["vllm"]),
                    "server_fetch_tokens_per_s": round(best["server_fetch"]),
                    "ratio": round(best["server"] / best["vllm"], 3),
                    "rounds": {name: [round(r) for r in rates[name]] for name in rates},
                    "engine_start_s": {name: round(s, 1) for name, s in started.items()},
                }
            )
        )


def _compute_all(engine, units, *, pool) -> None:
    """Every unit through the engine's `compute`, `OVERLAP` at once (a build's in-process worker)."""
    done = list(pool.map(lambda unit: engine.compute(*unit, seed=0), units))
    assert sum(len(d.sample_ids) for d in done) == sum(len(ids) for ids, _ in units)


def _fetch_all(engine, units, *, pool) -> None:
    """The server engine's requests alone, every sample in flight, answers not parsed: what the server and
    HTTP sustain without the client's conversion."""
    import orjson

    served = engine.served
    futures = []
    for _, rows in units:
        for row in rows:
            body = {"model": served.model, "prompt": row.tolist(), "max_tokens": 1, "prompt_logprobs": served.k}
            futures.append(engine.replicas.submit(orjson.dumps(body), tokens=len(row)))
    assert all(f.result().status == 200 for f in futures)


@dataclass
class VllmServer:
    process: subprocess.Popen
    url: str

    def stop(self) -> None:
        """SIGKILL to its process group: the API server, its engine core and worker."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def start_vllm_server(teacher: str, log: Path, *, max_model_len: int, max_logprobs: int) -> VllmServer:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", teacher, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len)]
    command += ["--max-logprobs", str(max_logprobs), "--no-enable-prefix-caching"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return VllmServer(process, f"http://127.0.0.1:{port}")


def wait_ready(server: VllmServer, log: Path, *, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"vllm serve ended at start:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(server.url + "/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"vllm serve not ready after {timeout} s")


if __name__ == "__main__":
    main()
