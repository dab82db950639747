"""A run folder's report: training curves drawn from metrics.jsonl, for people who would rather look
than parse. `plot_metrics` draws OUT/training.png at the end of a run and for `logitstore report OUT`;
`run_sections` makes the page `logitstore report OUT --out FILE` writes (the store report's writers).

metrics.jsonl is read by `read_metrics`: a run killed mid-write leaves its last line cut short, which
is left out with a note; any other line that is not a JSON record is one line naming it.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from pathlib import Path

from logitstore.errors import LogitstoreError, quoted
from logitstore.files import replace_file
from logitstore.store.meta import RUN_MARKER

FIGURE_SIZE = (12.0, 7.0)  # inches at DPI 100: 1200 x 700 pixels
DPI = 100
METRICS = "metrics.jsonl"


class RunFolderError(LogitstoreError):
    """A run folder whose metrics cannot be read."""


def is_run_folder(path: Path) -> bool:
    """A training run's folder: it holds metrics or the marker a run writes."""
    return (path / METRICS).is_file() or (path / RUN_MARKER).is_file()


def _stderr_note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def read_metrics(out: Path, *, note: Callable[[str], None] = _stderr_note) -> list[dict]:
    """The records of OUT/metrics.jsonl; a last line cut short is left out, and said to `note`."""
    path = out / METRICS
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RunFolderError(
            f"{out} is a training run's folder without {METRICS}: its run logged nothing yet"
        ) from None
    except OSError as e:
        raise RunFolderError(f"{path} cannot be read: {e.strerror or e}") from None
    *lines, last = data.split(b"\n")  # `last` is empty when the file ends its last line
    numbered = [(n, _record(line, path=path, number=n)) for n, line in enumerate(lines, 1) if line.strip()]
    if last.strip():
        try:
            numbered.append((len(lines) + 1, _record(last, path=path, number=len(lines) + 1)))
        except RunFolderError:
            note(f"{path}: its last line is cut short (the run stopped while writing it); left out")
    for number, record in numbered:
        wrong = _wrong_field(record)
        if wrong is not None:
            raise RunFolderError(f"{path} line {number}: {wrong}")
    return [record for _, record in numbered]


def _record(line: bytes, *, path: Path, number: int) -> dict:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RunFolderError(f"{path} line {number}: not UTF-8 text (byte {e.start})") from None
    except ValueError:
        raise RunFolderError(f"{path} line {number}: not a JSON record") from None
    if not isinstance(record, dict):
        raise RunFolderError(f"{path} line {number}: not a JSON record")
    return record


# The fields a report reads, by the type a run writes them as (`train._log`): checked where a record is
# read, so no drawing or table meets a value it cannot show. Fields it does not read may hold anything.
NUMBERS = ("loss", "kd", "ce", "eval_kl", "eval_ce", "lr", "grad_norm", "tokens_per_second")
TEXTS = ("event", "store", "teacher", "student")


def _wrong_field(record: dict) -> str | None:
    """What in `record` is not of the type a run writes (None: nothing), in words."""
    step = record.get("step")
    if "step" in record and not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return f"'step' is {quoted(step)}, not a step number"
    for key in NUMBERS:
        value = record.get(key)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return f"{key!r} is {quoted(value)}, not a number"
    for key in TEXTS:
        value = record.get(key)
        if value is not None and not isinstance(value, str):
            return f"{key!r} is {quoted(value)}, not text"
    version = record.get("version")  # a snapshot, or a mix of them: {snapshot: weight} (`--version-weight`)
    if version is not None and not (isinstance(version, str) or _is_mix(version)):
        return f"'version' is {quoted(version)}, not a version or a mix of versions"
    teachers = record.get("teachers")
    if teachers is not None and not (
        isinstance(teachers, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in teachers)
    ):
        return f"'teachers' is {quoted(teachers)}, not a list of teachers with their names"
    return None


def _is_mix(value) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(w, (int, float)) and not isinstance(w, bool) for k, w in value.items()
    )


def plot_metrics(out: Path, *, note: Callable[[str], None] = _stderr_note) -> Path:
    """Write OUT/training.png (`draw_metrics`)."""
    path = out / "training.png"
    replace_file(path, draw_metrics(read_metrics(out, note=note)))
    return path


def run_sections(out: Path, *, note: Callable[[str], None] = _stderr_note) -> list:
    """The run's page: what it trains and where it stands, then its curves."""
    from logitstore.store.report import Section  # with it the codec (numba) and matplotlib: a run page only

    records = read_metrics(out, note=note)
    start = _start(records)
    rows = [r for r in records if "step" in r]
    last = rows[-1] if rows else {}
    evaluated: dict = next((r for r in reversed(rows) if "eval_kl" in r), {})
    table = [
        ["", ""],
        ["run folder", str(out)],
        ["store", str(start.get("store") or "(live teacher)")],
        ["version", str(start.get("version") or "-")],
        ["teachers", _teachers(start)],
        ["student", str(start.get("student", "-"))],
        ["last step logged", str(last.get("step", "-"))],
        ["loss at that step", _number(last.get("loss"))],
        ["held-out KL to the teacher (last evaluation)", _number(evaluated.get("eval_kl"))],
    ]
    return [
        Section("logitstore run report", level=1, table=table),
        Section("Training curves", level=2, image=draw_metrics(records)),
    ]


def _start(records: list[dict]) -> dict:
    """The last start record (a resumed run logs one more)."""
    return next((r for r in reversed(records) if r.get("event") == "start"), {})


def _teachers(start: dict) -> str:
    return ", ".join(t["name"] for t in start.get("teachers") or []) or start.get("teacher") or "-"


def _number(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def draw_metrics(records: list[dict]) -> bytes:
    """The curves as a PNG: the loss parts with the held-out KL and CE at every evaluation, the learning
    rate, the gradient norm and the throughput per step, titled with the run's store, version, teacher
    and student (from the start record)."""
    # Here, not at the top: 0.5 s at the start of every rank (train.py imports this module) for one plot
    # that rank 0 draws at the end. Figure, not pyplot: no global backend for the program drawing it.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in records if "step" in r]
    start = _start(records)
    fig = Figure(figsize=FIGURE_SIZE)
    (ax_loss, ax_lr), (ax_grad, ax_speed) = fig.subplots(2, 2)
    curves = (("loss", "loss (train)"), ("kd", "KD (train)"), ("ce", "CE (train)"))
    for key, label in curves:
        if key == "kd" and all(r.get("kd") == r.get("loss") for r in rows):
            continue  # alpha = 0: the loss is the KD term, one line says it
        _line(ax_loss, rows, key, label=label)
    for key, label in (("eval_kl", "KL to teacher (held-out)"), ("eval_ce", "CE (held-out)")):
        _line(ax_loss, rows, key, label=label, marker="o")  # every evaluation, joined
    ax_loss.set(xlabel="step", ylabel="nats per token", title="distillation loss")
    ax_loss.legend(fontsize="small")
    _line(ax_lr, rows, "lr")
    ax_lr.set(xlabel="step", ylabel="learning rate", title="learning rate")
    _line(ax_grad, rows, "grad_norm")
    ax_grad.set(xlabel="step", ylabel="L2 norm (before clipping)", title="gradient norm")
    _line(ax_speed, rows, "tokens_per_second")
    ax_speed.set(xlabel="step", ylabel="tokens/s", title="throughput (all ranks)")
    for ax in (ax_loss, ax_lr, ax_grad, ax_speed):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    fig.suptitle(_title(start))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _line(ax, rows: list[dict], key: str, *, label: str | None = None, marker: str | None = None) -> None:
    points = [(r["step"], r[key]) for r in rows if key in r]
    if points:
        ax.plot(*zip(*points), label=label, marker=marker, markersize=4)


def _title(start: dict) -> str:
    """store, version, teacher(s), student: what the curves are of."""
    return (
        f"store {start.get('store') or '(live)'} @ {start.get('version') or '-'}  |  teacher {_teachers(start)}  |  "
        f"student {start.get('student', '-')}"
    )
