"""The segment attention (trainer/attention.py) against the eager block-causal mask it replaces."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from logitstore.streaming.batch import PackedBatch
from logitstore.streaming.spec import StreamSpec
from logitstore.streaming.stream import store_stream
from logitstore.testing.stores import trainer_view
from logitstore.trainer.attention import (
    ATTENTION,
    SEGMENTS,
    VARLEN,
    AttentionError,
    bucketed_segments,
    packed_attention,
    plan_segments,
    register,
    segment_attention,
    varlen_segments,
)


def packed(lengths_per_row: list[list[int]], *, vocab: int, seed: int = 0):
    """input_ids, position_ids and document_ids of rows holding segments of the given lengths; a
    negative length is that many padding tokens (document id -1, position id 0)."""
    rng = np.random.default_rng(seed)
    L = sum(abs(n) for n in lengths_per_row[0])
    pos, doc = [], []
    for row in lengths_per_row:
        assert sum(abs(n) for n in row) == L
        p, d, k = [], [], 0
        for n in row:
            if n > 0:
                p += list(range(n))
                d += [k] * n
                k += 1
            else:
                p += [0] * -n
                d += [-1] * -n
        pos.append(p)
        doc.append(d)
    ids = torch.from_numpy(rng.integers(0, vocab, size=(len(lengths_per_row), L)))
    return ids, torch.tensor(pos), torch.tensor(doc)


def llama(*, heads: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
    )
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).float()


ROWS = [
    [[12, 20, 1, 31]],  # one row: segments of several lengths, one of a single token
    [[64], [30, 30, -4], [7, 7, 7, 7, 36]],  # a whole-row segment, padding, many short ones
]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])
def test_segment_attention_equals_the_eager_block_causal_mask(rows, heads, kv_heads):
    register()
    model = llama(heads=heads, kv_heads=kv_heads)
    ids, pos, doc = packed(rows, vocab=97)
    mask_batch = PackedBatch(
        input_ids=ids,
        position_ids=pos,
        document_ids=doc,
        positions=None,
        target_ids=None,
        signals=[],
        n_tokens=0,
    )
    eager = model(input_ids=ids, position_ids=pos, attention_mask=mask_batch.block_causal_mask()).logits
    eager.square().mean().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.config._attn_implementation = ATTENTION
    segment = model(input_ids=ids, position_ids=pos, segment_plan=plan_segments(pos)).logits
    segment.square().mean().backward()
    torch.testing.assert_close(segment, eager, rtol=1e-5, atol=1e-5)
    for g, e in zip((p.grad for p in model.parameters()), eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_plan_buckets_segments_and_restores_token_order():
    _, pos, _ = packed([[3, 5, 8, 1, 15], [32]], vocab=5)
    plan = plan_segments(pos)
    # buckets (2^(k-1), 2^k], the narrow ones merged up while the padded slots stay within twice the tokens
    assert [tuple(i.shape) for i in plan.index] == [(5, 15), (1, 32)]  # 107 slots for 64 tokens
    slots = torch.cat([i.reshape(-1) for i in plan.index])  # the buckets' padded slots, in bucket order
    assert torch.equal(slots[plan.back], torch.arange(64))
    # the same segments for a variable-length kernel: where each starts, then the end
    assert plan.cu_seqlens.dtype == torch.int32
    assert plan.cu_seqlens.tolist() == [0, 3, 8, 16, 17, 32, 64] and plan.max_seqlen == 32


def test_the_stream_plans_the_segments_of_every_batch_it_packs(tmp_path):
    spec = StreamSpec(seq_len=128, micro_batch=2, rank=0, world_size=1, seed=0, eval_fraction=0.0)
    with store_stream(trainer_view(str(tmp_path / "store")), spec) as stream:  # samples of 2-60 tokens
        batch = next(iter(stream))
    expected = plan_segments(batch.position_ids)
    assert batch.segment_plan is not None and batch.segment_plan.n_segments > 2  # samples packed several to a row
    assert torch.equal(batch.segment_plan.cu_seqlens, expected.cu_seqlens)
    assert torch.equal(batch.segment_plan.back, expected.back)
    moved = batch.to("meta")  # the plan travels with the batch
    assert moved.segment_plan is not None and moved.segment_plan.back.device.type == "meta"


def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """varlen_attn's contract (torch 2.11's signature: no enable_gqa, causal as a window), one segment at a
    time on the CPU: what the CUDA kernel computes, for the code around it."""
    assert window_size == (-1, 0) and key.shape[1] == query.shape[1] and cu_seq_q.dtype == torch.int32
    assert max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    out = []
    for a, b in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))
        out.append(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)
        )
    return torch.cat(out)


def reference_varlen_gqa(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """torch >= 2.12's signature: grouped-query attention taken as it is."""
    assert enable_gqa == (key.shape[1] != query.shape[1])
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)


@pytest.mark.parametrize("kernel", [reference_varlen, reference_varlen_gqa])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_the_varlen_call_equals_the_bucketed_segments(kernel, kv_heads):
    _, pos, _ = packed([[12, 20, 1, 31], [64], [30, 30, -4]], vocab=5)
    plan = plan_segments(pos)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(pos.numel(), 4, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(pos.numel(), kv_heads, 8, generator=generator, requires_grad=True) for _ in range(2))
    got = varlen_segments(q, k, v, plan, scale=0.3, kernel=kernel)
    (got * torch.arange(got.numel()).view_as(got).sin()).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = bucketed_segments(torch.cat([q, k, v], dim=1), plan, split=(4, kv_heads, kv_heads), scale=0.3)
    (want * torch.arange(want.numel()).view_as(want).sin()).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, x.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", [reference_varlen, reference_varlen_gqa])
def test_the_model_on_the_varlen_path_equals_the_eager_block_causal_mask(monkeypatch, kernel):
    # torch has no varlen kernel on the CPU: a reference of its signature stands in for it, so what lies
    # around it in the model (heads flattened, split, grouped-query heads, the output put back) is checked.
    from logitstore.trainer import attention

    calls = []
    counted = functools.wraps(kernel)(lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
    monkeypatch.setattr(attention, "varlen_attn", counted)
    monkeypatch.setattr(attention, "packed_attention", lambda device, dtype: VARLEN)
    register()
    model = llama(heads=4, kv_heads=2)
    ids, pos, doc = packed(ROWS[1], vocab=97)
    mask = PackedBatch(
        input_ids=ids, position_ids=pos, document_ids=doc, positions=None, target_ids=None, signals=[], n_tokens=0
    ).block_causal_mask()
    eager = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
    model.config._attn_implementation = ATTENTION
    varlen = model(input_ids=ids, position_ids=pos, segment_plan=plan_segments(pos)).logits
    torch.testing.assert_close(varlen, eager, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # one call in each of the two layers


def test_varlen_on_cuda_in_half_precision_per_segment_sdpa_everywhere_else():
    kernel = object()  # where torch has varlen_attn
    assert packed_attention("cuda", torch.bfloat16, varlen=kernel) == VARLEN
    assert packed_attention(torch.device("cuda", 0), torch.float16, varlen=kernel) == VARLEN
    assert packed_attention("cuda", torch.float32, varlen=kernel) == SEGMENTS  # flash attention has no fp32
    assert packed_attention("cpu", torch.bfloat16, varlen=kernel) == SEGMENTS
    assert packed_attention("cuda", torch.bfloat16, varlen=None) == SEGMENTS  # torch < 2.10


@pytest.mark.parametrize(
    "rows, widths",
    [
        ([[60, 4]], [60]),  # a short fragment beside a long one: one call, 120 slots for 64 tokens
        ([[1] * 32 + [32]], [1, 32]),  # 32 one-token segments padded to 32 would be 1,056 slots: kept apart
        ([[3, 5, 8], [16]], [16]),
    ],
)
def test_narrow_buckets_merge_into_wider_ones_within_twice_the_tokens(rows, widths):
    _, pos, _ = packed(rows, vocab=5)
    plan = plan_segments(pos)
    assert [i.shape[1] for i in plan.index] == widths
    assert sum(i.numel() for i in plan.index) <= 2 * pos.numel()


def test_memory_of_a_long_row_grows_with_its_segments_not_its_length():
    # 8 segments of 512 in a row of 4096: the largest gathered block is 512 wide, no 4096 x 4096 anything.
    _, pos, _ = packed([[512] * 8], vocab=5)
    plan = plan_segments(pos)
    assert [tuple(i.shape) for i in plan.index] == [(8, 512)]


def test_sliding_window_students_are_refused():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(AttentionError, match="sliding-window"):
        segment_attention(
            torch.nn.Module(),
            q,
            q,
            q,
            None,
            segment_plan=plan_segments(torch.zeros(1, 4, dtype=torch.long)),
            sliding_window=2,
        )


def test_without_a_plan_each_row_is_one_causal_segment():
    # How a trained student is used outside the trainer (scoring a text): the plain causal model.
    register()
    model = llama()
    ids = torch.randint(0, 97, (2, 40))
    eager = model(input_ids=ids).logits
    model.config._attn_implementation = ATTENTION
    torch.testing.assert_close(model(input_ids=ids).logits, eager, rtol=1e-5, atol=1e-5)
