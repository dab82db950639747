"""One rank of the multi-node recipe's test (tests/test_multinode.py), started by `torchrun`: joins the
gloo process group torchrun's rendezvous set up, reads `STEPS` batches of `logitstore.stream` (rank,
world size and so the default reader groups from torch.distributed), sums the ranks' part reads over
the group (the cluster's read counter) and writes its rows and the counter to OUT/rank-R.json.

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID tests/multinode_stream.py STORE OUT STEPS SEQ MB
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import logitstore
from logitstore.testing.streams import rows_of


def main(store: str, out: str, steps: int, seq_len: int, micro_batch: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    view = logitstore.open(store)
    # seed 1 and the eval fraction: logitstore.testing.streams' `stream`, which gives the single-process reference
    with logitstore.stream(view, seq_len=seq_len, micro_batch=micro_batch, seed=1, prefetch=0) as s:
        rows = []
        for batch in s:
            rows.append(rows_of(batch))
            if len(rows) == steps:
                break
        reads = torch.tensor([s.part_reads], dtype=torch.int64)
        state = s.state_dict()
    dist.all_reduce(reads)  # the cluster's read counter: parts fetched by every rank
    record = {"rank": rank, "world_size": dist.get_world_size(), "rows": rows, "cluster_part_reads": int(reads)}
    Path(out, f"rank-{rank}.json").write_text(json.dumps({**record, "state": state}))
    dist.destroy_process_group()


if __name__ == "__main__":
    store, out, steps, seq_len, micro_batch = sys.argv[1:6]
    main(store, out, int(steps), int(seq_len), int(micro_batch))
