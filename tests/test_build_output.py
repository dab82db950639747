"""What a build prints: progress lines on stderr (in tokens from the first batch, on a clock while the
input is tokenized, the remaining tokens estimated from the documents read, a long document's windows
counted as soon as it is tokenized) and the `--json` summary (its teachers; an input with nothing to
store makes no store and says so)."""

from __future__ import annotations

import json
import subprocess
import time

from logitstore.testing.cli import CLI, LONG, build, jsonl, run, small_build


def test_a_piped_build_reports_progress_in_tokens_from_the_first_batch(tiny_teacher, tmp_path):
    rows = [{"id": f"d{i}", "text": f"Document {i}: " + LONG} for i in range(8)]
    data = jsonl(tmp_path / "d.jsonl", rows)
    result = subprocess.run(
        [*CLI, *small_build(tiny_teacher, tmp_path / "store", data, "--batch-tokens", "64", "--json", id_column=None)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    lines = [line for line in result.stderr.splitlines() if line.startswith("build: ")]
    assert lines[0] == "build: sample ids are the input's 'id' column (found automatically)"
    progress = lines[1:]
    assert len(progress) >= 2 and all("tokens/s" in line for line in progress)  # the first batch's, and the last
    counts = [int(line.split()[1].replace(",", "")) for line in progress]
    # on a loaded machine the clock's line can come before the first batch: it says what is awaited
    assert all("first batch is not done" in line or "reading" in line for line, n in zip(progress, counts) if n == 0)
    assert 0 < next(n for n in counts if n) <= 64  # one batch of --batch-tokens, before any unit was merged
    assert progress[-1].startswith(f"build: {summary['tokens']:,} tokens, {summary['samples']:,} samples")
    startup = summary["startup_seconds"]  # the command to the first batch, in its phases and their sum
    assert list(startup) == ["process", "plan", "first_unit", "teacher", "first_batch", "total"]
    assert min(startup.values()) >= 0 and startup["process"] > 0  # the interpreter and imports come first
    assert abs(startup["total"] - sum(v for k, v in startup.items() if k != "total")) <= 0.005  # rounding
    assert "stdlib" not in result.stderr and [
        r["sample_id"] for r in json.loads(run("ls", tmp_path / "store", "--json").stdout)
    ][:1] == ["d0#w0"]


def test_progress_estimates_the_remaining_tokens_from_the_documents_read(tmp_path):
    from logitstore.pipelines.build import BuildConfig, Planned, Progress

    data = jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}"} for i in range(10)])
    lines = []
    planned = Planned()
    progress = Progress(BuildConfig(store="memory://p", data=str(data)), log=lines.append, every=0, planned=planned)
    progress.batch(100)  # a line at the first batch: no documents read yet, so no ETA
    assert lines[-1].startswith("build: 100 tokens, 0 samples written, 0 documents read") and "ETA" not in lines[-1]
    planned.documents, planned.tokens = 2, 400  # 200 tokens per document read, 10 documents
    progress.update(tokens=400, samples=4, documents=2)
    assert lines[-1].startswith("build: 400 of ~2,000 tokens") and "ETA" in lines[-1]
    progress.finish()
    assert lines[-1].startswith("build: 400 tokens, 4 samples written, 2 documents read") and "ETA" not in lines[-1]


def test_progress_counts_a_long_documents_windows_as_soon_as_it_is_tokenized(tiny_teacher, tmp_path):
    data = jsonl(tmp_path / "long.jsonl", [{"id": "long", "text": LONG * 12}])
    result = subprocess.run(
        [*CLI, *small_build(tiny_teacher, tmp_path / "store", data, "--batch-tokens", "64", "--json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    total = json.loads(result.stdout)["tokens"]
    lines = [line for line in result.stderr.splitlines() if line.startswith("build: ") and "tokens/s" in line]
    first = lines[0]  # at the first teacher batch, one unit of many into the one document
    assert first.split()[1] != f"{total:,}" and f" of ~{total:,} tokens" in first, (first, total)  # was: no total


def test_progress_lines_come_on_a_clock_while_the_input_is_tokenized():
    from logitstore.pipelines.build import BuildConfig, Planned, Progress

    lines: list[str] = []
    planned = Planned()
    progress = Progress(BuildConfig(store="memory://p"), log=lines.append, every=0.05, planned=planned)
    try:
        for _ in range(600):  # no batch, no unit: the clock alone prints (was: silence until the first batch)
            if lines:
                break
            time.sleep(0.05)
    finally:
        progress.close()
    assert lines and lines[0].startswith("build: 0 tokens") and lines[0].endswith("; reading and tokenizing the input")


def test_build_json_names_its_teacher_and_an_input_with_nothing_to_store_makes_no_store(tiny_teacher, tmp_path):
    result = build(tiny_teacher, tmp_path / "store", jsonl(tmp_path / "d.jsonl", [{"id": "d", "text": LONG}]))
    summary = json.loads(result.stdout)
    assert [t["teacher"] for t in summary["teachers"]] == ["tiny-teacher"]  # was: always []
    assert summary["teachers"][0]["samples"] == summary["samples"] > 0 and "teachers" not in summary["teachers"][0]
    for name, rows in [("empty", []), ("short", [{"id": "s", "text": "x"}])]:
        store = tmp_path / f"store-{name}"
        result = build(tiny_teacher, store, jsonl(tmp_path / f"{name}.jsonl", rows))
        summary = json.loads(result.stdout)
        assert result.exit_code == 0 and summary["commits"] == 0 and summary["version"] is None, result.stderr
        assert not store.exists()  # was: an empty store, reported as "commits 0"
    text = run(*small_build(tiny_teacher, tmp_path / "store-text", jsonl(tmp_path / "e.jsonl", [])))
    assert text.exit_code == 0 and text.stdout.startswith("nothing stored (no store or branch made): 0 samples")
