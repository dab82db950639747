"""The command line: the exact commands and JSON fields other tools rely on, and clean user errors."""

from __future__ import annotations

import json
import math
import socket
import subprocess

import pytest
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.store.store import Store
from logitstore.testing.cli import CLI, run_in_child, sample_corpus_head
from logitstore.testing.stores import write
from logitstore.testing.synthetic import random_samples

runner = CliRunner()


def run(*args, code=0):
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
    return result


def run_json(*args):
    return json.loads(run(*args, "--json").stdout)


@pytest.fixture
def store(tmp_path):
    uri = str(tmp_path / "store")
    s = Store.open(uri, create=True)
    write(s, random_samples(["a", "b"], seed=1), message="first")
    s.tag("v1")
    write(s, random_samples(["c"], seed=2), message="second")
    return uri


def test_info_json_fields(store):
    info = run_json("info", store)
    assert {"samples", "tokens", "stored_bytes", "bytes_per_token", "teachers", "version"} <= set(info)
    assert info["samples"] == 3 and info["teachers"][0]["name"] == "teacher-a"
    assert info["teachers"][0]["vocab_size"] == 1000 and info["teachers"][0]["sparsity_mode"] == "topk"
    assert run_json("info", store, "--version", "v1")["samples"] == 2
    assert "bytes/token" in run("info", store).stdout


def test_show_json_format(store):
    samples = random_samples(["a", "b"], seed=1)
    obj = run_json("show", store, "b")
    assert obj["sample_id"] == "b" and obj["input_ids"] == samples.select(1).input_ids.tolist()
    assert len(obj["positions"]) == len(obj["input_ids"]) - 1
    for pos in obj["positions"]:
        assert set(pos) >= {"ids", "logprobs", "tail", "target_logprob"}
        assert pos["logprobs"] == sorted(pos["logprobs"], reverse=True)
        assert abs(sum(math.exp(x) for x in pos["logprobs"]) + pos["tail"] - 1) < 0.05
    assert "target p=" in run("show", store, "a").stdout


def test_log_tag_diff(store):
    lines = run("log", store).stdout.splitlines()
    assert "second" in lines[0] and "[v1]" in lines[1] and len(lines) == 3  # + the store's creation
    assert "tagged" in run("tag", store, "v2").stdout
    assert run_json("log", store)[0]["tags"] == ["v2"]
    changes = run_json("diff", store, "v1", "v2")
    assert changes == {"added": [{"teacher": "teacher-a", "sample_id": "c"}], "removed": [], "changed": []}
    assert "1 added, 0 removed, 0 changed" in run("diff", store, "v1", "main").stdout


def test_verify_whole_store(store):
    assert "ok:" in run("verify", store).stdout
    assert run_json("verify", store)["ok"] is True


@pytest.mark.parametrize(
    "args, message",
    [
        (["info", "/nonexistent/store"], "not a logitstore store"),
        (["info", "{store}", "--version", "nope"], "no version, tag or branch 'nope'"),
        (["show", "{store}", "missing"], "no sample 'missing'"),
        (["show", "{store}", "a", "--teacher", "nobody"], "no teacher 'nobody'"),
        (["tag", "{store}", "v1"], "already exists"),
        (["diff", "{store}", "v1", "nope"], "no version"),
        (["info", "ftp://host/x"], "unsupported scheme"),
        (
            ["train", "--store", "{store}", "--out", "/tmp/never", "--top-k", "8"],
            "--top-k only apply with --live-teacher",
        ),
        (["train", "--out", "/tmp/never"], "exactly one of --store and --live-teacher"),
        (["train", "--store", "{store}", "--live-teacher", "default", "--out", "/tmp/never"], "exactly one of"),
        (["train", "--store", "{store}", "--live", "--out", "/tmp/never"], "exactly one of"),
        (["train", "--live-teacher", "default", "--version", "v1", "--out", "/tmp/never"], "no --teacher-weight"),
        (
            ["train", "--live-teacher", "default", "--top-p", "0.9", "--sample", "4", "--out", "/tmp/never"],
            "choose one of --top-p and --sample",
        ),
    ],
)
def test_user_errors_are_one_line(store, args, message):
    before = Store.open(store).resolve()
    result = run(*[a.format(store=store) for a in args], code=2)
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout and len(result.stderr.strip().splitlines()) == 1
    assert Store.open(store).resolve() == before


def test_live_is_live_teacher_default_unless_a_live_teacher_is_named(tmp_path):
    for args, teacher in [([], "default"), (["--live-teacher", "./my-teacher"], "./my-teacher")]:
        result = CliRunner().invoke(app, ["train", "--live", *args, "--out", str(tmp_path / "o"), "--print-config"])
        assert result.exit_code == 0 and f"\nlive_teacher: {teacher}\n" in result.output, result.output


def test_unreachable_s3_endpoint_fails_fast(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    result = run("info", "s3://bucket/prefix", code=2)
    assert "cannot reach the S3 endpoint" in result.stderr  # the quick probe's word, not Icechunk's minute of retries


def test_missing_s3_bucket_is_a_clear_error(s3_endpoint):
    result = run("info", "s3://no-such-bucket/x", code=2)
    assert result.stderr.startswith("error: ")


def test_ls_lists_every_sample_and_show_takes_a_range_of_positions(store):
    listed = run_json("ls", store)
    assert [(r["sample_id"], r["teacher"]) for r in listed] == [
        ("a", "teacher-a"),
        ("b", "teacher-a"),
        ("c", "teacher-a"),
    ]
    assert [r["tokens"] for r in listed] == [len(run_json("show", store, s)["input_ids"]) for s in "abc"]
    assert [r["sample_id"] for r in run_json("ls", store, "--version", "v1")] == ["a", "b"]
    assert [r["sample_id"] for r in run_json("ls", store, "--limit", "1")] == ["a"]
    assert run("ls", store).stdout.splitlines()[0].split() == ["sample_id", "tokens", "teacher"]
    whole = run_json("show", store, "b")
    part = run_json("show", store, "b", "--positions", "2:4")
    assert part["positions"] == whole["positions"][2:4] and part["first_position"] == 2
    assert part["input_ids"] == whole["input_ids"][2:5]  # was every input id of the sample
    assert len(run("show", store, "b", "--positions", ":3").stdout.splitlines()) == 1 + 3
    for bad in ("3:1", "x", "-1:2"):
        result = run("show", store, "b", "--positions", bad, code=2)
        assert "--positions" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_missing_data_file_fails_before_torch_loads_and_creates_no_store(tmp_path):
    status, stderr = run_in_child("build", "--store", tmp_path / "s", "--data", tmp_path / "missing.jsonl")
    assert status == ["2", "False", "False"], (status, stderr)  # exit 2, before transformers and torch
    assert stderr.strip() == f"error: {tmp_path / 'missing.jsonl'}: no such file or folder"
    assert not (tmp_path / "s").exists()
    csv = tmp_path / "no-header.csv"
    csv.write_text(
        "A whole first document, with commas, taken as the header row because it is the first row,2\nanother row,3\n"
    )
    result = runner.invoke(app, ["build", "--store", str(tmp_path / "s"), "--data", str(csv)])
    assert result.exit_code == 2 and "the first row is taken as the header" in result.stderr
    assert len(result.stderr) < 300 and not (tmp_path / "s").exists()


def test_help_groups_options_shows_choices_and_lists_commands_in_order_of_use():
    from logitstore.cli import app as cli
    from logitstore.format.grid import GRIDS
    from logitstore.pipelines.config import DTYPES, ON_DUPLICATE
    from logitstore.pipelines.engines import VLLM_OUTPUTS, engine_names
    from logitstore.text import chat
    from logitstore.trainer.config import LOSS_NAMES, ON_ERROR

    wide = {"COLUMNS": "200"}  # so no choice list is wrapped
    train_help = runner.invoke(app, ["train", "--help"], env=wide).stdout
    panels = ["Output", "Data", "Student", "Optimisation", "Loss", "Checkpoints and evaluation", "Live mode"]
    assert [train_help.index(f"─ {p}") for p in panels] == sorted(train_help.index(f"─ {p}") for p in panels)
    assert "|".join(LOSS_NAMES) in train_help and "|".join(ON_ERROR) in train_help  # the registries' choices
    build_help = runner.invoke(app, ["build", "--help"], env=wide).stdout
    assert all(f"─ {p}" in build_help for p in ("Data", "Teacher", "Sparsity", "Store"))
    choices = [GRIDS, DTYPES, ON_DUPLICATE, engine_names(), VLLM_OUTPUTS, chat.TRAIN_ON]  # from the registries
    assert all("|".join(names) in build_help for names in choices)
    assert (
        "logitstore[vllm]" in build_help and "default|fine|coarse" in build_help and "error|replace|skip" in build_help
    )
    assert "<bool>" not in build_help + train_help and "--no-" not in train_help  # flags: one name, no value
    commands = [
        line.split()[1]
        for line in run("--help").stdout.splitlines()
        if line.startswith("│ ") and line.split()[1] in cli.COMMAND_ORDER
    ]
    assert commands == list(cli.COMMAND_ORDER)
    assert run("--version").stdout.startswith("logitstore ")
    result = run("train", "--store", "x", "--out", "y", "--loss", "kl", code=2)
    assert "'kl' is not one of" in result.stderr or "is not one of" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--out", "OUT", "--steps", "5"], "give exactly one of --store and --live-teacher"),
        (["train", "--store", "STORE", "--out", "OUT", "--report-to", "nosuch"], "--report-to 'nosuch'"),
        (
            ["train", "--store", "STORE", "--out", "OUT", "--loss", "forward_kl", "--kd-temperature", "0"],
            "--kd-temperature",
        ),
        (["train", "--store", "STORE", "--out", "OUT", "--teacher-weight", "a=x"], "--teacher-weight 'a=x'"),
        (["train", "--store", "STORE", "--out", "OUT", "--max-length", "64"], "only apply with --live-teacher"),
        (["eval", "--store", "STORE", "--student", "llama-tiny", "--eval-fraction", "2"], "--eval-fraction"),
    ],
)
def test_flag_only_errors_come_before_torch_loads(tmp_path, args, message):
    """Was: `train --out ./r --steps 5` said so after 61 s on a loaded machine (9.6 s of CPU), as the
    training stack loaded first. Checked by order: torch is not imported when the error is printed."""
    args = [str(tmp_path / a) if a in ("STORE", "OUT") else a for a in args]
    status, stderr = run_in_child(*args)
    assert status == ["2", "False", "False"], (status, stderr)
    assert stderr.startswith("error: ") and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "OUT").exists()


@pytest.mark.slow
def test_a_piped_build_of_the_default_teacher_logs_only_its_own_lines(tmp_path):
    """Was: in a log file the GGUF loader's tqdm bar came between the progress lines, and the counts
    read `15,658 tokens, 0 samples, 0 documents` while tokens climbed."""
    data = sample_corpus_head(tmp_path / "d.jsonl", docs=2, chars=400)
    args = ["build", "--store", tmp_path / "s", "--data", data, "--max-length", "32", "--batch-tokens", "32"]
    done = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert "\r" not in done.stderr and "GGUF" not in done.stderr, lines[:5]  # was: ~30 lines of its bar
    assert all(line.startswith("build: ") for line in lines), lines
    first = next(line for line in lines if "tokens/s" in line)  # at the first batch: documents read already
    assert " samples written, 2 documents read," in first, first


def test_a_refused_train_leaves_no_folder_and_eval_names_the_version_given(tiny_teacher, tmp_path):
    """Was: `train --version v2` (missing) left an empty --out; `eval` printed the snapshot id only."""
    data = sample_corpus_head(tmp_path / "d.jsonl", docs=3, chars=300)
    store = tmp_path / "store"
    assert (
        runner.invoke(
            app, ["build", "--teacher", tiny_teacher, "--store", str(store), "--data", str(data), "--max-length", "32"]
        ).exit_code
        == 0
    )
    run("tag", str(store), "v1")
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--store", str(store), "--out", str(out), "--version", "v2", "--steps", "1"])
    assert result.exit_code == 2 and "no version, tag or branch 'v2'" in result.stderr
    assert not out.exists()  # was: an empty folder
    snapshot = Store.open(str(store)).resolve("v1")
    result = run(
        "eval",
        "--store",
        str(store),
        "--student",
        "llama-tiny",
        "--version",
        "v1",
        "--seq-len",
        "32",
        "--eval-fraction",
        "1",
    )
    assert result.stdout.strip().endswith(f"(version v1 = {snapshot})"), result.stdout
