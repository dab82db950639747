"""`benchmarks/frontier.py --smoke`: the frontier benchmark keeps working end to end (real builds of the
default teacher, real training, dense evaluation), on a tiny budget."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).parents[1] / "benchmarks" / "frontier.py"


@pytest.mark.slow
def test_frontier_smoke_writes_table_plot_and_sane_numbers(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "frontier.json").read_text())["rows"]
    by_name = {r["variant"]: r for r in rows}
    assert list(by_name) == ["dense (online)", "top-64 fp16+int32", "top-16", "sampled 8"]
    # Sizes: the baseline format's own bytes, then real stores that shrink with fewer entries.
    assert by_name["top-64 fp16+int32"]["bytes_per_token"] == 64 * 6 + 4
    assert by_name["top-16"]["entries_per_position"] == 16
    assert 0 < by_name["sampled 8"]["entries_per_position"] <= 8
    assert (
        by_name["sampled 8"]["bytes_per_token"]
        < by_name["top-16"]["bytes_per_token"]
        < by_name["top-64 fp16+int32"]["store_bytes_per_token"]
    )
    for r in rows:  # every student learned something from its signal in three steps
        assert math.isfinite(r["held_out_kl"]) and r["held_out_kl"] < r["untrained_kl"], r
        assert math.isfinite(r["held_out_ce"])
    assert all(r["decode_tokens_per_s"] > 0 for r in rows[1:])
    table = (tmp_path / "frontier.md").read_text()
    assert "| top-16 | 16.0 |" in table and "held-out KL" in table
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
