"""Attention over packed rows without an L x L mask.

A packed row holds several *segments* (samples, or fragments of one cut at a row boundary); a token may
attend only to the tokens before it in its own segment. The eager path built that as a dense [B, 1, L, L]
mask: 256 MB per row at L = 8192 before attention even starts, and O(L^2) work whatever the segments.
Here the segments are attended to on their own, so memory and work grow with the segments' lengths, not
with L: a row of 8192 tokens holding eight 1024-token samples costs eight 1024 x 1024 causal blocks.
Where the segments lie is planned by the stream when it packs the batch
(`logitstore/streaming/segments.py`, `batch.segment_plan`), never in the step.

Two kernels, one chosen per call by `packed_attention(device, dtype)`, and logged once:

  varlen     CUDA in bf16 or fp16, where torch has `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10):
             flash attention over the flattened [B * L] tokens cut at `cu_seqlens`, causal within each
             segment. One kernel per layer, no gather, no boolean mask and no shape that depends on the
             data, forward or backward.
  segments   everywhere else (the CPU, fp32 on CUDA, an older torch): `scaled_dot_product_attention(
             is_causal=True)` (the fused flash kernels on CUDA and on CPU) once per length bucket of the
             plan, the segments gathered by index tensors of fixed shapes (at most 2x the work of varlen).

A padding token of a batch (position id 0, document id -1) is a segment of one: it attends to itself, as
the eager mask had it. Grouped-query attention goes to the kernels as it is (`enable_gqa`), or with its
key/value heads repeated where varlen_attn does not take it (torch 2.10, 2.11).

Why not FlexAttention: on CPU it runs fused only under `torch.compile` (the eager fallback materialises
the full score matrix), which costs a compile per shape. Why not Hugging Face's packed `position_ids`
path: it exists for `flash_attention_2/3` only (a CUDA package); for `sdpa` Hugging Face builds the
L x L mask from the position ids.

Registered with Hugging Face's `AttentionInterface` as `ATTENTION`, so any student whose attention goes
through that interface (Llama, Qwen2/3, Mistral, SmolLM, ...) uses it; the plan reaches every layer as
the `segment_plan` keyword argument. Sliding-window and soft-capped attention (Gemma 2/3, Mistral's
window) are refused: they need more than causal masking.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from logitstore.errors import LogitstoreError
from logitstore.streaming.segments import SegmentPlan, plan_segments

varlen_attn: Callable | None
try:  # torch >= 2.10, and only CUDA builds can run it
    from torch.nn.attention import varlen

    varlen_attn = varlen.varlen_attn
except ImportError:
    varlen_attn = None

ATTENTION = "logitstore_segments"
VARLEN, SEGMENTS = "varlen", "segments"  # the two kernels (`packed_attention`)
VARLEN_DTYPES = (torch.bfloat16, torch.float16)  # flash attention's

log = logging.getLogger(__name__)
_logged: set[str] = set()

__all__ = ["ATTENTION", "AttentionError", "SegmentPlan", "packed_attention", "plan_segments", "segment_attention"]


class AttentionError(LogitstoreError):
    """A student whose attention the segment path cannot compute (a sliding window, a soft cap)."""


def packed_attention(device: torch.device | str, dtype: torch.dtype, *, varlen=varlen_attn) -> str:
    """The kernel for packed rows on `device` in `dtype`: `VARLEN` or `SEGMENTS` (see the module)."""
    cuda = torch.device(device).type == "cuda"
    return VARLEN if varlen is not None and cuda and dtype in VARLEN_DTYPES else SEGMENTS


def describe(kernel: str) -> str:
    """One line for the log: which kernel computes attention over packed rows."""
    if kernel == VARLEN:
        return "attention over packed rows: varlen_attn (flash attention, cut at the segments)"
    return "attention over packed rows: scaled_dot_product_attention per length bucket of segments"


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
    gqa = H != key.shape[1]
    if segment_plan is None:  # a plain call (generation, scoring one text): each row is one causal segment
        out = F.scaled_dot_product_attention(query, key, value, is_causal=L > 1, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    p = dropout if module.training else 0.0
    kernel = packed_attention(query.device, query.dtype)
    if kernel == VARLEN and p > 0:  # varlen_attn has no dropout
        kernel = SEGMENTS
    _log_once(kernel)
    # [B * L, heads, D]: query, key and value heads side by side, so each bucket gathers them at once
    qkv = torch.cat([query, key, value], dim=1).transpose(1, 2).reshape(B * L, -1, D)
    split = (H, key.shape[1], value.shape[1])
    if kernel == VARLEN:  # each of query, key and value dense: flash attention's layout, whatever its strides
        q, k, v = (x.contiguous() for x in qkv.split(split, dim=1))
        out = varlen_segments(q, k, v, segment_plan, scale=scaling)
    else:
        out = bucketed_segments(qkv, segment_plan, split=split, scale=scaling, dropout=p)
    return out.view(B, L, H, D), None


def varlen_segments(q, k, v, plan: SegmentPlan, *, scale: float | None, kernel=None):
    """[T, H, D] attention of the flat tokens, causal within each segment of `plan`, by `varlen_attn`
    (`kernel`: one with its signature, for the tests on the CPU)."""
    kernel = kernel or varlen_attn
    assert kernel is not None  # chosen only where torch has it (`packed_attention`)
    parameters = _parameters(kernel)
    options: dict = {"scale": scale} if "scale" in parameters else {}
    # torch 2.10 says is_causal; later ones a window, (-1, 0) being causal
    options.update({"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True})
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" in parameters:
        options["enable_gqa"] = True
    elif groups > 1:  # key/value head j serves query heads j * groups ... (j + 1) * groups - 1
        T, heads, D = k.shape
        k, v = (x[:, :, None].expand(T, heads, groups, D).reshape(T, heads * groups, D) for x in (k, v))
    n = plan.max_seqlen
    return kernel(q, k, v, plan.cu_seqlens, plan.cu_seqlens, n, n, **options)


def bucketed_segments(
    qkv, plan: SegmentPlan, *, split: tuple[int, int, int], scale: float | None, dropout: float = 0.0
):
    """[T, H, D] attention of the flat tokens, causal within each segment of `plan`, one
    `scaled_dot_product_attention` per length bucket. `qkv` [T, H + 2 Hkv, D]: the query, key and value
    heads side by side (`split`: how many of each)."""
    H, D = split[0], qkv.shape[-1]
    gqa = split[0] != split[1]
    pieces = []
    for index in plan.index:  # [n, width]: each bucket's segments, padded
        qb, kb, vb = qkv[index].transpose(1, 2).split(split, dim=1)  # [n, heads, width, D] each
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=gqa)
        pieces.append(out.transpose(1, 2).reshape(-1, H, D))  # [n * width, H, D], padded slots included
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces))[plan.back]


@functools.cache
def _parameters(kernel) -> frozenset[str]:
    return frozenset(inspect.signature(kernel).parameters)


def _log_once(kernel: str) -> None:
    if kernel not in _logged:
        _logged.add(kernel)
        log.info(describe(kernel))


def register() -> None:
    """Make `ATTENTION` a Hugging Face attention implementation (idempotent). Without a mask function
    registered for it, Hugging Face builds no mask and passes None."""
    AttentionInterface.register(ATTENTION, segment_attention)
