"""`logitstore report`: every section for every teacher, pictures of the stated size, and numbers that
agree with a slow per-sample reference computed from `StoreVersion.sample`."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.files import replace_file
from logitstore.store.report import DPI, FIGURE_SIZE, MANIFEST, PICTURE, teacher_sections, teacher_stats
from logitstore.store.store import Store
from logitstore.testing.cli import one_line_error
from logitstore.testing.png import png_size
from logitstore.testing.stores import teacher, write
from logitstore.testing.synthetic import random_samples

SECTIONS = [
    "Entries per position",
    "Entropy and tail mass",
    "Stored log-probabilities against the value grid",
    "Bytes per token per part",
    "Top-1 agreement with the next token",
    "Samples with the highest tail mass",
    "Samples with the lowest top-1 agreement",
]
TEACHERS = ("teacher-a", "teacher-b")


def agreeing(samples):
    """`samples` with every input token after the first set to the previous position's top entry."""
    offsets = np.concatenate([[0], np.cumsum(samples.n_entries)])
    best = [
        offsets[i] + int(np.argmax(samples.entry_logprobs[offsets[i] : offsets[i + 1]]))
        for i in range(len(offsets) - 1)
    ]
    top = samples.entry_ids[best]
    starts = np.concatenate([[0], np.cumsum(samples.n_tokens)])
    for s in range(len(samples)):  # positions of sample s: starts[s] - s onwards (one fewer per sample)
        p0 = starts[s] - s
        samples.input_ids[starts[s] + 1 : starts[s + 1]] = top[p0 : p0 + samples.n_tokens[s] - 1]
    return samples


@pytest.fixture
def store(tmp_path):
    """teacher-a (top-k) in two parts, one sample replaced by the second (its old positions stay in the
    first part, unreferenced); teacher-b (sampled) in one; sample `good` agrees with its next tokens."""
    uri = str(tmp_path / "store")
    s = Store.open(uri, create=True)
    write(s, random_samples(["a", "b", "c"], seed=1, min_tokens=20))
    write(s, random_samples(["b", "d"], seed=2, min_tokens=20), on_duplicate="replace")
    write(s, agreeing(random_samples(["good"], seed=3, min_tokens=30)))
    sampled = random_samples(["a", "e"], seed=4, mode="sampled", min_tokens=20)
    write(s, sampled, meta=teacher("teacher-b", mode="sampled"))
    return uri


def test_report_numbers_match_a_per_sample_reference(store):
    view = Store.open(store).read()
    for name in TEACHERS:
        stats = teacher_stats(view, name)
        meta = view.teachers[name]
        for i, sid in enumerate(stats.sample_ids):
            s = view.sample(sid, teacher=name)
            offsets = np.concatenate([[0], np.cumsum(s.n_entries)])
            tail, agree, entropy = [], [], []
            for t in range(len(s.n_entries)):  # the slow way: one position at a time
                lp = s.entry_logprobs[offsets[t] : offsets[t + 1]].astype(np.float64)
                ids = s.entry_ids[offsets[t] : offsets[t + 1]]
                agree.append(any(ids[lp == lp.max()] == s.input_ids[t + 1]))
                tail.append(float(s.tail[t]))
                if meta.sampled:
                    c = s.entry_counts[offsets[t] : offsets[t + 1]]
                    entropy.append(float((c * -lp).sum() / c.sum()))
                else:
                    entropy.append(
                        float(-(np.exp(lp) * lp).sum() - (s.tail[t] * np.log(s.tail[t]) if s.tail[t] > 0 else 0))
                    )
            assert stats.positions[i] == len(s.n_entries)
            assert stats.per_sample(stats.tail_sum)[i] == pytest.approx(np.mean(tail), rel=1e-5)
            assert stats.per_sample(stats.agree_sum)[i] == pytest.approx(np.mean(agree))
            assert stats.per_sample(stats.entropy_sum)[i] == pytest.approx(np.mean(entropy), rel=1e-5)
        assert stats.entries.sum() == stats.positions.sum() == stats.entropy.sum() == stats.tail.sum()
        assert stats.codes.sum() == sum(int(view.sample(sid, teacher=name).n_entries.sum()) for sid in stats.sample_ids)
    a = teacher_stats(view, "teacher-a")
    assert sorted(a.sample_ids) == ["a", "b", "c", "d", "good"] and len(a.parts) == 3
    assert a.per_sample(a.agree_sum)[a.sample_ids.index("good")] == 1.0
    tables = {s.title: s.table for s in teacher_sections(a)}
    lowest = [row[0] for row in tables["Samples with the lowest top-1 agreement"][1:]]
    assert sorted(lowest) == sorted(a.sample_ids) and lowest[-1] == "good"  # it agrees everywhere


@pytest.mark.parametrize("suffix", [".html", ".md"])
def test_report_writes_every_section_with_pictures_of_the_stated_size(store, tmp_path, suffix):
    out = tmp_path / f"report{suffix}"
    result = CliRunner().invoke(app, ["report", store, "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == f"wrote {out}"
    text = out.read_text()
    heading = (
        (lambda title, level: f"<h{level}>{title}</h{level}>")
        if suffix == ".html"
        else (lambda title, level: f"{'#' * level} {title}\n")
    )
    for name in TEACHERS:
        assert text.count(heading(f"Teacher {name}", 2)) == 1
    assert all(text.count(heading(title, 3)) == len(TEACHERS) for title in SECTIONS)
    if suffix == ".html":
        images = [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', text)]
    else:
        images = [(tmp_path / link).read_bytes() for link in re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)]
    assert len(images) == 5 * len(TEACHERS)  # five pictures per teacher
    size = (round(FIGURE_SIZE[0] * DPI), round(FIGURE_SIZE[1] * DPI))
    assert all(png_size(image) == size and len(image) > 5000 for image in images)


def test_report_refuses_an_unknown_format_and_draws_a_run_folder(store, tmp_path):
    result = CliRunner().invoke(app, ["report", store, "--out", str(tmp_path / "r.pdf")])
    assert (
        result.exit_code == 2
        and result.stderr.strip() == f"error: --out {tmp_path / 'r.pdf'}: name a .html or .md file"
    )
    run = tmp_path / "run"
    run.mkdir()
    start = {"event": "start", "store": store, "version": "ABCDEF0123456789", "teacher": "teacher-a"}
    start |= {"teachers": [{"name": "teacher-a"}], "student": "llama-tiny"}
    steps = [
        {
            "step": s,
            "loss": 5 - s / 10,
            "kd": 5 - s / 10,
            "ce": 8 - s / 10,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_second": 900,
        }
        | ({"eval_kl": 5 - s / 9, "eval_ce": 8 - s / 9} if s % 5 == 0 else {})
        for s in range(1, 21)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [start, *steps]))
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.stderr
    assert png_size((run / "training.png").read_bytes()) == (1200, 700)


def test_report_leaves_out_and_counts_damaged_samples(tmp_path):
    # One chunk's bytes flipped (as in test_crash.py): the reader loses only that chunk's samples.
    uri = str(tmp_path / "store")
    write(Store.open(uri, create=True), random_samples([f"s{i}" for i in range(30)], max_tokens=400, k=32))
    victim = max((tmp_path / "store" / "chunks").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 3 : len(data) // 3 + 16])
    victim.chmod(0o644)
    victim.write_bytes(bytes(data))
    damaged = json.loads(CliRunner().invoke(app, ["verify", uri, "--json"]).stdout)["damaged"]
    stats = teacher_stats(Store.open(uri).read(), "teacher-a")
    assert 0 < stats.damaged == len(damaged) < 30
    assert all(stats.positions[stats.sample_ids.index(d.split("/")[1])] == 0 for d in damaged)
    result = CliRunner().invoke(app, ["report", uri, "--out", str(tmp_path / "r.md")])
    assert (
        result.exit_code == 0
        and f"| samples left out as damaged (see verify) | {len(damaged)} |" in (tmp_path / "r.md").read_text()
    )


def test_out_that_cannot_be_written_is_one_line_before_the_store_is_read(store, tmp_path):
    (tmp_path / "file").write_text("")
    for out, problem in (
        (tmp_path / "file" / "r.html", f"lies under {tmp_path / 'file'}, which is a file, not a folder"),
        (Path("/proc/r.md"), "cannot be written in /proc"),
    ):
        result = CliRunner().invoke(app, ["report", store, "--out", str(out)])
        assert result.exit_code == 2 and result.stderr.startswith(f"error: --out {out} {problem}"), result.stderr
        assert len(result.stderr.splitlines()) == 1


def pictures_of(page: Path) -> set[str]:
    return {Path(link).name for link in re.findall(r"!\[[^]]*\]\(([^)]+)\)", page.read_text())}


def test_a_markdown_report_replaces_the_last_one_whole(store, tmp_path, monkeypatch):
    out = tmp_path / "d" / "r.md"
    folder = out.with_name("r_files")
    first = Store.open(store).log()[-2].id  # teacher-a alone: half the pictures of the tip's report
    assert CliRunner().invoke(app, ["report", store, "--out", str(out)]).exit_code == 0
    two_teachers = pictures_of(out)
    assert CliRunner().invoke(app, ["report", store, "--version", first, "--out", str(out)]).exit_code == 0
    assert len(pictures_of(out)) == len(two_teachers) // 2
    assert {p.name for p in folder.iterdir()} - {MANIFEST} == pictures_of(
        out
    )  # was: the first report's pictures stayed

    # A report that fails while writing leaves the last one whole: its page, and every picture it shows.
    before = out.read_text(), {p.name: p.read_bytes() for p in folder.iterdir() if p.name != MANIFEST}
    import logitstore.store.report

    def fail_at_the_page(target: Path, data: bytes) -> None:
        if target == out:
            raise OSError(28, "No space left on device")
        replace_file(target, data)

    monkeypatch.setattr(logitstore.store.report, "replace_file", fail_at_the_page)
    result = CliRunner().invoke(app, ["report", store, "--out", str(out)])
    assert result.exit_code == 2 and "No space left on device" in result.stderr
    assert out.read_text() == before[0]
    assert all((folder / name).read_bytes() == data for name, data in before[1].items())


def test_a_markdown_report_removes_only_the_pictures_it_wrote(store, tmp_path):
    """The pictures folder may hold the user's files: a picture, a folder, a file named as a report's
    picture (listed in the manifest, but not holding that picture), a link to a folder elsewhere. A
    report and the report replacing it remove only their own pictures, and follow no link."""
    out = tmp_path / "d" / "nb.md"
    folder = out.with_name("nb_files")
    (folder / "keep").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("not the report's")
    (folder / "link").symlink_to(elsewhere)
    users = {"figure1.png": b"mine", "keep/data.csv": b"a,b\n", "00-0123456789ab.png": b"named like a picture"}
    for name, data in users.items():
        (folder / name).write_bytes(data)
    first = Store.open(store).log()[-2].id
    assert CliRunner().invoke(app, ["report", store, "--out", str(out)]).exit_code == 0
    with (folder / MANIFEST).open("a") as manifest:  # listed, yet not what a report wrote: it stays
        manifest.write("00-0123456789ab.png\n../elsewhere/precious.txt\n")
    assert CliRunner().invoke(app, ["report", store, "--version", first, "--out", str(out)]).exit_code == 0
    assert all((folder / name).read_bytes() == data for name, data in users.items())
    assert (folder / "link").is_symlink() and [p.name for p in elsewhere.iterdir()] == ["precious.txt"]
    shown = {p.name for p in folder.iterdir() if PICTURE.fullmatch(p.name)} - {"00-0123456789ab.png"}
    assert shown == pictures_of(out)  # the first report's pictures are gone

    # A pictures folder that is a link is never followed: one line before the store is read, nothing written.
    linked = tmp_path / "e" / "nb.md"
    linked.parent.mkdir()
    linked.with_name("nb_files").symlink_to(elsewhere)
    result = CliRunner().invoke(app, ["report", store, "--out", str(linked)])
    assert "is a symbolic link" in one_line_error(result, 2)
    assert [p.name for p in elsewhere.iterdir()] == ["precious.txt"] and not linked.exists()
