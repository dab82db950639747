"""`logitstore report RUN`: a run folder's metrics as a crashed or running run leaves them (a last line
cut short is left out with a note; a damaged line is one line naming it), a folder without metrics,
and the page `--out` writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.testing.png import png_size

START = {"event": "start", "store": "./store", "version": "ABCDEF0123456789", "teacher": "teacher-a"}
START |= {"teachers": [{"name": "teacher-a"}], "student": "llama-tiny"}
STEPS = [
    {"step": s, "loss": 5 - s / 10, "kd": 5 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_second": 900}
    | ({"eval_kl": 4 - s / 9} if s % 5 == 0 else {})
    for s in range(1, 13)
]


def run_folder(tmp_path: Path, tail: bytes = b"") -> Path:
    """A run folder as `train` leaves it, its metrics.jsonl followed by `tail`."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "logitstore-run.json").write_text("{}")
    (run / "metrics.jsonl").write_bytes("".join(json.dumps(r) + "\n" for r in [START, *STEPS]).encode() + tail)
    return run


def report(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["report", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("tail", [b'{"step": 13, "loss": 3.', b'{"step": 13, "note": "\xe2\x82'])
def test_a_last_line_cut_short_is_left_out_with_a_note(tmp_path, tail):
    run = run_folder(tmp_path, tail)
    code, stdout, stderr = report(run)
    assert code == 0 and stdout == f"wrote {run / 'training.png'}\n", stderr
    assert (
        stderr
        == f"note: {run / 'metrics.jsonl'}: its last line is cut short (the run stopped while writing it); left out\n"
    )
    assert png_size((run / "training.png").read_bytes()) == (1200, 700)


@pytest.mark.parametrize(
    ("damage", "problem"), [(b"\xff\xfe not text\n", "not UTF-8 text (byte 0)"), (b"[1, 2]\n", "not a JSON record")]
)
def test_a_damaged_line_before_the_last_is_one_line_naming_it(tmp_path, damage, problem):
    run = run_folder(tmp_path, damage + json.dumps({"step": 13, "loss": 3.0}).encode() + b"\n")
    code, _, stderr = report(run)
    assert code == 2 and stderr == f"error: {run / 'metrics.jsonl'} line {len(STEPS) + 2}: {problem}\n"


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"step": 13, "loss": "oops"}, "'loss' is 'oops', not a number"),
        ({"event": "start", "teachers": [1, 2]}, "'teachers' is [1, 2], not a list of teachers with their names"),
        ({"step": [1], "loss": 3.0}, "'step' is [1], not a step number"),
        ({"event": "start", "teacher": ["a"]}, "'teacher' is ['a'], not text"),
    ],
)
@pytest.mark.parametrize("out", [None, "page.md"])
def test_a_record_of_the_wrong_types_is_one_line_naming_it(tmp_path, record, problem, out):
    """Valid JSON whose fields are not what a run writes, on the last line too (it is whole, not cut short)."""
    run = run_folder(tmp_path, json.dumps(record).encode() + b"\n")
    code, _, stderr = report(run, *(["--out", tmp_path / out] if out else []))
    assert code == 2 and stderr == f"error: {run / 'metrics.jsonl'} line {len(STEPS) + 2}: {problem}\n"


def test_a_run_folder_without_metrics_says_so(tmp_path):
    run = run_folder(tmp_path)
    (run / "metrics.jsonl").unlink()
    code, _, stderr = report(run)
    assert (
        code == 2
        and stderr == f"error: {run} is a training run's folder without metrics.jsonl: its run logged nothing yet\n"
    )


@pytest.mark.parametrize("suffix", [".html", ".md"])
def test_out_writes_the_runs_page_there(tmp_path, suffix):
    run = run_folder(tmp_path)
    page = tmp_path / "pages" / f"run{suffix}"
    code, stdout, stderr = report(run, "--out", page)
    assert code == 0 and stdout == f"wrote {page}\n", stderr
    text = page.read_text()
    assert "logitstore run report" in text and "llama-tiny" in text and "ABCDEF0123456789" in text
    assert "2.8889" in text  # the held-out KL of the last evaluation (step 12 has none; step 10 does)
    assert not (run / "training.png").exists()  # the page, not the folder's picture
    if suffix == ".md":
        (link,) = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
        assert png_size((page.parent / link).read_bytes()) == (1200, 700)
    code, _, stderr = report(run, "--out", page, "--version", "v1")
    assert code == 2 and "training run's folder" in stderr
