"""Distributed checkpoints in `OUT/step-N/`, counted only when complete.

Model and optimizer go through torch.distributed.checkpoint (each rank writes its shards; loading
reshards, so a run can resume on another process count). The rest of the run state (step, scheduler,
data position, RNG) is small and identical on every rank: rank 0 writes it as `train_state.json`.
A checkpoint is written to `step-N.partial/` and renamed to `step-N/` by rank 0 after every rank has
finished, so a kill mid-save leaves a `.partial` folder that resuming ignores. `train_state.json` also
names the store snapshot the run reads, so a resumed run reads it whatever the branch says now.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

STEP_DIR = re.compile(r"step-(\d+)$")


def save(out: Path, *, step: int, model, optimizer, train_state: dict) -> Path:
    final = out / f"step-{step}"
    partial = out / f"step-{step}.partial"
    if dist.get_rank() == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    if dist.get_rank() == 0:
        (partial / "train_state.json").write_text(json.dumps(train_state))
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():  # a leftover that latest() skipped, or this step's state saved again: replaced whole
            shutil.rmtree(final)
        partial.rename(final)
    dist.barrier()
    return final


def step_of(path: Path) -> int:
    match = STEP_DIR.search(path.name)
    assert match is not None, path  # only called on checkpoint folders, which `latest` picks by this pattern
    return int(match.group(1))


def latest(out: Path) -> Path | None:
    """The newest complete checkpoint: renamed from .partial and holding both metadata files."""
    complete = [
        p
        for p in out.glob("step-*")
        if STEP_DIR.search(p.name) and (p / ".metadata").is_file() and (p / "train_state.json").is_file()
    ]
    return max(complete, key=step_of, default=None)


def train_state(path: Path) -> dict:
    """A complete checkpoint's `train_state.json`: step, data position, RNG, store snapshot."""
    return json.loads((path / "train_state.json").read_text())


def load(path: Path, *, model, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}  # dcp's state dict type, loaded in place
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return train_state(path)
