"""The run folder and resuming: one test per way a run folder could lose or misreport a run.

A small synthetic store (random teacher distributions over a word-level vocabulary): the run folder is
the point, not the signal, so no teacher runs. Every run is 1-2 steps of `llama-tiny` on 32-token rows.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.format import codec
from logitstore.format.sparsity import Sparsity
from logitstore.store.meta import TeacherMeta
from logitstore.store.store import Store
from logitstore.testing.cli import CLI
from logitstore.testing.synthetic import random_samples
from logitstore.trainer.config import PER_COMMAND, RUN_CONFIG, TrainConfig
from logitstore.trainer.run_folder import MARKER
from logitstore.trainer.train import launch

VOCAB = 1000
COMMON = dict(seq_len=32, micro_batch=2, warmup_steps=2, lr=5e-3, eval_fraction=0.2)
FLAGS = ["--seq-len", "32", "--micro-batch", "2", "--warmup-steps", "2", "--lr", "5e-3", "--eval-fraction", "0.2"]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    uri = str(tmp_path_factory.mktemp("store") / "store")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    samples = random_samples([f"doc-{i}" for i in range(12)], max_tokens=80, k=8)
    meta = TeacherMeta(name="teacher-a", vocab_size=VOCAB, content_hash="w", tokenizer_hash="t", sparsity=Sparsity(k=8))
    with Store.open(uri, create=True).writer() as w:
        w.add_teacher(
            meta,
            tokenizer_json=tokenizer.to_str(),
            code_of_id=codec.frequency_id_order(samples.entry_ids, vocab_size=VOCAB),
        )
        w.write(samples, teacher="teacher-a")
        w.commit("write")
    return uri


def train(*args) -> object:
    return CliRunner().invoke(app, ["train", *map(str, args)])


def one_line_error(result, code: int = 2) -> str:
    assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steps(out: Path) -> list[int]:
    return [r["step"] for r in records(out) if "step" in r]


def starts(out: Path) -> list[dict]:
    return [r for r in records(out) if r.get("event") == "start"]


def move_main(uri: str) -> str:
    """One more commit on main (a sample again under a new id); returns main's new snapshot."""
    store = Store.open(uri)
    again = dataclasses.replace(store.read().sample("doc-0", teacher="teacher-a"), sample_ids=["doc-again"])
    with store.writer() as w:
        w.write(again, teacher="teacher-a")
        return w.commit("one more sample")


# -- item 1: --force removes only what a run wrote, and only in a folder a run marked ----------------


def test_force_removes_only_what_a_run_wrote(store, tmp_path):
    model_dir = tmp_path / "hf-model"  # a Hugging Face model directory: config.json, weights, a user's file
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors", "precious.txt"):
        (model_dir / name).write_text("{}")
    for extra in ([], ["--force"], ["--resume"]):
        error = one_line_error(train("--store", store, "--out", model_dir, "--steps", 1, *FLAGS, *extra))
        assert f"--out {model_dir} holds files but no logitstore run" in error
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json", "model.safetensors", "precious.txt"]

    out = tmp_path / "run"
    out.mkdir()  # an empty folder is a run's to take
    assert train("--store", store, "--out", out, "--steps", 2, "--checkpoint-every", 1, *FLAGS).exit_code == 0
    (out / "precious.txt").write_text("mine")
    (out / "config.json").write_text("{}")  # not a name a run writes
    result = train("--store", store, "--out", out, "--steps", 1, *FLAGS, "--force")
    assert result.exit_code == 0, result.stderr
    assert (out / "precious.txt").read_text() == "mine" and (out / "config.json").read_text() == "{}"
    assert (out / "step-1").is_dir() and not (out / "step-2").exists() and (out / "final").is_dir()
    assert steps(out) == [1] and len(starts(out)) == 1 and (out / MARKER).is_file()


# -- item 6: resume after the branch moved; a finished run; a run killed during the final export ------


def test_resume_reads_the_pinned_snapshot_and_a_finished_run_is_a_no_op(store, tmp_path):
    uri = str(tmp_path / "store")
    shutil.copytree(store, uri)  # main moves below; the module's store stays as it is
    out = tmp_path / "run"
    launch(TrainConfig.from_flags(store=uri, out=str(out), steps=1, **COMMON))
    pinned = starts(out)[0]["version"]
    moved = move_main(uri)
    resume = ["--store", uri, "--out", out, "--steps", 2, *FLAGS, "--resume"]

    result = train(*resume)  # main moved: the run continues on the snapshot it pinned
    assert result.exit_code == 0, result.stderr
    assert [s["version"] for s in starts(out)] == [pinned, pinned] and records(out)[-1]["version"] == pinned
    assert steps(out) == [1, 2]

    error = one_line_error(train(*resume, "--version", "main"))
    assert pinned in error and moved in error

    before = (out / "metrics.jsonl").read_text()
    result = train(*resume, "--version", pinned, "--json")  # finished: nothing to do, and it says so
    assert result.exit_code == 0, result.stderr
    assert "already finished at step 2" in result.stderr and json.loads(result.stdout)["step"] == 2
    assert (out / "metrics.jsonl").read_text() == before

    # killed during the final export: step 2's checkpoint is complete, final/ is not
    (out / "final").rename(out / "final.partial")
    (out / "final.partial" / "config.json").unlink()
    result = train(*resume)
    assert result.exit_code == 0, result.stderr
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "final") is not None and not (out / "final.partial").exists()
    assert steps(out) == [1, 2] and json.loads((out / "final_metrics.json").read_text())["step"] == 2


def test_a_run_keeps_its_configuration_and_resume_starts_from_it(store, tmp_path):
    out = tmp_path / "run"
    result = train("--store", store, "--out", out, "--steps", 1, "--checkpoint-every", 1, *FLAGS)
    assert result.exit_code == 0, result.stderr
    kept = yaml.safe_load((out / RUN_CONFIG).read_text())
    assert kept["store"] == store and kept["lr"] == 5e-3 and kept["seq_len"] == 32 and "resume" not in kept
    again = yaml.safe_load(train("--config", out / RUN_CONFIG, "--print-config").stdout)  # what --config takes
    assert {k: v for k, v in again.items() if k not in PER_COMMAND} == kept
    error = one_line_error(train("--out", out, "--resume", "--steps", 2, "--lr", "1e-2"))
    assert "holds a run with another configuration (lr)" in error  # the kept configuration, then the flags
    result = train("--out", out, "--resume", "--steps", 2)  # no --store, no other flag: the run's own
    assert result.exit_code == 0, result.stderr
    assert steps(out) == [1, 2] and yaml.safe_load((out / RUN_CONFIG).read_text())["steps"] == 2


# -- item 9: an --out that cannot be written; metrics.jsonl after a kill -----------------------------


def test_an_out_that_cannot_be_written_is_one_line(store, tmp_path):
    """As root chmod stops nothing: a path under a regular file, a file, and a path /proc refuses."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out, why in (
        (blocker / "run", "Not a directory"),
        (blocker, "is a file"),
        (Path("/proc/self/logitstore-run"), "cannot be written"),
    ):
        error = one_line_error(train("--store", store, "--out", out, "--steps", 1, *FLAGS))
        assert f"--out {out}" in error and why in error


def test_a_read_only_filesystem_out_is_one_line(store, tmp_path):
    """A real read-only mount (tmpfs, -o ro) in a private mount namespace; skipped where none can be made."""
    mount = tmp_path / "ro"
    mount.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {mount}"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {probe.stderr.decode().strip()}")
    command = [*CLI, "train", "--store", store, "--out", f"{mount}/run", "--steps", "1", *FLAGS]
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o ro tmpfs {mount} && exec "$@"', "sh", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"error: --out {mount}/run cannot be written: Read-only file system"


def test_a_resumed_run_logs_each_step_once(store, tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig.from_flags(store=store, out=str(out), steps=2, checkpoint_every=1, **COMMON)
    launch(cfg)
    first = [r for r in records(out) if "step" in r]
    # Killed while saving step 2's checkpoint, after logging step 2 and while writing a line after it.
    (out / "step-2").rename(out / "step-2.partial")
    shutil.rmtree(out / "final")
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')
    launch(dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, resume=True)))
    assert steps(out) == [1, 2] and len(starts(out)) == 2
    assert records(out)[-1]["loss"] == first[-1]["loss"]  # and step 2 is the same step again


# -- one launcher per --out ---------------------------------------------------------------------------


def test_a_second_launcher_on_a_held_out_is_refused_and_a_stale_lock_is_taken_over(store, tmp_path):
    out, lock = tmp_path / "run", tmp_path / "run" / "logitstore-run.lock"  # the lock docs/train.md names
    out.mkdir()
    with lock.open("w") as held:  # as a launcher holds it while its ranks train: flock'ed, its pid inside
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(f"{os.getpid()}\n")
        held.flush()
        error = one_line_error(train("--store", store, "--out", out, "--steps", 1, *FLAGS))
        assert f"--out {out} is in use by another train (pid {os.getpid()})" in error  # was: two runs in one folder
        assert [p.name for p in out.iterdir()] == [lock.name]  # the refused start touched nothing
    # `held` is there and holds no flock: what a launcher killed with SIGKILL leaves
    assert train("--store", store, "--out", out, "--steps", 1, *FLAGS).exit_code == 0  # and it counts as empty
    assert steps(out) == [1] and not lock.exists()


# -- exit codes: an error inside spawned ranks -------------------------------------------------------


def test_an_error_inside_two_ranks_is_one_line_with_its_exit_code(store, tmp_path):
    """--seq-len beyond the student's positions fails in every rank, after the parent's checks; the
    command prints one line and exits 2, and the failed start leaves --out unclaimed."""
    out = tmp_path / "run"
    result = subprocess.run(
        [*CLI, "train", "--store", store, "--out", str(out), "--nproc", "2", "--steps", "1"]
        + ["--seq-len", "100000", "--micro-batch", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(errors) == 1 and "exceeds the student" in errors[0], result.stderr
    assert not (out / MARKER).exists()
