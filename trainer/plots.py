"""Training curves as a PNG beside metrics.jsonl, for people who would rather look than parse; drawn at
the end of a run, and any time by `logitstore report OUT`."""

from __future__ import annotations

import json
from pathlib import Path

FIGURE_SIZE = (12.0, 7.0)  # inches at DPI 100: 1200 x 700 pixels
DPI = 100


def plot_metrics(out: Path) -> Path:
    """Write OUT/training.png: the loss parts with the held-out KL and CE at every evaluation, the learning
    rate, the gradient norm and the throughput per step, titled with the run's store, version, teacher
    and student (from metrics.jsonl's start record)."""
    # Here, not at the top: 0.5 s at the start of every rank (train.py imports this module) for one plot
    # that rank 0 draws at the end. Figure, not pyplot: no global backend for the program drawing it.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in records if "step" in r]
    start: dict = next((r for r in reversed(records) if r.get("event") == "start"), {})
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
    path = out / "training.png"
    fig.savefig(path, dpi=DPI)
    return path


def _line(ax, rows: list[dict], key: str, *, label: str | None = None, marker: str | None = None) -> None:
    points = [(r["step"], r[key]) for r in rows if key in r]
    if points:
        ax.plot(*zip(*points), label=label, marker=marker, markersize=4)


def _title(start: dict) -> str:
    """store, version, teacher(s), student: what the curves are of."""
    teachers = ", ".join(t["name"] for t in start.get("teachers") or []) or start.get("teacher") or "-"
    return (
        f"store {start.get('store') or '(live)'} @ {start.get('version') or '-'}  |  teacher {teachers}  |  "
        f"student {start.get('student', '-')}"
    )
