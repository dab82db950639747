"""Where the segments of a packed micro-batch lie, planned once when the stream packs it (`SegmentPlan`).

A packed row holds several segments (samples, or fragments of one cut at a row boundary); position ids
restart at 0 at each, and a token attends only to the tokens before it in its own segment. The
attention (`logitstore/trainer/attention.py`) reads the plan in two forms, both from the same starts:

  varlen    `cu_seqlens` (int32, the segments' starts in the flattened [B * L] tokens, then B * L) and
            `max_seqlen`: what a variable-length kernel takes (CUDA's flash `varlen_attn`)
  buckets   segments of similar length batched together for `scaled_dot_product_attention`: lengths
            bucketed by powers of two, narrow buckets merged into wider ones while the padded slots
            stay within twice the tokens (`merged_buckets`), each padded to its longest segment (one
            call per bucket, at most log2(L) + 1 per layer, often one); `index[i]`
            [n_i, w_i] gathers bucket i's slots from the flat tokens (padded slots take token 0, after
            each segment's real tokens, so the causal mask keeps real queries off them), and `back` [B * L]
            is each token's slot in the buckets' outputs concatenated in bucket order

Both are index tensors of fixed shapes computed on the host with numpy, so neither the forward nor the
backward of the attention has a boolean mask or a shape that depends on the data on the device, and the
step reads nothing back from it. A padding token (position id 0, document id -1) is a segment of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SegmentPlan:
    """The segments of one [B, L] micro-batch (see the module's docstring)."""

    cu_seqlens: torch.Tensor  # [S + 1] int32
    max_seqlen: int
    index: list[torch.Tensor]  # per length bucket, [n_i, w_i] int64
    back: torch.Tensor  # [B * L] int64

    @property
    def n_segments(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    def to(self, device, *, non_blocking: bool = False) -> SegmentPlan:
        move = lambda t: t.to(device, non_blocking=non_blocking)
        return SegmentPlan(
            cu_seqlens=move(self.cu_seqlens),
            max_seqlen=self.max_seqlen,
            index=[move(t) for t in self.index],
            back=move(self.back),
        )


def plan_segments(position_ids: torch.Tensor | np.ndarray) -> SegmentPlan:
    """The plan of a [B, L] batch whose segments start where the position id is 0 (every row starts one).
    Host work, numpy; one step per length bucket."""
    pos = np.asarray(position_ids.detach().cpu() if isinstance(position_ids, torch.Tensor) else position_ids)
    B, L = pos.shape
    pos = pos.reshape(-1)
    starts = np.flatnonzero(pos == 0)
    assert np.all(np.isin(np.arange(0, B * L, L), starts)), "every row must start a segment (position id 0)"
    lengths = np.diff(np.append(starts, B * L))
    bucket = merged_buckets(lengths)
    index = []
    back = np.empty(B * L, dtype=np.int64)
    offset = 0  # where this bucket's slots begin in the concatenated outputs
    for b in np.unique(bucket).tolist():  # one step per length bucket: at most log2(L) + 1
        chosen = np.flatnonzero(bucket == b)
        width = int(lengths[chosen].max())
        slots = np.arange(width)
        real = slots[None, :] < lengths[chosen][:, None]
        tokens = starts[chosen][:, None] + slots[None, :]
        index.append(torch.from_numpy(np.where(real, tokens, 0)))
        back[tokens[real]] = offset + np.flatnonzero(real.reshape(-1))
        offset += real.size
    cu_seqlens = np.append(starts, B * L).astype(np.int32)
    return SegmentPlan(
        cu_seqlens=torch.from_numpy(cu_seqlens),
        max_seqlen=int(lengths.max()),
        index=index,
        back=torch.from_numpy(back),
    )


def merged_buckets(lengths: np.ndarray) -> np.ndarray:
    """Each segment's bucket: its length's power of two, then the narrowest bucket merged into the next
    wider one as long as every bucket's padded slots stay within twice the tokens (the bound the powers
    of two keep): each bucket is a kernel call forward and backward in every layer, and rows of one
    long segment with a few shorter ones need one call, not three."""
    bucket = np.ceil(np.log2(lengths)).astype(np.int64)
    widths = {int(b): int(lengths[bucket == b].max()) for b in np.unique(bucket)}
    counts = {b: int((bucket == b).sum()) for b in widths}
    slots = sum(counts[b] * widths[b] for b in widths)
    order = sorted(widths)
    for narrow, wide in zip(order, order[1:]):  # at most log2(L) merges
        grown = slots + counts[narrow] * (widths[wide] - widths[narrow])
        if grown > 2 * int(lengths.sum()):
            break
        bucket[bucket == narrow] = wide
        counts[wide] += counts.pop(narrow)
        slots = grown
    return bucket
