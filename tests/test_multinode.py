"""The multi-node recipe of docs/train.md ("Many nodes, one store"), run on this machine as 2 nodes x 2
processes: two `torchrun` invocations (gloo, c10d rendezvous on loopback) over one local store. The four
ranks' batches together are exactly one process's batches of the same steps, and the ranks together
fetch each part about once."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from logitstore.testing.runs import COMMON, metrics
from logitstore.testing.streams import build_store, rows_of, stream, take

SCRIPT = Path(__file__).with_name("multinode_stream.py")
SEQ, MB = 32, 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # ~55 s on 2 cores: 2 launchers and 4 ranks, each importing torch
def test_two_nodes_of_two_processes_read_the_single_process_batches_once(tmp_path):
    view = build_store(str(tmp_path / "store"), n=120, parts=40, max_tokens=70)
    one = stream(view, micro_batch=4 * MB, reader_groups=4, prefetch=0)  # the cluster's 4 groups, 1 process
    steps = one.steps_per_epoch
    reference = [rows_of(b) for b in take(one, steps)]
    out = tmp_path / "out"
    out.mkdir()
    two_nodes(str(SCRIPT), str(tmp_path / "store"), str(out), str(steps), str(SEQ), str(MB), timeout=240)
    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank-*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and {r["world_size"] for r in ranks} == {4}
    together = [[row for r in ranks for row in r["rows"][i]] for i in range(steps)]
    assert together == json.loads(json.dumps(reference))  # the same rows, in rank order, at every step
    assert {r["state"]["reader_groups"] for r in ranks} == {4}
    n_parts = len(one.table.parts)
    assert ranks[0]["cluster_part_reads"] <= 1.3 * n_parts  # the epoch's parts, about once in total


def two_nodes(*args: str, timeout: float) -> None:
    """Both nodes of the recipe at once on this machine (one rendezvous on loopback), each running `args`;
    both must exit 0."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    nodes = [
        subprocess.Popen(torchrun(endpoint, run_id, *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    logs = [node.communicate(timeout=timeout)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(logs)[-4000:]


def torchrun(endpoint: str, run_id: str, *args: str) -> list[str]:
    """One node's launcher of the recipe: 2 processes, c10d rendezvous at `endpoint`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        *args,
    ]


@pytest.mark.slow  # ~2-3 min on 2 cores: a store from the default teacher, 4 ranks training and 1 process
def test_the_recipe_trains_on_two_nodes_as_one_process_does(train_store, tmp_path):  # noqa: F811 - the fixture
    """docs/train.md's recipe itself: `logitstore train` under two torchrun invocations (2 nodes x 2
    processes, one store, one run folder) takes the same first step as one process with the same reader
    groups and the four ranks' micro-batches in one."""
    store = train_store
    args = ["--seq-len", str(COMMON["seq_len"]), "--warmup-steps", "2", "--lr", "5e-3", "--eval-fraction", "0.2"]
    cluster = [*args, "--store", store, "--out", str(tmp_path / "cluster"), "--steps", "1", "--micro-batch", "2"]
    two_nodes("-m", "logitstore.cli.app", "train", *cluster, timeout=400)
    one = [*args, "--store", store, "--out", str(tmp_path / "one"), "--steps", "1", "--micro-batch", "8"]
    single = subprocess.run(
        [sys.executable, "-m", "logitstore.cli.app", "train", *one, "--reader-groups", "4"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    first = metrics(tmp_path / "cluster")[0]
    assert first["loss"] == pytest.approx(metrics(tmp_path / "one")[0]["loss"], rel=1e-4)
    assert first["tokens"] == metrics(tmp_path / "one")[0]["tokens"]
