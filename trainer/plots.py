"""Training curves as a PNG beside metrics.jsonl, for people who would rather look than parse."""

from __future__ import annotations

import json
from pathlib import Path


def plot_metrics(out: Path) -> Path:
    """Write OUT/training.png: loss parts and held-out KL per step, and throughput."""
    # Here, not at the top: 0.5 s at the start of every rank (train.py imports this module) for one plot
    # that rank 0 draws at the end
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt  # after choosing the backend
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r]
    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("loss", "loss (train)"), ("kd", "KD (train)"), ("eval_kl", "KL to teacher (held-out)")):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if key == "kd" and all(r.get("kd") == r.get("loss") for r in rows):
            continue  # alpha = 0: the loss is the KD term, one line says it
        if points:
            ax_loss.plot(*zip(*points), marker="o" if key == "eval_kl" else None, label=label)
    ax_loss.set(xlabel="step", ylabel="nats per token", title="distillation loss")
    ax_loss.legend()
    ax_speed.plot([r["step"] for r in rows], [r["tokens_per_second"] for r in rows])
    ax_speed.set(xlabel="step", ylabel="tokens/s", title="throughput (all ranks)")
    for ax in (ax_loss, ax_speed):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    fig.tight_layout()
    path = out / "training.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
