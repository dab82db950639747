"""The default teacher loads offline, and the chunked sparse forward equals the dense one."""

import json
import re

import pytest
import torch

from logitstore.errors import LogitstoreError
from logitstore.pipelines.teacher import (
    DEFAULT_TEACHER,
    describe_teacher,
    load_teacher,
    model_stop_ids,
    resolve_teacher,
    sparse_topk_forward,
)
from logitstore.pipelines.teacher_files import CACHE_VARIABLE, loadable
from logitstore.testing.teachers import save_tiny_llama
from logitstore.text.tokenizer_io import tokenizer_hash

TEXTS = [
    "The json module can serialize Python dictionaries, lists, strings and numbers, "
    "but it raises a TypeError for objects it does not know how to encode.",
    "Paths are immutable and hashable.",
]
K = 32


@pytest.fixture(scope="module")
def teacher():
    # from the GGUF file's converted copy (seconds), made on first use (~30 s: the GGUF is dequantized)
    return load_teacher(None)


@pytest.fixture(scope="module")
def batch(teacher):
    tokenizer = teacher.tokenizer
    tokenizer.padding_side = "right"
    encoded = tokenizer(TEXTS, return_tensors="pt", padding=True)
    lengths = encoded.attention_mask.sum(1)
    assert lengths[1] < lengths[0], "the second row must be padded"
    return encoded.input_ids, encoded.attention_mask


@pytest.fixture(scope="module")
def dense_logits(teacher, batch):
    input_ids, attention_mask = batch
    with torch.inference_mode():
        return teacher.model(input_ids, attention_mask=attention_mask).logits.float()


def test_default_teacher_loads_offline(teacher):
    assert teacher.spec.name == DEFAULT_TEACHER
    assert teacher.spec.kind == "builtin"
    assert not teacher.model.training
    assert not any(p.requires_grad for p in teacher.model.parameters())
    assert teacher.model.dtype == torch.float32
    assert len(teacher.tokenizer) <= teacher.vocab_size == 49152
    assert re.fullmatch(r"[0-9a-f]{64}", teacher.content_hash)
    assert re.fullmatch(r"[0-9a-f]{64}", teacher.tokenizer_hash)
    # the JSON a store keeps is rendered once, and is the one the hash fingerprints
    assert teacher.tokenizer_json == teacher.tokenizer.backend_tokenizer.to_str()
    assert teacher.tokenizer_hash == tokenizer_hash(teacher.tokenizer) == describe_teacher(None).tokenizer_hash
    assert describe_teacher(None).tokenizer_json == teacher.tokenizer_json


def test_the_converted_copy_of_a_gguf_teacher_is_the_gguf_file_s_model(
    teacher, batch, dense_logits, tmp_path, monkeypatch
):
    assert loadable(teacher.spec)[1] == {}  # the module's teacher came from the converted folder
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")  # a cache that cannot be made: the GGUF file itself
    assert loadable(teacher.spec)[1] == {"gguf_file": teacher.spec.gguf_file}
    from_file = load_teacher(None)
    assert (from_file.content_hash, from_file.tokenizer_hash) == (teacher.content_hash, teacher.tokenizer_hash)
    input_ids, attention_mask = batch
    with torch.inference_mode():
        logits = from_file.model(input_ids, attention_mask=attention_mask).logits.float()
    assert torch.equal(logits, dense_logits)
    chat = [{"role": "user", "content": "Hi"}]
    assert teacher.tokenizer.apply_chat_template(chat, tokenize=False) == from_file.tokenizer.apply_chat_template(
        chat, tokenize=False
    )
    monkeypatch.delenv(CACHE_VARIABLE)
    converted = model_stop_ids(teacher.spec)
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "a-file"))
    assert converted == model_stop_ids(teacher.spec)


def test_default_aliases_resolve_to_the_same_teacher():
    assert resolve_teacher(None) == resolve_teacher("default") == resolve_teacher(DEFAULT_TEACHER)


def test_gguf_path_resolves(teacher):
    spec = resolve_teacher(str(teacher.spec.path / teacher.spec.gguf_file))
    assert spec.kind == "gguf"
    assert spec.gguf_file == teacher.spec.gguf_file


@pytest.mark.parametrize("chunking", ["divides", "does_not_divide", "single_chunk"])
def test_sparse_forward_matches_dense(teacher, batch, dense_logits, chunking):
    input_ids, attention_mask = batch
    positions = 2 * (input_ids.shape[1] - 1)  # chunks run over the flattened batch
    chunk_positions = _chunk_size(positions, chunking)

    sparse = sparse_topk_forward(teacher.model, input_ids, attention_mask, k=K, chunk_positions=chunk_positions)

    assert sparse.ids.shape == sparse.logprobs.shape == (2, positions // 2, K)
    assert sparse.ids.dtype == torch.int32 and sparse.logprobs.dtype == torch.float32
    valid = attention_mask[:, 1:].bool()  # the next token is real text
    reference = dense_logits[:, :-1].log_softmax(-1)
    ref_values, ref_ids = reference.topk(K, dim=-1)

    _assert_same_topk(sparse.ids.long()[valid], ref_ids[valid], reference[valid])
    torch.testing.assert_close(sparse.logprobs[valid], ref_values[valid], atol=1e-4, rtol=0)

    ref_target = reference.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(sparse.target_logprob[valid], ref_target[valid], atol=1e-4, rtol=0)

    # fp32 log_softmax over 49k entries is itself ~3e-5 off normalised, too coarse for a
    # 1e-5 tail check, so the tail reference is computed from the same logits in float64.
    ref_top = dense_logits[:, :-1].double().log_softmax(-1).topk(K, dim=-1).values
    ref_tail = 1 - ref_top.exp().sum(-1)
    torch.testing.assert_close(sparse.tail.double()[valid], ref_tail[valid], atol=1e-5, rtol=0)
    assert ((sparse.tail >= 0) & (sparse.tail <= 1)).all()


def _chunk_size(positions, chunking):
    if chunking == "single_chunk":
        return 1024
    divisors = [c for c in range(3, positions) if positions % c == 0]
    if chunking == "divides":
        return divisors[0]
    return next(c for c in range(5, positions) if positions % c)


def _assert_same_topk(ids, ref_ids, reference):
    """Ids equal up to ties: where they differ, both ids must carry the same logprob."""
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "duplicate ids in a top-k"
    mismatch = ids != ref_ids
    tied = reference.gather(-1, ids) - reference.gather(-1, ref_ids)
    assert (tied[mismatch].abs() < 1e-4).all()
    assert mismatch.float().mean() < 0.01


def test_left_padded_row_equals_unpadded_row(teacher):
    tokenizer = teacher.tokenizer
    tokenizer.padding_side = "left"
    try:
        padded = tokenizer(TEXTS, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = "right"
    alone = tokenizer(TEXTS[1:], return_tensors="pt")
    n = alone.input_ids.shape[1] - 1

    both = sparse_topk_forward(teacher.model, padded.input_ids, padded.attention_mask, k=K)
    single = sparse_topk_forward(teacher.model, alone.input_ids, None, k=K)

    torch.testing.assert_close(both.logprobs[1, -n:], single.logprobs[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(both.tail[1, -n:], single.tail[0], atol=1e-5, rtol=0)


def test_topk_mass_and_tail_sum_to_one(teacher, batch):
    input_ids, attention_mask = batch
    sparse = sparse_topk_forward(teacher.model, input_ids, attention_mask, k=K)
    total = sparse.logprobs.double().exp().sum(-1) + sparse.tail.double()
    torch.testing.assert_close(total, torch.ones_like(total), atol=1e-4, rtol=0)
    assert (sparse.logprobs.diff(dim=-1) <= 0).all(), "top-k must be sorted descending"


def test_single_token_rows_give_no_positions(teacher):
    sparse = sparse_topk_forward(teacher.model, torch.tensor([[42], [7]]), None, k=4)
    assert sparse.ids.shape == (2, 0, 4)
    assert sparse.tail.shape == (2, 0)


@pytest.mark.parametrize("k", [0, 49153])
def test_k_out_of_range_is_a_user_error(teacher, k):
    with pytest.raises(LogitstoreError, match="k="):
        sparse_topk_forward(teacher.model, torch.tensor([[1, 2, 3]]), None, k=k)


def test_ids_outside_the_vocabulary_are_a_user_error(teacher):
    with pytest.raises(LogitstoreError, match="input_ids"):
        sparse_topk_forward(teacher.model, torch.tensor([[1, -100, 3]]), None, k=4)


def test_nonexistent_path_is_a_user_error(tmp_path):
    with pytest.raises(LogitstoreError, match="no such file or directory"):
        resolve_teacher(str(tmp_path / "missing-model"))


def test_directory_without_config_is_a_user_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(LogitstoreError, match="config.json"):
        resolve_teacher(str(tmp_path))


def test_non_causal_model_dir_is_a_user_error(tmp_path):
    config = {"model_type": "vit", "architectures": ["ViTModel"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LogitstoreError, match="not a causal language model"):
        resolve_teacher(str(tmp_path))


def test_file_that_is_not_gguf_is_a_user_error(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"not a gguf file")
    with pytest.raises(LogitstoreError, match="not a .gguf file"):
        resolve_teacher(str(path))


def test_hf_dir_teacher_loads_and_hashes(teacher, tmp_path):
    save_tiny_llama(tmp_path, teacher.tokenizer, vocab_size=teacher.vocab_size)

    tiny = load_teacher(str(tmp_path))

    assert tiny.spec.kind == "hf_dir"
    assert tiny.vocab_size == teacher.vocab_size
    assert tiny.tokenizer_hash == teacher.tokenizer_hash
    assert tiny.content_hash != teacher.content_hash
    assert load_teacher(str(tmp_path)).content_hash == tiny.content_hash
    sparse = sparse_topk_forward(tiny.model, torch.tensor([[1, 2, 3, 4]]), None, k=5)
    assert sparse.ids.shape == (1, 3, 5)


def test_tokenizer_larger_than_model_vocab_is_a_user_error(teacher, tmp_path):
    save_tiny_llama(tmp_path, teacher.tokenizer, vocab_size=1000)
    with pytest.raises(LogitstoreError, match="tokenizer has 49152 tokens"):
        load_teacher(str(tmp_path))
