"""`logitstore report`: a one-page look inside a store version, per teacher: entries per position, entropy
and tail mass, the stored log-probabilities against the value grid, bytes per token per part, top-1
agreement with the next token, and the samples worth a look (highest tail mass, lowest agreement).

Reads each part whole through the store's reader (`reader.PartReader`: the part's encoded arrays, its
samples checked against the index) and folds it into fixed-bin histograms and per-sample sums with numpy, so memory holds one part and
one number per sample, never a list per token. Writes HTML (one file, pictures inline) or Markdown (the
pictures as PNG files in `<name>_files/` beside it). Draws with matplotlib's `Figure`, not pyplot: no
global backend is chosen for a program that imports this module.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import re
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from logitstore.errors import LogitstoreError
from logitstore.files import replace_file
from logitstore.format import codec
from logitstore.format.codec import EncodedSamples
from logitstore.format.grid import Q_MAX
from logitstore.format.samples import ranges, row_offsets
from logitstore.storage.bounded import read_errors
from logitstore.store.meta import TeacherMeta
from logitstore.store.reader import PartReader, TeacherRows
from logitstore.store.version import StoreVersion

FORMATS = (".html", ".md")
FIGURE_SIZE = (8.0, 3.2)  # inches, at DPI: every picture is 800 x 320 pixels
DPI = 100
TAIL_BINS = np.linspace(0.0, 1.0, 51)
SHOWN_SAMPLES = 10  # rows in each "samples to look at" table


class ReportError(LogitstoreError):
    """`--out` names no format `report` writes."""


@dataclass
class TeacherStats:
    """One teacher's numbers, summed part by part (histograms on fixed bins, sums per sample)."""

    name: str
    meta: TeacherMeta
    sample_ids: list[str]
    sample_tokens: np.ndarray
    entropy_bins: np.ndarray
    entries: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))  # positions per entry count
    entropy: np.ndarray = field(default_factory=lambda: np.zeros(0))  # positions per entropy bin
    tail: np.ndarray = field(default_factory=lambda: np.zeros(len(TAIL_BINS) - 1))
    codes: np.ndarray = field(default_factory=lambda: np.zeros(Q_MAX + 1, np.int64))  # entries per grid code
    parts: list[tuple[str, int, int]] = field(default_factory=list)  # (part, tokens, stored bytes), write order
    damaged: int = 0  # samples left out: they failed the reader's checks (`logitstore verify` names them)
    # per sample: positions with entries, and the sums of their tail, entropy, agreement, target log-prob
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tail_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    entropy_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    agree_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    target_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        n = len(self.sample_ids)
        self.entropy = np.zeros(len(self.entropy_bins) - 1)
        for name in ("positions", "tail_sum", "entropy_sum", "agree_sum", "target_sum"):
            setattr(self, name, np.zeros(n))

    def per_sample(self, sums: np.ndarray) -> np.ndarray:
        """A per-sample sum as a mean over the sample's positions with entries (NaN for none)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return sums / self.positions

    def mean(self, sums: np.ndarray) -> float:
        total = self.positions.sum()
        return float(sums.sum() / total) if total else float("nan")


def teacher_stats(view: StoreVersion, teacher: str) -> TeacherStats:
    """Every part of `teacher` in this version, read whole (`reader.PartReader`) and folded in; samples
    that fail their checks are left out and counted."""
    rows = TeacherRows.of(view, teacher=teacher)
    reader = PartReader(view, teacher=teacher, rows=rows)
    meta = view.teachers[teacher]
    stats = TeacherStats(
        name=teacher,
        meta=meta,
        sample_ids=rows.sample_ids,
        sample_tokens=rows.n_tokens,
        entropy_bins=np.linspace(0.0, np.log(meta.vocab_size), 61),
    )
    for code, part in enumerate(rows.parts):  # part names sort by the time they were written
        data = reader.read(code)
        in_part = rows.in_part(code)
        usable = in_part[~np.isin(in_part, list(data.damaged))]
        stats.damaged += len(in_part) - len(usable)
        with read_errors(f"part {part} of teacher {teacher!r}"):
            attrs = view.part_group(teacher, part).attrs
            stats.parts.append((part, int(cast(int, attrs["tokens"])), int(cast(int, attrs["stored_bytes"]))))
        if len(usable):  # a part whose every sample is damaged (e.g. its object emptied) adds nothing
            _fold_part(stats, data.arrays, view.id_of_code(teacher), rows=usable, table=rows)
    return stats


def _fold_part(
    stats: TeacherStats, arrays: EncodedSamples, id_of_code, *, rows: np.ndarray, table: TeacherRows
) -> None:
    """The positions of `rows` in one part into the teacher's histograms and sums. Only their elements
    are touched, found from the index (a replaced sample stays in its part, unreferenced; a damaged
    one's elements are zeros)."""
    meta = stats.meta
    lengths = table.n_tokens[rows] - 1
    position = ranges(table.position_start[rows], lengths)  # in the part
    row = np.repeat(rows, lengths)
    next_token = arrays.input_ids[ranges(table.token_start[rows] + 1, lengths)]
    n_entries = arrays.n_entries[position].astype(np.int64)
    entry = ranges(table.entry_start[rows], table.n_entries[rows])  # in the part, in position order
    local = np.repeat(np.arange(len(position)), n_entries)  # each entry's place in `position`
    assert len(local) == len(entry), "the reader checked n_entries against the index"
    ids = codec.undelta_codes_to_ids(arrays.entry_codes[entry], row_offsets(n_entries), id_of_code)
    codes = arrays.entry_logprobs[entry]
    logprobs = codec.dequantize(codes, params=meta.codec).astype(np.float64)
    counts = None if arrays.entry_counts is None else arrays.entry_counts[entry]

    entropy = _entropy(logprobs, local, len(position), counts=counts)
    tail = np.exp(codec.dequantize(arrays.tail[position], params=meta.codec).astype(np.float64))
    if not meta.sampled:  # the tail as one more outcome: a lower bound on the teacher's entropy
        with np.errstate(divide="ignore", invalid="ignore"):
            entropy -= np.where(tail > 0, tail * np.log(tail), 0.0)
    # Top-1 agreement, ties on the grid included: the next token's entry holds its position's highest value.
    best = np.full(len(position), -np.inf)
    np.maximum.at(best, local, logprobs)
    hit = (ids == next_token[local]) & (logprobs == best[local])
    agree = np.bincount(local[hit], minlength=len(position)) > 0
    target = codec.dequantize(arrays.target_logprobs[position], params=meta.codec).astype(np.float64)

    has = n_entries > 0  # completion-only chat stores keep no entries for prompt tokens
    n, row = len(stats.sample_ids), row[has]
    stats.positions += np.bincount(row, minlength=n)
    for name, values in (("tail", tail), ("entropy", entropy), ("agree", agree), ("target", target)):
        setattr(stats, f"{name}_sum", getattr(stats, f"{name}_sum") + np.bincount(row, values[has], minlength=n))
    stats.entries = _add(stats.entries, np.bincount(n_entries[has]))
    # a sampled estimate can pass log(vocab) (a rare draw's -log p): the last bin holds it
    stats.entropy += np.histogram(np.minimum(entropy[has], stats.entropy_bins[-1]), bins=stats.entropy_bins)[0]
    stats.tail += np.histogram(tail[has], bins=TAIL_BINS)[0]
    stats.codes += np.bincount(codes, minlength=Q_MAX + 1)


def _entropy(logprobs, position_of_entry, positions: int, *, counts) -> np.ndarray:
    """Per position: over top-k/top-p entries, -sum p log p; over sampled draws, the draws' mean of
    -log p (an unbiased estimate of the full entropy)."""
    if counts is None:
        return np.bincount(position_of_entry, -np.exp(logprobs) * logprobs, minlength=positions)
    counts = counts.astype(np.float64)
    drawn = np.bincount(position_of_entry, counts, minlength=positions)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.bincount(position_of_entry, -counts * logprobs, minlength=positions) / drawn


def _add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two histograms of counts 0, 1, 2, ... of different lengths, summed."""
    out = np.zeros(max(len(a), len(b)), dtype=np.int64)
    out[: len(a)] += a
    out[: len(b)] += b
    return out


# -- pictures ---------------------------------------------------------------------------------------------


def _png(fig: Figure) -> bytes:
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)  # no bbox_inches="tight": every picture keeps FIGURE_SIZE
    return buffer.getvalue()


def _axes(n: int = 1):
    fig = Figure(figsize=FIGURE_SIZE)
    return fig, fig.subplots(1, n, squeeze=False)[0]


def plot_entries(stats: TeacherStats) -> bytes:
    fig, (ax,) = _axes()
    counts = np.arange(len(stats.entries))
    ax.bar(counts, stats.entries, width=1.0, color="tab:blue")
    ax.set(xlabel="entries stored at the position", ylabel="positions", title=f"{stats.name}: entries per position")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _png(fig)


def plot_entropy_and_tail(stats: TeacherStats) -> bytes:
    fig, (left, right) = _axes(2)
    edges = stats.entropy_bins
    left.stairs(stats.entropy, edges, fill=True, color="tab:purple")
    left.axvline(stats.mean(stats.entropy_sum), color="black", linestyle="--", label="mean")
    left.set(xlabel=f"nats: {_entropy_label(stats.meta)}", ylabel="positions", title=f"{stats.name}: entropy")
    left.set_xlim(0, edges[np.flatnonzero(stats.entropy)[-1] + 1] if stats.entropy.any() else edges[-1])
    left.legend()
    right.stairs(stats.tail, TAIL_BINS, fill=True, color="tab:orange")
    if stats.tail.any():  # no position left (every sample damaged): a log axis of nothing only warns
        right.set_yscale("log")
    right.set(xlabel="tail mass (probability not in the entries)", ylabel="positions", title="tail mass")
    return _png(fig)


def plot_grid(stats: TeacherStats) -> bytes:
    """Entries per grid code, at the code's log-probability: where the stored values sit on the grid."""
    fig, (ax,) = _axes()
    params = stats.meta.codec
    used = np.flatnonzero(stats.codes[:Q_MAX])  # Q_MAX: minus infinity, not a point on the axis
    values = codec.dequantize(used.astype(np.uint16), params=params)
    ax.vlines(values, 0.8, stats.codes[used], color="tab:green", linewidth=1)  # from below 1: a log axis
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.8)
    steps = f"{params.fine_step:g}-nat steps above, {params.coarse_step:g} below"
    ax.axvline(params.coarse_below, color="black", linestyle=":", label=steps)
    ax.set(xlabel="stored log-probability (nats)", ylabel="entries", title=f"{stats.name}: values on the grid")
    ax.legend(loc="best")
    return _png(fig)


def plot_part_bytes(stats: TeacherStats) -> bytes:
    fig, (ax,) = _axes()
    per_token = [b / t if t else 0.0 for _, t, b in stats.parts]
    ax.bar(np.arange(len(per_token)), per_token, width=0.8, color="tab:gray")
    ax.set(xlabel="part (in write order)", ylabel="bytes per token", title=f"{stats.name}: stored bytes per token")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _png(fig)


def plot_agreement(stats: TeacherStats) -> bytes:
    """One dot per sample: its mean tail mass against its top-1 agreement; the odd ones stand apart."""
    fig, (ax,) = _axes()
    tail, agree = stats.per_sample(stats.tail_sum), stats.per_sample(stats.agree_sum)
    ax.scatter(tail, agree, s=12, alpha=0.6, color="tab:red")
    ax.set(xlabel="mean tail mass of the sample", ylabel="top-1 agreement", ylim=(-0.05, 1.05))
    ax.set_title(f"{stats.name}: top-1 agreement with the next token, per sample")
    return _png(fig)


def _entropy_label(meta: TeacherMeta) -> str:
    return "mean -log p of the draws" if meta.sampled else "entries + tail bucket, a lower bound"


# -- the document ----------------------------------------------------------------------------------------


@dataclass
class Section:
    title: str
    level: int = 3  # 1: the report, 2: a teacher, 3: a section of a teacher
    text: str = ""
    table: list[list[str]] = field(default_factory=list)  # a header row, then rows
    image: bytes | None = None


def teacher_sections(stats: TeacherStats) -> list[Section]:
    meta = stats.meta
    sparsity = ", ".join(f"{k}={v}" for k, v in meta.sparsity.to_json().items() if k != "mode" and v is not None)
    tokens = sum(t for _, t, _ in stats.parts)
    stored = sum(b for _, _, b in stats.parts)
    mean_entries = float((np.arange(len(stats.entries)) * stats.entries).sum() / max(stats.entries.sum(), 1))
    summary = [
        ["", ""],
        ["sparsity", f"{meta.sparsity.mode} ({sparsity})"],
        ["samples", f"{len(stats.sample_ids):,}"],
        ["samples left out as damaged (see verify)", f"{stats.damaged:,}"],
        ["positions with entries", f"{int(stats.positions.sum()):,}"],
        ["mean entries per position", f"{mean_entries:.1f}"],
        [f"mean entropy ({_entropy_label(meta)})", f"{stats.mean(stats.entropy_sum):.3f} nats"],
        ["mean tail mass", f"{stats.mean(stats.tail_sum):.4f}"],
        ["top-1 agreement with the next token", f"{stats.mean(stats.agree_sum):.1%}"],
        ["teacher cross-entropy on the data", f"{-stats.mean(stats.target_sum):.3f} nats/token"],
        ["stored bytes per token (its parts)", f"{stored / tokens:.1f}" if tokens else "-"],
        [
            "value grid",
            f"{meta.codec.fine_step:g} / {meta.codec.coarse_step:g}-nat steps, split at {meta.codec.coarse_below:g}",
        ],
    ]
    agree = stats.per_sample(stats.agree_sum)
    return [
        Section(f"Teacher {stats.name}", level=2, table=summary),
        Section("Entries per position", image=plot_entries(stats)),
        Section("Entropy and tail mass", image=plot_entropy_and_tail(stats)),
        Section(
            "Stored log-probabilities against the value grid",
            text=f"Entries per grid code; {int(stats.codes[Q_MAX]):,} entries hold minus infinity.",
            image=plot_grid(stats),
        ),
        Section("Bytes per token per part", text=f"{len(stats.parts)} parts.", image=plot_part_bytes(stats)),
        Section(
            "Top-1 agreement with the next token",
            text=(
                f"The next token is the teacher's most likely stored entry at {stats.mean(stats.agree_sum):.1%} of "
                f"positions (ties on the value grid count); per sample from {np.nanmin(agree):.1%} to "
                f"{np.nanmax(agree):.1%}."
            )
            if stats.positions.any()
            else "No positions with entries.",
            image=plot_agreement(stats),
        ),
        Section("Samples with the highest tail mass", table=_sample_table(stats, stats.tail_sum, highest=True)),
        Section("Samples with the lowest top-1 agreement", table=_sample_table(stats, stats.agree_sum, highest=False)),
    ]


def _sample_table(stats: TeacherStats, sums: np.ndarray, *, highest: bool) -> list[list[str]]:
    values = stats.per_sample(sums)
    has = np.flatnonzero(stats.positions > 0)
    order = has[np.argsort(-values[has] if highest else values[has], kind="stable")][:SHOWN_SAMPLES]
    tail, agree, entropy = (stats.per_sample(s) for s in (stats.tail_sum, stats.agree_sum, stats.entropy_sum))
    rows = [["sample id", "tokens", "mean tail mass", "top-1 agreement", "mean entropy"]]
    for i in order.tolist():
        row = [stats.sample_ids[i], f"{stats.sample_tokens[i]:,}", f"{tail[i]:.4f}", f"{agree[i]:.1%}"]
        rows.append([*row, f"{entropy[i]:.3f}"])
    return rows


def check_out(out: Path) -> Path:
    """`out` if it names a format `write_page` writes and a place it can be written: checked before a
    store is read, so a refusal costs nothing."""
    if out.suffix not in FORMATS:
        raise ReportError(f"--out {out}: name a .html or .md file")
    if out.is_dir():
        raise ReportError(f"--out {out} is a folder; name a .html or .md file")
    folder = pictures_folder(out)
    if out.suffix == ".md" and folder.is_symlink():  # never followed: its pictures are removed there later
        raise ReportError(f"--out {out}: {folder} is a symbolic link; the pictures go into a folder of their own")
    if out.suffix == ".md" and folder.exists() and not folder.is_dir():
        raise ReportError(f"--out {out}: {folder} is a file; the pictures go into a folder of that name")
    at = next(p for p in out.parents if p.exists())
    if not at.is_dir():
        raise ReportError(f"--out {out} lies under {at}, which is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=at):  # os.access misses read-only mounts for root
            pass
    except OSError as e:
        raise ReportError(f"--out {out} cannot be written in {at}: {e.strerror or e}") from None
    return out


def write_report(view: StoreVersion, out: Path, *, store: str) -> Path:
    """The report of `view` as `out` (.html or .md); returns its path."""
    info = view.info()
    bpt = info["bytes_per_token"]
    head = Section(
        "logitstore report",
        level=1,
        table=[
            ["", ""],
            ["store", store],
            ["version", view.snapshot_id],
            ["samples", f"{info['samples']:,}"],
            ["tokens", f"{info['tokens']:,}"],
            ["stored", f"{info['stored_bytes']:,} bytes ({'-' if bpt is None else f'{bpt:.1f}'} bytes/token)"],
            ["teachers", ", ".join(sorted(view.teachers)) or "none"],
        ],
    )
    sections = [head]
    for name in sorted(view.teachers):
        sections += teacher_sections(teacher_stats(view, name))
    return write_page(sections, out)


def write_page(sections: list[Section], out: Path) -> Path:
    """`sections` as the page `out`: .html, one file with the pictures inline, or .md with its pictures in
    `<name>_files/` beside it (`pictures_folder`). Either replaces what an earlier report left there whole:
    the page is renamed into place, and the pictures, named by their content, are written before it and the
    old ones removed after it. The folder's `MANIFEST` lists the pictures reports wrote there, written before
    any picture and after the removals, so a crash at any point leaves a page whose pictures are all there
    and every picture written listed (the next report removes those it does not show). Only those are
    ever removed (`_remove_picture`): whatever else the folder holds is the user's."""
    check_out(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".html":
            replace_file(out, _html(sections).encode())
            return out
        folder = pictures_folder(out)
        text, pictures = _markdown(sections, folder.name)
        folder.mkdir(exist_ok=True)
        earlier = _written_before(folder)
        _write_manifest(folder, earlier | pictures.keys())
        for name, image in pictures.items():
            replace_file(folder / name, image)
        replace_file(out, text.encode())
        for name in earlier - pictures.keys():
            _remove_picture(folder / name)
        _write_manifest(folder, set(pictures))
    except OSError as e:
        raise ReportError(f"--out {out} cannot be written: {e.strerror or e}") from None
    return out


MANIFEST = ".logitstore-report"  # in a Markdown page's pictures folder: the pictures reports wrote there
PICTURE = re.compile(r"(\d{2,})-([0-9a-f]{12})\.png")  # `_markdown`'s names: the section, then the content's hash


def pictures_folder(out: Path) -> Path:
    return out.with_name(f"{out.stem}_files")


def _written_before(folder: Path) -> set[str]:
    """The pictures `MANIFEST` lists: names as `_markdown` makes them, nothing else (a path is no picture)."""
    try:
        lines = (folder / MANIFEST).read_text().splitlines()
    except FileNotFoundError:
        return set()
    return {name for name in lines if PICTURE.fullmatch(name)}


def _write_manifest(folder: Path, names: set[str]) -> None:
    replace_file(folder / MANIFEST, "".join(f"{name}\n" for name in sorted(names)).encode())


def _remove_picture(path: Path) -> None:
    """`path`, a picture a report wrote, if it still is one: a plain file (no link, no folder) whose bytes
    hash to its name. A file the user put there since, or changed, stays."""
    found = PICTURE.fullmatch(path.name)
    assert found is not None, path
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return
        if hashlib.sha256(path.read_bytes()).hexdigest()[:12] == found.group(2):
            path.unlink()
    except FileNotFoundError:
        return


def _html(sections: list[Section]) -> str:
    body = []
    for s in sections:
        body.append(f"<h{s.level}>{html.escape(s.title)}</h{s.level}>")
        if s.text:
            body.append(f"<p>{html.escape(s.text)}</p>")
        if s.table:
            cells = lambda row, tag: "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row)
            rows = "".join(f"<tr>{cells(r, 'td')}</tr>" for r in s.table[1:])
            body.append(f"<table><tr>{cells(s.table[0], 'th')}</tr>{rows}</table>")
        if s.image is not None:
            data = base64.b64encode(s.image).decode("ascii")
            body.append(f'<img alt="{html.escape(s.title)}" src="data:image/png;base64,{data}">')
    style = "body{font-family:sans-serif;max-width:60em;margin:2em auto}td,th{padding:.2em .8em;text-align:left}"
    return f"<!doctype html><html><head><meta charset='utf-8'><title>logitstore report</title><style>{style}</style></head><body>\n{chr(10).join(body)}\n</body></html>\n"


def _markdown(sections: list[Section], folder: str) -> tuple[str, dict[str, bytes]]:
    """The Markdown page and its pictures by file name (in `folder`, beside the page)."""
    lines: list[str] = []
    pictures: dict[str, bytes] = {}
    for number, s in enumerate(sections):
        lines += [f"{'#' * s.level} {s.title}", ""]
        if s.text:
            lines += [s.text, ""]
        if s.table:
            lines += ["| " + " | ".join(s.table[0]) + " |", "|" + "---|" * len(s.table[0])]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in s.table[1:]]
            lines.append("")
        if s.image is not None:
            # in the order of the sections, and by content: a new report never overwrites a picture the
            # old page still shows
            name = f"{number:02d}-{hashlib.sha256(s.image).hexdigest()[:12]}.png"
            pictures[name] = s.image
            lines += [f"![{s.title}]({folder}/{name})", ""]
    return "\n".join(lines), pictures
