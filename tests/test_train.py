"""Stage two end to end on CPU with gloo: a real store from the default teacher, a fresh tiny student."""

from __future__ import annotations

import json
import os
import re
import runpy
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.pipelines.build import BuildConfig, run_build
from logitstore.store.store import Store
from logitstore.testing.cli import CLI, one_line_error, run
from logitstore.testing.dispatch import CountingMode
from logitstore.testing.runs import COMMON, metrics
from logitstore.testing.streams import stream, take
from logitstore.trainer.config import LossConfig, TrainConfig
from logitstore.trainer.losses import distill_loss
from logitstore.trainer.train import launch


@pytest.fixture(scope="module")
def store(train_store) -> str:
    """The default teacher's store of the sample corpus (conftest's `train_store`), built once for this module."""
    return train_store


def test_loss_goes_down_and_the_student_exports(store, tmp_path):
    out = tmp_path / "run"
    launch(TrainConfig.from_flags(store=store, out=str(out), steps=30, eval_every=30, **COMMON))
    rows = metrics(out)
    first, last = sum(r["kd"] for r in rows[:3]) / 3, sum(r["kd"] for r in rows[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert {"step", "loss", "tokens_per_second", "data_wait_seconds", "lr", "grad_norm", "kd", "ce"} <= set(rows[-1])
    assert (out / "training.png").stat().st_size > 1000
    assert rows[-1]["version"] == json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["version"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(out / "final") is not None
    assert AutoTokenizer.from_pretrained(out / "final")("hello")["input_ids"]
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--store",
            store,
            "--student",
            str(out / "final"),
            "--seq-len",
            "64",
            "--eval-fraction",
            "0.2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    evaluated = json.loads(result.stdout)
    assert evaluated["kl"] > 0 and evaluated["ce"] > 0


def test_a_step_that_logs_nothing_reads_nothing_back_from_the_device(store, tmp_path):
    # What a GPU would wait for, counted between one optimizer step and the next (start-up, the last
    # step's read-back, evaluation and export lie outside): item() (`_local_scalar_dense`), copies from
    # the device to the host, and ops whose output shape depends on the data (boolean masks, nonzero).
    per_step = []
    with CountingMode() as mode:
        hook = register_optimizer_step_post_hook(lambda *_: per_step.append(mode.take()))
        try:
            launch(TrainConfig.from_flags(store=store, out=str(tmp_path / "run"), steps=4, log_every=4, **COMMON))
        finally:
            hook.remove()
    after_a_silent_step = per_step[1:]  # steps 2, 3 and 4: the whole of each, after a step that logged nothing
    assert len(after_a_silent_step) == 3 and all(c.n_ops > 100 for c in after_a_silent_step)
    assert [c.n_syncs for c in after_a_silent_step] == [0, 0, 0], [dict(c.syncs) for c in after_a_silent_step]
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4]  # every step's record, written at step 4


def test_two_processes_agree_with_one_on_the_first_step(store, tmp_path):
    one = tmp_path / "one"
    two = tmp_path / "two"
    # Same global batch: 1 process x 4 rows, 2 processes x 2 rows; the same reader groups (the default
    # is the world size), so the same rows.
    launch(TrainConfig.from_flags(store=store, out=str(one), steps=1, reader_groups=2, **{**COMMON, "micro_batch": 4}))
    launch(TrainConfig.from_flags(store=store, out=str(two), steps=1, nproc=2, **COMMON))
    assert metrics(one)[0]["loss"] == pytest.approx(metrics(two)[0]["loss"], rel=1e-4)


def test_killed_run_resumes_with_bit_identical_losses(store, tmp_path):
    reference = tmp_path / "reference"
    launch(TrainConfig.from_flags(store=store, out=str(reference), steps=6, checkpoint_every=3, **COMMON))
    out = tmp_path / "killed"
    args = [
        "train",
        "--store",
        store,
        "--out",
        str(out),
        "--steps",
        "6",
        "--checkpoint-every",
        "3",
        "--seq-len",
        "64",
        "--micro-batch",
        "2",
        "--warmup-steps",
        "2",
        "--lr",
        "5e-3",
        "--eval-fraction",
        "0.2",
    ]
    child = subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (out / "step-3").exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (out / "step-3").exists() and not (out / "step-6").exists()
    result = CliRunner().invoke(app, [*args, "--resume"])
    assert result.exit_code == 0, result.stderr
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]  # a step logged before the kill: not twice
    resumed = {r["step"]: r["loss"] for r in metrics(out)}
    expected = {r["step"]: r["loss"] for r in metrics(reference)}
    assert [resumed[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]


def test_bad_train_input_is_one_clear_line(store, tmp_path):
    runner = CliRunner()
    base = ["train", "--store", store, "--steps", "1", "--seq-len", "64"]
    cases = [
        ([*base, "--out", str(tmp_path / "a"), "--seq-len", "100000"], "exceeds the student"),
        ([*base, "--out", str(tmp_path / "b"), "--version", "nope"], "no version"),
        ([*base, "--out", str(tmp_path / "c"), "--student", str(tmp_path)], "not a model directory"),
        ([*base, "--out", str(tmp_path / "d"), "--micro-batch", "0"], "--micro-batch"),
        ([*base, "--out", str(tmp_path / "f"), "--global-batch-tokens", "100"], "not a multiple"),
        ([*base, "--out", str(tmp_path / "g"), "--memory-budget", "12XB"], "--memory-budget"),
        ([*base, "--out", str(tmp_path / "h"), "--memory-budget", "1KB"], "smaller than two parts"),
        ([*base, "--out", str(tmp_path / "i"), "--kd-temperature", "-1", "--nproc", "2"], "--kd-temperature"),
        ([*base, "--out", str(tmp_path / "j"), "--report-to", "nope", "--nproc", "2"], "--report-to 'nope'"),
        ([*base, "--out", str(tmp_path / "k"), "--seq-len", "9000", "--nproc", "2"], "exceeds the student's 8192"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    for name in "ijk":  # configuration errors: refused before any process started or --out was touched
        assert not (tmp_path / name).exists()
    out = tmp_path / "b"  # the folder of the failed --version nope: the corrected command needs no --force
    result = runner.invoke(app, [*base, "--out", str(out), "--micro-batch", "2", "--eval-fraction", "0.5"])
    assert result.exit_code == 0, result.stderr
    final = json.loads((out / "final_metrics.json").read_text())
    assert "eval_kl" in final  # no --eval-every: a run still ends with a held-out KL
    assert f"held-out KL {final['eval_kl']:.4f}; the student is in {out}/final" in result.stdout
    assert "ETA" in result.stderr and (out / "training.png").exists()
    result = runner.invoke(app, [*base, "--out", str(out), "--lr", "1e-2"])
    assert result.exit_code == 2 and "already holds a run" in result.stderr
    result = runner.invoke(app, [*base, "--out", str(out), "--lr", "1e-2", "--resume", "--eval-fraction", "0.5"])
    assert result.exit_code == 2 and "another configuration (lr" in result.stderr


def test_eval_on_a_store_of_three_samples_and_an_empty_split(tmp_path):
    # Three short samples pack into fewer rows than one micro-batch: eval pads its last row and step.
    from logitstore.format.sparsity import Sparsity

    data = tmp_path / "three.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"s{i}", "text": text}) + "\n"
            for i, text in enumerate(
                [
                    "def add(a, b):\n    return a + b\n",
                    "Knowledge distillation trains a student.",
                    "import os\nprint(os.getcwd())\n",
                ]
            )
        )
    )
    store = str(tmp_path / "store")
    run_build(
        BuildConfig(store=store, data=str(data), max_length=64, sparsity=Sparsity(k=8), progress=False),
        log=lambda _: None,
    )
    args = ["eval", "--store", store, "--student", "llama-tiny", "--json"]
    result = CliRunner().invoke(app, [*args, "--eval-fraction", "1"])
    assert result.exit_code == 0, result.stderr
    evaluated = json.loads(result.stdout)
    assert evaluated["kl"] > 0 and evaluated["ce"] > 0  # a fresh student: far from the teacher
    result = CliRunner().invoke(app, [*args, "--eval-fraction", "0"])
    assert result.exit_code == 2 and "holds no samples; raise --eval-fraction" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_gpu_levers_leave_the_losses_unchanged(store, tmp_path):
    # Activation checkpointing recomputes the same activations; the compiled feed-forward computes the
    # same function; deferring the gradient reduction to the last micro-batch sums the same gradients in
    # another order; tensorboard only receives the records.
    args = dict(COMMON, steps=2, nproc=2, grad_accum=2)
    launch(TrainConfig.from_flags(store=store, out=str(tmp_path / "plain"), **args))
    levers = tmp_path / "levers"
    launch(
        TrainConfig.from_flags(
            store=store,
            out=str(levers),
            activation_checkpointing=True,
            compile=True,
            defer_grad_sync=True,
            report_to=("tensorboard",),
            **args,
        )
    )
    plain, pulled = metrics(tmp_path / "plain"), metrics(levers)
    assert [r["loss"] for r in pulled] == pytest.approx([r["loss"] for r in plain], rel=1e-4)
    events = list((levers / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100


@pytest.mark.parametrize("kind", ["transformers", "trl"])
def test_trainers_distil_from_a_store_like_logitstore_train(store, tmp_path, kind):
    # logitstore.trainer.hf.DistillationTrainer (transformers.Trainer) and DistillationSFTTrainer (TRL's
    # SFTTrainer): the same stream, student and loss code as logitstore train.
    from transformers import TrainingArguments

    import logitstore
    from logitstore.trainer.hf import DistillationTrainer
    from logitstore.trainer.model import build_student

    if kind == "trl":
        trl = pytest.importorskip("trl")
        from logitstore.trainer.hf_trl import DistillationSFTTrainer as trainer_class

        arguments = trl.SFTConfig
    else:
        trainer_class, arguments = DistillationTrainer, TrainingArguments
    reference = tmp_path / "reference"
    launch(TrainConfig.from_flags(store=store, out=str(reference), steps=1, **COMMON))
    view = logitstore.open(store)
    model, _ = build_student("llama-tiny", vocab_size=view.teachers[view.teacher_name(None)].vocab_size, seed=0)
    args = arguments(
        output_dir=str(tmp_path / kind),
        max_steps=24,
        per_device_train_batch_size=COMMON["micro_batch"],
        learning_rate=COMMON["lr"],
        warmup_steps=2,
        logging_steps=1,
        seed=0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
    )
    trainer = trainer_class(model, args, store=store, seq_len=COMMON["seq_len"], eval_fraction=COMMON["eval_fraction"])
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_kl"] < before["eval_kl"] - 0.5 and after["eval_ce"] > 0  # the held-out split, as in eval
    logs = [h for h in trainer.state.log_history if "kd" in h]
    assert logs[0]["loss"] == pytest.approx(metrics(reference)[0]["loss"], abs=1e-3)  # Trainer rounds to 4 digits
    kd = [h["kd"] for h in logs]
    assert sum(kd[-3:]) / 3 < sum(kd[:3]) / 3 - 0.5, kd


def test_distillation_trainer_resumes_a_checkpoint_at_its_data_position(store, tmp_path):
    # Six steps with a checkpoint at step 3, then a fresh trainer resumed from checkpoint-3: steps 4-6
    # see the same batches (the stream's position is in the checkpoint) and give the same losses.
    from transformers import TrainingArguments

    import logitstore
    from logitstore.trainer.hf import DistillationTrainer
    from logitstore.trainer.model import build_student

    def trainer(out: Path) -> DistillationTrainer:
        view = logitstore.open(store)
        model, _ = build_student("llama-tiny", vocab_size=view.teachers[view.teacher_name(None)].vocab_size, seed=0)
        args = TrainingArguments(
            output_dir=str(out),
            max_steps=6,
            per_device_train_batch_size=COMMON["micro_batch"],
            learning_rate=COMMON["lr"],
            logging_steps=1,
            seed=0,
            report_to=[],
            save_strategy="steps",
            save_steps=3,
            use_cpu=True,
        )
        return DistillationTrainer(model, args, store=store, seq_len=COMMON["seq_len"])

    def kd_by_step(t: DistillationTrainer) -> dict[int, float]:
        return {h["step"]: h["kd"] for h in t.state.log_history if "kd" in h}

    whole = trainer(tmp_path / "whole")
    whole.train()
    assert (tmp_path / "whole" / "checkpoint-3" / "logitstore_stream.json").is_file()
    resumed = trainer(tmp_path / "whole")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-3"))
    expected, got = kd_by_step(whole), kd_by_step(resumed)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # steps 1-3 come from the checkpoint's log history
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([expected[s] for s in (4, 5, 6)], abs=1e-5)
    with pytest.raises(Exception, match="logitstore_stream.json"):
        (tmp_path / "whole" / "checkpoint-6" / "logitstore_stream.json").unlink()
        trainer(tmp_path / "whole").train(resume_from_checkpoint=True)


def run_readme_snippet(after: str, store, tmp_path, capsys, *, doc: str = "README.md") -> str:
    """Run the first Python snippet after `after` in `doc` (the README, or a file under docs/), in a
    folder where ./quick is `store`; returns its last printed line."""
    os.symlink(store, tmp_path / "quick")  # the quick path's store, as the snippet names it
    run_doc_snippet(after, tmp_path, doc=doc)
    return capsys.readouterr().out.strip().splitlines()[-1]


def run_doc_snippet(after: str, folder: Path, *, doc: str) -> dict:
    """Run the first Python snippet after `after` in `doc` with `folder` as the working folder; returns
    the names it defined."""
    text = (Path(__file__).parents[1] / doc).read_text()
    section = text.split(after, 1)[1]
    (folder / "snippet.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return runpy.run_path(str(folder / "snippet.py"), run_name="__main__")
    finally:
        os.chdir(cwd)


def test_the_readme_trainer_snippet_runs_as_written(store, tmp_path, capsys):
    printed = run_readme_snippet("**From Python, under `transformers.Trainer`.**", store, tmp_path, capsys)
    assert printed.startswith("[(5, ") and "(10, " in printed


def test_the_readme_trl_snippet_runs_as_written_and_says_nothing_else(store, tmp_path):
    pytest.importorskip("trl")
    import os
    import subprocess
    import sys

    section = (Path(__file__).parents[1] / "docs" / "train.md").read_text().split("**TRL.**", 1)[1]
    (tmp_path / "snippet.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    os.symlink(store, tmp_path / "quick")
    done = subprocess.run(
        [sys.executable, "-W", "default", "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout.strip().splitlines()[-1]
    assert printed.startswith("[(5, ") and "(10, " in printed
    # was a FutureWarning from SFTConfig and "Updated tokens: {'eos_token_id': 0}" (the student's
    # config changed without a word); what stays is the progress bar and TRL's per-step log lines
    assert "Warning" not in done.stderr and "Updated tokens" not in done.stderr, done.stderr[-2000:]


def test_the_readme_own_loop_snippet_runs_as_written_and_learns(store, tmp_path, capsys):
    printed = run_readme_snippet("**Your own loop.**", store, tmp_path, capsys, doc="docs/train.md")
    first, last = (float(x) for x in re.fullmatch(r"KD (\S+) -> (\S+) in 10 steps", printed).groups())
    assert last < first - 0.5, printed


def test_train_refusals_that_need_the_store_come_before_out_is_claimed(chat_store, tmp_path):
    base = ["train", "--store", chat_store, "--steps", "1", "--seq-len", "32", "--micro-batch", "2"]
    cases = [
        (["--train-on", "prompt+completion"], "holds entries for completion tokens only"),
        (["--memory-budget", "1KB"], "smaller than two parts"),
        (["--micro-batch", "100000"], "fewer than one micro-batch"),
    ]
    for k, (args, message) in enumerate(cases):
        out = tmp_path / f"run{k}"
        error = one_line_error(run(*base, "--out", out, *args), 2)
        assert message in error, error
        assert not out.exists()  # was: claimed, so the corrected command was refused
    result = run(*base, "--out", tmp_path / "run0", "--eval-fraction", "0")  # the corrected command
    assert result.exit_code == 0, result.stderr


def test_a_loop_of_ones_own_computes_the_trainers_loss_from_the_exported_entries(store, tmp_path):
    """The default teacher's store exported (`export --what entries`) and read back with polars: docs/train.md's
    forward KL of the exported rows of one batch's positions equals the trainer's loss on that batch, read
    from the store, to 1e-5."""
    result = run("export", store, tmp_path / "entries.parquet", "--what", "entries")
    assert result.exit_code == 0, result.stderr
    view = Store.open(store).read()
    with stream(view, seq_len=64, micro_batch=2) as batches:
        (batch,) = take(batches, 1)
    # Each supervised position of the batch as (sample, position in it), from the batch's segments.
    sample_ids, firsts, starts, _ = zip(*batch.segments)
    flat = batch.positions.numpy()
    segment = np.searchsorted(np.array(starts), flat, side="right") - 1
    wanted = pl.DataFrame(
        {
            "sample": [sample_ids[s] for s in segment.tolist()],
            "position": (np.array(firsts)[segment] + flat - np.array(starts)[segment]).astype(np.int32),
        }
    )
    snippet = run_doc_snippet("**From an export, without logitstore.**", tmp_path, doc="docs/train.md")
    rows = wanted.join(snippet["rows"], on=["sample", "position"], how="left", maintain_order="left")
    assert rows["next_token"].to_list() == batch.target_ids.tolist()  # the same positions, in the batch's order
    logits = torch.randn(len(flat), snippet["vocab_size"], generator=torch.Generator().manual_seed(0)) * 3
    _, parts = distill_loss(logits, batch.targets, LossConfig())
    assert snippet["forward_kl"](rows, logits).item() == pytest.approx(parts["kd"], abs=1e-5)
