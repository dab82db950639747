"""Live mode on CPU: the default teacher in its own process, handing over through shared memory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.format.samples import SparseSamples
from logitstore.format.sparsity import Sparsity
from logitstore.live.config import LiveConfig
from logitstore.live.teacher import LiveTeacher, _allocate_ring, _write_slot
from logitstore.pipelines.build import BuildConfig, run_build
from logitstore.pipelines.engines.server.client import API_KEY_VARIABLE
from logitstore.testing.cli import CLI, one_line_error, sample_corpus_head
from logitstore.testing.runs import COMMON
from logitstore.testing.shm import cuda_driver_file, leaked_shm, shm_entries
from logitstore.testing.teachers import serve_teacher
from logitstore.trainer.config import TrainConfig
from logitstore.trainer.train import launch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return sample_corpus_head(tmp_path_factory.mktemp("data") / "corpus.jsonl", docs=8, chars=900)


def live_config(corpus: Path) -> LiveConfig:
    return LiveConfig(teacher="default", data=str(corpus), id_column="id", max_length=128, sparsity=Sparsity(k=16))


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r]


def header(out: Path) -> dict:
    return next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" not in r)


@pytest.mark.slow
def test_live_and_store_runs_see_the_same_batches_and_losses(corpus, tmp_path):
    """Same teacher, data, seed and sparsity: the live run's first losses equal the store run's. Both
    quantize with the store's codec; the teacher's batches differ (floating-point rounding), so values
    may differ by a grid step where one sits on a step boundary: compared to 1e-4 relative."""
    store = str(tmp_path / "store")
    run_build(
        BuildConfig(
            store=store, data=str(corpus), id_column="id", max_length=128, sparsity=Sparsity(k=16), progress=False
        ),
        log=lambda _: None,
    )
    launch(TrainConfig.from_flags(store=store, out=str(tmp_path / "store-run"), steps=4, **COMMON))
    before = shm_entries()
    launch(
        TrainConfig.from_flags(store=None, live=live_config(corpus), out=str(tmp_path / "live-run"), steps=4, **COMMON)
    )
    np.testing.assert_allclose(losses(tmp_path / "live-run"), losses(tmp_path / "store-run"), rtol=1e-4)
    first = header(tmp_path / "live-run")
    assert first["signal"] == "live" and first["version"].startswith("live-")
    assert first["live_transport"] == ("cuda_ipc" if torch.cuda.is_available() else "shared_memory")
    assert not leaked_shm(before)  # nothing left in /dev/shm
    # The same live teacher under transformers.Trainer (logitstore.trainer.hf.DistillationTrainer(live=...)):
    # the same first batch, so the same first KD as the store run.
    from transformers import TrainingArguments

    from logitstore.trainer.hf import DistillationTrainer
    from logitstore.trainer.model import build_student

    model, _ = build_student("llama-tiny", vocab_size=49152, seed=0)
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf-live"),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=COMMON["lr"],
        logging_steps=1,
        seed=0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
    )
    with DistillationTrainer(model, args, live=live_config(corpus), seq_len=64, eval_fraction=0.2) as trainer:
        trainer.train()
        held_out = trainer.evaluate()
        teacher_pid = trainer.signal.client.pid
    kd = [h["kd"] for h in trainer.state.log_history if "kd" in h]
    store_kd = [
        r["kd"]
        for r in map(json.loads, (tmp_path / "store-run" / "metrics.jsonl").read_text().splitlines())
        if "step" in r
    ]
    assert kd[0] == pytest.approx(store_kd[0], rel=1e-4) and len(kd) == 3
    assert held_out["eval_kl"] > 0 and not _alive(teacher_pid)


def _start(corpus: Path, out: Path) -> subprocess.Popen:
    args = [
        "train",
        "--live-teacher",
        "default",
        "--data",
        str(corpus),
        "--id-column",
        "id",
        "--max-length",
        "128",
        "--top-k",
        "16",
        "--out",
        str(out),
        "--steps",
        "100000",
        "--seq-len",
        "64",
        "--micro-batch",
        "2",
    ]
    return subprocess.Popen(
        [*CLI, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _teacher_pid_once_training(child: subprocess.Popen, out: Path) -> int:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and child.poll() is None:
        metrics = out / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if len(lines) >= 2:  # the header and one step
            return json.loads(lines[0])["live_teacher_pid"]
        time.sleep(0.2)
    child.kill()
    raise AssertionError(f"the live run never trained: {child.stderr.read() if child.poll() is not None else ''}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


@pytest.mark.slow
def test_a_killed_teacher_stops_the_trainer_with_a_message(corpus, tmp_path):
    before = shm_entries()
    child = _start(corpus, tmp_path / "run")
    teacher_pid = _teacher_pid_once_training(child, tmp_path / "run")
    os.kill(teacher_pid, signal.SIGKILL)
    try:
        child.wait(timeout=120)  # a bound on hanging, not a measurement: it stops within seconds
    except subprocess.TimeoutExpired:
        child.kill()
        raise AssertionError("the trainer hung after its teacher died") from None
    stderr = child.stderr.read()
    assert child.returncode != 0
    assert "live teacher process" in stderr and "exited with code -9" in stderr, stderr
    assert "Traceback" not in stderr
    assert not leaked_shm(before)


@pytest.mark.slow
def test_the_teacher_exits_when_the_trainer_dies(corpus, tmp_path):
    before = shm_entries()
    child = _start(corpus, tmp_path / "run")
    teacher_pid = _teacher_pid_once_training(child, tmp_path / "run")
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 20
    while _alive(teacher_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(teacher_pid), "the teacher outlived its trainer"
    # The one file nobody can remove: a SIGKILLed CUDA process's own driver file (README, live mode)
    killed_trainers_own = cuda_driver_file(child.pid)
    assert not {name for name in leaked_shm(before) if not killed_trainers_own.fullmatch(name)}


def test_slot_round_trip_and_capacity():
    """The hand-over's buffers: what the teacher writes into a slot is what the trainer copies out."""
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, size=7).astype(np.int32)
    samples = SparseSamples(
        sample_ids=["0", "1"],
        n_tokens=np.array([3, 6]),
        input_ids=rng.integers(0, 50, 9),
        n_entries=counts,
        entry_ids=rng.permutation(50)[: int(counts.sum())],
        entry_logprobs=-rng.random(int(counts.sum())).astype(np.float32),
        tail=rng.random(7).astype(np.float32),
        target_logprobs=-rng.random(7).astype(np.float32),
    )
    ring = _allocate_ring(16, 64, device=torch.device("cpu"), sampled=False)
    assert all(t.is_shared() for slot in ring for t in slot.values())
    shapes = _write_slot(ring[1], samples)
    tokens = [samples.input_ids[:3], samples.input_ids[3:]]
    got = LiveTeacher._copy_out(ring[1], shapes, tokens)
    for name in ("n_entries", "entry_ids", "entry_logprobs", "tail", "target_logprobs"):
        np.testing.assert_array_equal(getattr(got, name), getattr(samples, name))
    got.validate(vocab_size=50)
    with pytest.raises(Exception, match="exceeds the ring's slot"):
        _write_slot(_allocate_ring(2, 64, device=torch.device("cpu"), sampled=False)[0], samples)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA transport needs a GPU")
def test_cuda_transport_hands_over_like_shared_memory(corpus, tmp_path):
    """The teacher on the GPU (ring exported by CUDA IPC) against the teacher on the CPU (shared memory),
    same trainer: the losses agree to the teacher's dtype (bf16 on CUDA, fp32 on CPU)."""
    for device in ("cuda", "cpu"):
        cfg = live_config(corpus)
        cfg.device = device
        launch(TrainConfig.from_flags(store=None, live=cfg, out=str(tmp_path / device), steps=2, **COMMON))
    assert header(tmp_path / "cuda")["live_transport"] == "cuda_ipc"
    assert header(tmp_path / "cpu")["live_transport"] == "shared_memory"
    np.testing.assert_allclose(losses(tmp_path / "cuda"), losses(tmp_path / "cpu"), rtol=1e-2)


def test_live_flags_make_a_live_config_only_with_a_live_teacher():
    from logitstore.live.config import LiveTeacherError

    assert LiveConfig.from_flags(None) is None
    cfg = LiveConfig.from_flags("default", top_k=8, max_length=64)
    assert (cfg.teacher, cfg.text_column, cfg.max_length, cfg.sparsity) == (None, "text", 64, Sparsity(k=8))
    with pytest.raises(LiveTeacherError, match="--max-length, --temperature only apply with --live-teacher"):
        LiveConfig.from_flags(None, max_length=64, temperature=2.0)


# -- a teacher behind a server (`--engine server`): the rank sends the requests itself -----------------

KEY = "sk-logitstore-live-7d2e"
FIRST_STEP = dict(COMMON, eval_fraction=0.0)  # the first step's loss and no held-out pass: seconds, not a minute


@pytest.fixture(scope="module")
def tiny_server(tiny_teacher):
    """The tiny teacher behind the test server (`logitstore/testing/openai_server.py`), top-20 at most."""
    with serve_teacher(tiny_teacher, max_logprobs=20) as server:
        yield server


def served_run(tiny_teacher, corpus: Path, out: Path, *extra, server=None, env=None):
    """`train --live-teacher` on the tiny teacher, one step; behind `server` when given."""
    live = ["--live-teacher", tiny_teacher, "--data", corpus, "--id-column", "id", "--max-length", 128]
    served = ["--engine", "server", "--server-url", server.url] if server is not None else []
    common = [f"--{k.replace('_', '-')}={v}" for k, v in FIRST_STEP.items()]
    args = ["train", *served, *live, "--out", out, "--steps", 1, *common, *extra]
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def test_a_served_live_teacher_trains_as_a_store_of_the_same_teacher(tiny_teacher, tiny_server, corpus, tmp_path):
    """`train --live-teacher T --engine server`: the rank sends the requests (no teacher process) and the
    losses equal those of a store built by the torch engine from the same teacher at the same --top-k,
    one unpadded sample per batch (what the server's scorer computes). The server wants a key, given by
    the variable: it is sent, and lands nowhere in the run folder or the output."""
    store = str(tmp_path / "store")
    build = BuildConfig(
        store=store,
        data=str(corpus),
        id_column="id",
        max_length=128,
        teacher=tiny_teacher,
        sparsity=Sparsity(k=16),
        batch_tokens=2,
        progress=False,
    )
    run_build(build, log=lambda _: None)
    launch(TrainConfig.from_flags(store=store, out=str(tmp_path / "store-run"), steps=1, **FIRST_STEP))
    tiny_server.api_key = KEY
    try:
        seen = len(tiny_server.keys_seen)
        key = {API_KEY_VARIABLE: KEY}
        result = served_run(tiny_teacher, corpus, tmp_path / "run", "--top-k", 16, server=tiny_server, env=key)
        printed = served_run(
            tiny_teacher,
            corpus,
            tmp_path / "p",
            "--top-k",
            16,
            "--server-api-key",
            KEY,
            "--print-config",
            server=tiny_server,
        )
    finally:
        tiny_server.api_key = None
    assert result.exit_code == 0, result.output
    assert len(tiny_server.keys_seen) > seen + 2 and set(tiny_server.keys_seen[seen:]) == {f"Bearer {KEY}"}
    np.testing.assert_allclose(losses(tmp_path / "run"), losses(tmp_path / "store-run"), rtol=1e-6)
    first = header(tmp_path / "run")
    assert (first["live_engine"], first["live_transport"], first["live_teacher_pid"]) == ("server", "in_rank", None)
    assert printed.exit_code == 0 and "server_url" in printed.output, printed.output
    for text in (result.output, printed.output):
        assert KEY not in text
    for root, _, files in os.walk(tmp_path / "run"):
        for name in files:
            assert KEY.encode() not in (Path(root) / name).read_bytes(), name


PASSWORD = "S3cretPW-live-93b"


def test_a_password_in_the_served_teachers_url_is_kept_nowhere_in_the_run(tiny_teacher, tiny_server, corpus, tmp_path):
    """`--server-url http://alice:PASSWORD@host` (HTTP basic auth): the run trains, and neither its output
    (--json), its folder (config.yaml, metrics) nor `train --resume --print-config` holds the password.
    Resuming from the kept configuration asks for the URL in one line; given, it is printed redacted."""
    url = tiny_server.url.replace("http://", f"http://alice:{PASSWORD}@")
    result = served_run(tiny_teacher, corpus, tmp_path / "run", "--engine", "server", "--server-url", url, "--json")
    resume = ["train", "--out", str(tmp_path / "run"), "--resume", "--print-config"]
    kept = CliRunner().invoke(app, resume)
    given = CliRunner().invoke(app, [*resume, "--server-url", url])
    for output in (result, kept, given):
        assert PASSWORD not in output.output
    for root, _, files in os.walk(tmp_path / "run"):
        for name in files:
            assert PASSWORD.encode() not in (Path(root) / name).read_bytes(), name
    assert result.exit_code == 0, result.output
    assert "give the URL with its password" in one_line_error(kept, 2)
    assert given.exit_code == 0 and f"http://alice:<redacted>@{tiny_server.url[7:]}" in given.output


@pytest.mark.parametrize(
    "case, args, message",
    [
        ("wrong model", ["--top-k", 16], "serves other-model, not the teacher"),
        ("k", ["--top-k", 24], "vllm serve --max-logprobs 24"),
        ("sample", ["--sample", 16], "cannot store --sample entries"),
        ("engine", ["--engine", "vllm"], "--engine vllm does not run in live mode"),
    ],
)
def test_what_the_served_teacher_cannot_serve_is_refused_before_the_run_folder(
    case, args, message, tiny_teacher, tiny_server, corpus, tmp_path
):
    """One line, exit 2, and no run folder: the preflight runs before the run takes --out."""
    if case == "wrong model":
        tiny_server.model, restore = "other-model", tiny_server.model
    try:
        server = None if case == "engine" else tiny_server
        result = served_run(tiny_teacher, corpus, tmp_path / "run", *args, server=server)
    finally:
        if case == "wrong model":
            tiny_server.model = restore
    errors = [line for line in result.output.splitlines() if line.startswith("error")]
    assert result.exit_code == 2, result.output
    assert len(errors) == 1 and message in errors[0], result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


def test_a_sample_the_server_refuses_stops_the_run_in_one_line_naming_it(tiny_teacher, tiny_server, corpus, tmp_path):
    """A live batch cannot go without one of its samples: the run stops at once, exit 2, naming the sample
    (a build would skip and count it). The server refuses every whole 128-token window, not the preflight's probe."""
    tiny_server.faults.refuse_if(lambda prompt: len(prompt) == 128)
    try:
        result = served_run(tiny_teacher, corpus, tmp_path / "run", "--top-k", 16, server=tiny_server)
    finally:
        tiny_server.faults.clear()
    errors = [line for line in result.output.splitlines() if line.startswith("error")]
    assert result.exit_code == 2, result.output
    assert len(errors) == 1 and re.search(r"left out sample '[^']+' \(128 tokens; \d+ refused", errors[0]), errors
    assert "Traceback" not in result.output
