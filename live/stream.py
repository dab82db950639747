"""Live mode's stream: the stream engine (`logitstore/streaming/stream.py`) over a `LiveSource`, the planned
samples of one split whose batches the live teacher computes, so a live run is ordered, split, packed and
resumed exactly as a store run on the same samples.
"""

from __future__ import annotations

import numpy as np

from logitstore.live.teacher import InRankTeacher, LiveSamples, LiveTeacher
from logitstore.streaming.batch import assemble
from logitstore.streaming.order import SplitTable, is_eval_sample
from logitstore.streaming.spec import StreamSpec
from logitstore.streaming.stream import Stream


class LiveSource:
    """Live mode as a source of the stream engine (`logitstore/streaming/stream.py`): the planned samples of one
    split, ordered, packed and sharded as a store's (one window: the global shuffle), and computed
    whole by the teacher process for each micro-batch, then cut into its pieces."""

    def __init__(
        self, samples: LiveSamples, teacher: LiveTeacher | InRankTeacher | None, *, split: str, eval_fraction: float
    ):
        keep = [
            i
            for i, sid in enumerate(samples.sample_ids)  # one step per sample, at start
            if is_eval_sample(sid, eval_fraction=eval_fraction) == (split == "eval")
        ]
        self.teacher, self.teacher_name, self.version = teacher, samples.teacher_name, samples.fingerprint
        self.table = SplitTable(
            sample_ids=[samples.sample_ids[i] for i in keep],
            n_tokens=samples.n_tokens[keep],
            part=np.zeros(len(keep), dtype=np.int64),
            parts=["live"],
        )
        self._tokens = [samples.tokens[i] for i in keep]
        self.where = f"the {split} split of live teacher {samples.teacher_name!r}"

    def part_bytes(self) -> None:
        return None  # nothing to read: the teacher computes every batch

    def read_part(self, code: int) -> None:
        raise AssertionError("a live source has no parts to read")

    def build(self, pieces, parts: dict, *, stream):
        assert self.teacher is not None, "a live stream without its teacher only checks sizes (`check_streams`)"
        rows, where = np.unique(pieces.row, return_inverse=True)
        assert self.teacher is not None, "a live stream without its teacher is for checks only"
        whole = self.teacher.compute([self._tokens[r] for r in rows], names=[self.table.sample_ids[r] for r in rows])
        decoded = whole.cut(where.reshape(-1), pieces.a, pieces.b)
        return assemble(
            pieces,
            np.ones(len(pieces.row), bool),
            decoded,
            teacher=self.teacher_name,
            sample_ids=self.table.sample_ids,
            micro_batch=stream.micro_batch,
            seq_len=stream.seq_len,
            sampled=decoded.entry_counts is not None,
        )


def live_stream(samples: LiveSamples, teacher: LiveTeacher | InRankTeacher | None, spec: StreamSpec) -> Stream:
    """The stream engine over live mode: same order, packing, sharding and resume state as a store run
    on the same samples, batches from the live teacher (`spec.teacher`, `memory_budget`, `on_error` and
    `train_on` do not apply: nothing is read, and the teacher computes what it is asked)."""
    return Stream(LiveSource(samples, teacher, split=spec.split, eval_fraction=spec.eval_fraction), spec)
