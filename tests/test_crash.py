"""Crashes never corrupt: a writer killed with SIGKILL at any moment leaves the last version whole,
and a damaged chunk is found by `verify` and named by sample."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.store.store import Store
from logitstore.store.verify import verify
from logitstore.testing.stores import write
from logitstore.testing.synthetic import random_samples

WRITER = textwrap.dedent("""
    import sys
    from logitstore.testing.stores import write
    from logitstore.testing.synthetic import random_samples
    from logitstore.store.store import Store
    store = Store.open(sys.argv[1], create=True)
    i = store.read().index.num_rows // 20  # continue after what earlier (killed) runs committed
    while True:  # commit after commit, each adding 20 samples, until killed
        write(store, random_samples([f"s{i}-{j}" for j in range(20)], seed=i, max_tokens=200, k=32))
        print("committed", i, flush=True)
        i += 1
""")


def test_sigkill_mid_write_leaves_last_version_intact(tmp_path):
    uri = str(tmp_path / "store")
    root = Path(__file__).resolve().parents[1]
    for delay in (0.05, 0.3, 0.7):  # kill at different moments: inside a write, an encode, a commit
        child = subprocess.Popen([sys.executable, "-c", WRITER, uri], cwd=root, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().startswith("committed")
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        view = Store.open(uri).read()
        assert view.index.num_rows % 20 == 0 and view.index.num_rows >= 20
        report = verify(view)
        assert report.ok, report.damaged
        for version in Store.open(uri).log()[:3]:
            assert verify(Store.open(uri).read(version.id)).ok


def test_damaged_chunk_is_reported_by_sample(tmp_path):
    uri = str(tmp_path / "store")
    samples = random_samples([f"s{i}" for i in range(30)], max_tokens=400, k=32)
    write(Store.open(uri, create=True), samples)
    chunks = sorted((tmp_path / "store" / "chunks").iterdir(), key=lambda p: p.stat().st_size)
    victim = chunks[-1]
    data = bytearray(victim.read_bytes())
    mid = len(data) // 3
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(data))

    result = CliRunner().invoke(app, ["verify", uri])
    assert result.exit_code == 1
    damaged = [ln.split(": ")[1] for ln in result.stderr.splitlines() if ln.startswith("damaged:")]
    assert damaged and all(d.startswith("teacher-a/s") for d in damaged)
    assert len(damaged) < len(samples)  # one chunk damaged, not every sample
