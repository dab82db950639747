"""`train --report-to`: TensorBoard, Weights & Biases (offline) and MLflow (a local file store) receive the
numbers metrics.jsonl holds, read back through each tracker's own files; a wrong flag fails before torch."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.testing.cli import sample_corpus_head, small_build
from logitstore.trainer.trackers import SINKS, scalars


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_teacher) -> str:
    data = sample_corpus_head(tmp_path_factory.mktemp("data") / "corpus.jsonl", docs=6, chars=600)
    uri = str(tmp_path_factory.mktemp("store") / "store")
    result = CliRunner().invoke(app, small_build(tiny_teacher, uri, data, "--top-k", "8"))
    assert result.exit_code == 0, result.stderr
    return uri


def test_report_to_flag_errors_come_before_torch(tmp_path):
    # Order, not time: the child says whether torch had been imported when the one-line error came.
    code = (
        "import sys\n"
        "from logitstore.cli.app import main\n"
        "try:\n    main()\n"
        "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)\n"
    )
    base = ["train", "--store", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")]
    cases = [(["--report-to", "nope"], "--report-to 'nope': one of tensorboard, wandb, mlflow")]
    if importlib.util.find_spec("mlflow") is not None:
        cases.append((["--report-to", "mlflow"], "--report-to mlflow needs MLFLOW_TRACKING_URI"))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    for flags, message in cases:
        child = subprocess.run(
            [sys.executable, "-c", code, *base, *flags], capture_output=True, text=True, env=env, timeout=120
        )
        assert child.stdout.strip() == "exit 2 False", (flags, child.stdout, child.stderr)
        assert child.stderr.startswith(f"error: {message}") and len(child.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "run").exists()


def wandb_history(run_file: Path) -> dict[int, dict]:
    """The history rows of a `.wandb` run file: W&B's record log (LevelDB's log format: 32 KiB blocks of
    records with a 7-byte header, split FIRST/MIDDLE/LAST across blocks) of `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, rows = run_file.read_bytes(), 32768, 7, b"", {}
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's last bytes, too few for a header, are padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                rows.setdefault(record.history.step.num, {}).update(items)
    return rows


def test_trackers_receive_the_metrics_of_metrics_jsonl(store, tmp_path, monkeypatch):
    for package in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(package, reason=f"pip install 'logitstore[{package}]' (in the [test] extra)")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")  # wandb's own switch: run files only, no account
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 refuses its file store without it
    out = tmp_path / "run"
    args = ["train", "--store", store, "--out", str(out), "--steps", "4", "--eval-every", "2", "--seq-len", "32"]
    args += ["--micro-batch", "2", "--eval-fraction", "0.3", *(a for name in SINKS for a in ("--report-to", name))]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = {r["step"]: scalars(r) for r in lines if "step" in r}
    assert sorted(expected) == [1, 2, 3, 4] and "eval_kl" in expected[2] and "eval_kl" not in expected[3]
    assert {"loss", "kd", "ce", "lr", "grad_norm", "tokens_per_second"} <= set(expected[1])

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    board = {}
    for key in events.Tags()["scalars"]:
        for event in events.Scalars(key):
            board.setdefault(event.step, {})[key] = event.value
    assert board == {step: pytest.approx(values, rel=1e-6) for step, values in expected.items()}  # float32

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    assert {step: {k: v for k, v in row.items() if not k.startswith("_")} for step, row in history.items()} == {
        step: pytest.approx(values) for step, values in expected.items()
    }

    client = MlflowClient(tracking_uri=tracking)
    (run,) = client.search_runs([client.get_experiment_by_name("logitstore").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert json.loads(run.data.params["teachers"])[0]["name"] == lines[0]["teacher"]
    flow = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            flow.setdefault(m.step, {})[key] = m.value
    assert flow == {step: pytest.approx(values) for step, values in expected.items()}
