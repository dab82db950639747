"""Every benchmark's `--smoke` (benchmarks/_smoke.py): the script's own measuring code at toy size, in a child
process as a user runs it, with sane numbers in its output. A change that breaks a benchmark fails here.

Scripts with tests of their own run their smoke there: stream.py and named_arrays.py (test_benchmarks.py),
gpu.py (test_gpu.py), frontier.py (test_frontier.py, slow), vllm_engine.py (test_vllm_build.py, the vLLM job).
The smokes that run a teacher share one toy teacher, the one a smoke makes when given none."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from logitstore.testing.teachers import save_toy_teacher

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
TEACHER = "TEACHER"  # in a smoke's arguments: the toy teacher's path


def number(text: str) -> float:
    return float(text.replace(",", ""))


def rates(text: str, unit: str = "tokens/s") -> list[float]:
    """Every number written just before `unit`."""
    return [number(n) for n in re.findall(rf"([\d,.]+)\s+{re.escape(unit)}", text)]


def table(text: str) -> list[dict[str, str]]:
    """The rows of the markdown table in `text`, by its header."""
    lines = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0]]
    return [dict(zip(header, (cell.strip() for cell in row))) for row in lines[2:]]


def positive(*values: float) -> bool:
    return bool(values) and all(math.isfinite(v) and v > 0 for v in values)


def check_align(out: str) -> None:
    rows = table(out)
    assert [r["step"] for r in rows][-1] == "align_groups (teacher + student tokens)"
    assert len(rows) == 5 and positive(*(number(r["tokens/s"]) for r in rows))
    assert "groups:" in out


def check_build(out: str) -> None:
    measured = [line for line in out.splitlines() if line.count(" t/s") == 2]
    assert [line.split()[0] for line in measured] == ["toy-teacher", "stand-in"]  # the real teacher and one stand-in
    assert positive(*rates(out, "t/s")) and len(rates(out, "t/s")) == 4
    assert "write side alone" in out and positive(*rates(out))


def check_build_generate(out: str) -> None:
    assert re.search(r"build --generate 8: 4 prompts of 100 characters, [1-9][\d,]* tokens generated", out)
    assert len(rates(out, "generated tokens/s")) == len(rates(out)) == 1  # the engine alone; the teacher's pass
    assert positive(*rates(out, "generated tokens/s"), *rates(out))
    assert "whole build" in out and "store side" in out


def check_chunking(out: str) -> None:
    read = re.search(r"one sample read: (\d+) requests, ([\d,]+) bytes fetched", out)
    assert read and positive(number(read[1]), number(read[2]))


def check_codec(out: str) -> None:
    rows = {r["layout"]: r for r in table(out)}
    assert len(rows) == 6 and "logitstore store (write+commit / read)" in rows
    for r in rows.values():
        assert positive(number(r["bytes/token"]), number(r["encode tokens/s"]), number(r["decode tokens/s"])), r
    assert number(rows["logitstore codec"]["bytes/token"]) < number(rows["fp16+int32"]["bytes/token"])


def check_live(out: str) -> None:
    rows = {r["signal"].split()[0]: r for r in table(out)}
    assert list(rows) == ["store", "live"] and "shared memory" in rows["live"]["signal"]
    assert positive(*(number(r["student tokens/s"]) for r in rows.values()))


def check_server(out: str) -> None:
    result = json.loads(out.splitlines()[-1])
    assert result["samples"] == 16 and result["tokens"] == 16 * 128
    assert positive(*(result[key] for key in ("build_tokens_per_s", "answer_mb_per_s", "parse_convert_tokens_per_s")))
    assert positive(result["tokens_per_client_cpu_s"], result["bytes_per_token_stored"])


def check_stream_ab(out: str) -> None:
    pair = re.search(r"local-sampled16: read ([\d,]+) -> ([\d,]+) tokens/s \(([\d.]+)x\); decode floor ([\d,]+)", out)
    assert pair and positive(*(number(n) for n in pair.groups()))


def check_stream_loader(out: str) -> None:
    assert "in the consumer's process" in out and "DataLoader, 1 workers" in out
    assert len(rates(out)) == 2 and positive(*rates(out))


def check_teacher_load(out: str) -> None:
    result = json.loads(out)
    seconds = [s for way in ("file", "folder") for s in result["seconds"][way].values()]
    assert len(seconds) == 4 and positive(*seconds, result["ratio_describe"], result["ratio_load"])
    assert result["same_logits"] is True and result["folder_bytes"] > 0


def check_train(out: str) -> None:
    steps = re.findall(r"^(store|memory|online) .*?([\d.]+) ms/step\s+([\d,]+) tokens/s", out, flags=re.M)
    assert [s[0] for s in steps] == ["store", "memory", "online"]
    assert positive(*(number(n) for s in steps for n in s[1:]))
    assert "data-wait overhead" in out and "offline speed-up" in out


def check_train_scaling(out: str) -> None:
    rows = table(out)
    assert [r["seq_len"] for r in rows] == ["64", "256"]
    for r in rows:
        assert positive(number(r["new tokens/s"]), number(r["old tokens/s"])), r
        assert positive(number(r["new peak RSS"].split()[0]), number(r["old peak RSS"].split()[0])), r
    assert "- memory_256_over_64:" in out and "not measured" not in out


@dataclass(frozen=True)
class Smoke:
    command: tuple[str, ...]  # after the interpreter; TEACHER stands for the toy teacher's path
    check: Callable[[str], None]


# In the order they run in the background (`background_runs`); train_scaling.py runs seven processes.
SMOKES = {
    "train_scaling": Smoke(("train_scaling.py", "--smoke"), check_train_scaling),
    "live": Smoke(("live.py", "--smoke", "--teacher", TEACHER), check_live),
    "train": Smoke(("train.py", "--smoke", "--teacher", TEACHER), check_train),
    "server": Smoke(("server.py", "--smoke"), check_server),
    "stream_ab": Smoke(("stream_ab.sh", "--smoke"), check_stream_ab),
    "build": Smoke(("build.py", "--smoke", "--teacher", TEACHER), check_build),
    "build --generate": Smoke(("build.py", "--smoke", "--teacher", TEACHER, "--generate", "8"), check_build_generate),
    # without --teacher: the smoke makes its own toy teacher
    "codec": Smoke(("codec.py", "--smoke"), check_codec),
    "chunking": Smoke(("chunking.py", "--smoke"), check_chunking),
    "stream_loader": Smoke(("stream_loader.py", "--smoke"), check_stream_loader),
    "teacher_load": Smoke(("teacher_load.py", "--smoke"), check_teacher_load),
    "align": Smoke(("align.py", "--smoke"), check_align),
}


NICE = ["nice", "-n", "10"]  # beside the suite's tests, which come first (`background` in tests/conftest.py)


def run(smoke: Smoke, *, teacher: Callable[[], str], cwd: Path) -> subprocess.CompletedProcess:
    script, *args = smoke.command
    # stream_ab.sh compares two installs: this one with itself (AFTER_PYTHON, and BEFORE_PYTHON by default)
    interpreter = ["bash"] if script.endswith(".sh") else [sys.executable]
    return subprocess.run(
        [*NICE, *interpreter, str(BENCHMARKS / script), *(teacher() if a == TEACHER else a for a in args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,  # nothing a smoke writes lands in the checkout
        env={**os.environ, "AFTER_PYTHON": sys.executable},
    )


def background_runs(items, tmp_path_factory) -> dict[str, Callable[[], subprocess.CompletedProcess]]:
    """The selected smokes, run in the background from the session's start (tests/conftest.py): each is a few
    seconds of CPU, most of it a fresh process importing torch and transformers (over 20 processes in all).
    The smokes that run a teacher share the one a smoke makes when given none, made by the first of them."""
    module = sys.modules[__name__]
    selected = [item.callspec.params["name"] for item in items if item.module is module and hasattr(item, "callspec")]
    made: list[str] = []

    def teacher() -> str:
        if not made:
            made.append(save_toy_teacher(tmp_path_factory.mktemp("smokes") / "toy-teacher"))
        return made[0]

    return {
        f"smoke {name}": functools.partial(run, SMOKES[name], teacher=teacher, cwd=tmp_path_factory.mktemp("smoke"))
        for name in sorted(selected, key=list(SMOKES).index)
    }


@pytest.mark.parametrize("name", list(SMOKES))
def test_the_benchmark_smoke_runs_and_reports_sane_numbers(name, background):
    done = background[f"smoke {name}"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    SMOKES[name].check(done.stdout)


def test_every_script_has_a_smoke_run_somewhere():
    """A new benchmark script gets a smoke: here, or in the test module named for it below."""
    elsewhere = {
        "stream.py": "test_benchmarks.py",
        "named_arrays.py": "test_benchmarks.py",
        "export.py": "test_benchmarks.py",
        "step.py": "test_benchmarks.py",
        "gpu.py": "test_gpu.py",
        "frontier.py": "test_frontier.py",
        "vllm_engine.py": "test_vllm_build.py",
    }
    here = {smoke.command[0] for smoke in SMOKES.values()}
    scripts = {p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh") and not p.name.startswith("_")}
    assert scripts == here | set(elsewhere)
    for script, test in elsewhere.items():
        text = (Path(__file__).parent / test).read_text()
        assert script in text and '"--smoke"' in text, (script, test)
