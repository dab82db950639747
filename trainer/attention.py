"""Attention over packed rows without an L x L mask.

A packed row holds several *segments* (samples, or fragments of one cut at a row boundary); position ids
restart at 0 at each (`logitstore/streaming/stream.py`), and a token may attend only to the tokens before it in its
own segment. The eager path built that as a dense [B, 1, L, L] mask: 256 MB per row at L = 8192 before
attention even starts, and O(L^2) work whatever the segments. Here the segments are cut out of the
flattened [B * L] tokens and attended to on their own with `scaled_dot_product_attention(is_causal=True)`
(the fused flash kernels on CUDA and on CPU), so memory and work grow with the segments' lengths, not
with L: a row of 8192 tokens holding eight 1024-token samples costs eight 1024 x 1024 causal blocks.

Segments of similar length are batched together: lengths are bucketed by powers of two and each bucket
is padded to its longest segment (at most 2x the work of an exact varlen kernel, one SDPA call per
bucket, at most log2(L) + 1 calls per layer). The padded slots sit after each segment's real tokens, so
the causal mask alone keeps real queries off them; their outputs are dropped. A padding token of a
batch (position id 0, document id -1) is a segment of one: it attends to itself, as the eager mask had it.

Why not FlexAttention: on CPU it runs fused only under `torch.compile` (the eager fallback materialises
the full score matrix), which costs a compile per shape; per-segment SDPA needs no compiler and runs on
both devices. Why not Hugging Face's packed `position_ids` path: it exists for `flash_attention_2/3`
only (a CUDA package); for `sdpa` Hugging Face builds the L x L mask from the position ids.

Registered with Hugging Face's `AttentionInterface` as `ATTENTION`, so any student whose attention
goes through that interface (Llama, Qwen2/3, Mistral, SmolLM, ...) uses it; the plan is computed once
per micro-batch (`plan_segments`) and reaches every layer as the `segment_plan` keyword argument.
Sliding-window and soft-capped attention (Gemma 2/3, Mistral's window) are refused: they need more
than causal masking.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from logitstore.errors import LogitstoreError

ATTENTION = "logitstore_segments"


class AttentionError(LogitstoreError):
    """A student whose attention the segment path cannot compute (a sliding window, a soft cap)."""


@dataclass
class SegmentPlan:
    """Where the segments of one micro-batch lie in its flattened [B * L] tokens, by length bucket.
    Bucket i gathers `index[i]` ([n_i, L_i], padded with token 0) and keeps the slots `keep[i]`;
    `inverse` puts the kept outputs, concatenated in bucket order, back in token order."""

    index: list[torch.Tensor]
    keep: list[torch.Tensor]
    inverse: torch.Tensor

    def to(self, device) -> SegmentPlan:
        move = lambda ts: [t.to(device, non_blocking=True) for t in ts]
        return SegmentPlan(
            index=move(self.index), keep=move(self.keep), inverse=self.inverse.to(device, non_blocking=True)
        )


def plan_segments(position_ids: torch.Tensor) -> SegmentPlan:
    """The plan of a [B, L] batch whose segments start where the position id is 0 (every row starts
    one). Computed on the CPU with numpy, one step per length bucket."""
    B, L = position_ids.shape
    pos = position_ids.detach().cpu().numpy().reshape(-1)
    starts = np.flatnonzero(pos == 0)
    assert np.all(np.isin(np.arange(0, B * L, L), starts)), "every row must start a segment (position id 0)"
    lengths = np.diff(np.append(starts, B * L))
    bucket = np.ceil(np.log2(lengths)).astype(np.int64)
    index, keep, order = [], [], []
    for b in np.unique(bucket).tolist():  # one step per length bucket: at most log2(L) + 1
        chosen = np.flatnonzero(bucket == b)
        width = int(lengths[chosen].max())
        offsets = np.arange(width)
        slot_ok = offsets[None, :] < lengths[chosen][:, None]
        idx = np.where(slot_ok, starts[chosen][:, None] + offsets[None, :], 0)
        index.append(torch.from_numpy(idx))
        keep.append(torch.from_numpy(slot_ok))
        order.append(idx[slot_ok])
    inverse = np.empty(B * L, dtype=np.int64)
    inverse[np.concatenate(order)] = np.arange(B * L)
    return SegmentPlan(index=index, keep=keep, inverse=torch.from_numpy(inverse))


def segment_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    segment_plan: SegmentPlan | None = None,
    **kwargs,
):
    """Hugging Face attention interface: query [B, H, L, D], key/value [B, Hkv, L, D] -> ([B, L, H, D],
    None). Causal within each segment of `segment_plan` (without one: within each row); `attention_mask`
    must be None."""
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise AttentionError(
            "this student uses sliding-window or soft-capped attention, which the segment attention does not compute"
        )
    assert attention_mask is None, "the segment attention takes its boundaries from segment_plan, not a mask"
    B, H, L, D = query.shape
    groups = H // key.shape[1]
    if segment_plan is None:  # a plain call (generation, scoring one text): each row is one causal segment
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=L > 1, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    q = query.transpose(1, 2).reshape(B * L, H, D)
    k = key.transpose(1, 2).reshape(B * L, key.shape[1], D)
    v = value.transpose(1, 2).reshape(B * L, value.shape[1], D)
    pieces = []
    for index, keep in zip(segment_plan.index, segment_plan.keep):
        qb, kb, vb = (x[index].transpose(1, 2) for x in (q, k, v))  # [n, heads, width, D]
        if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
            kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, scale=scaling, dropout_p=dropout if module.training else 0.0
        )
        pieces.append(out.transpose(1, 2)[keep])  # [kept slots, H, D]
    out = torch.cat(pieces)[segment_plan.inverse]
    return out.view(B, L, H, D), None


def register() -> None:
    """Make `ATTENTION` a Hugging Face attention implementation (idempotent). Without a mask function
    registered for it, Hugging Face builds no mask and passes None."""
    AttentionInterface.register(ATTENTION, segment_attention)
