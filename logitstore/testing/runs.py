"""Training runs on CPU as the tests start them: the settings they share, and the step lines a run's
metrics.jsonl holds."""

from __future__ import annotations

import json
from pathlib import Path

COMMON = dict(seq_len=64, micro_batch=2, warmup_steps=2, lr=5e-3, eval_fraction=0.2)


def metrics(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r]
