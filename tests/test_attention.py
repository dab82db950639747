"""The segment attention (trainer/attention.py) against the eager block-causal mask it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from logitstore.streaming.batch import PackedBatch
from logitstore.trainer.attention import ATTENTION, AttentionError, plan_segments, register, segment_attention


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
    assert [i.shape[1] for i in plan.index] == [1, 3, 8, 15, 32]  # buckets (2^(k-1), 2^k]: 5 and 8 share one
    kept = torch.cat([i[k] for i, k in zip(plan.index, plan.keep)])
    assert torch.equal(kept[plan.inverse], torch.arange(64))


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
