"""The engines' shared parts without vLLM: the output head (`pipelines/head.py`: loaded alone, tied or not,
with the model's own final logit transforms) and `close()` on the torch engine."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from logitstore.pipelines.head import HeadError, OutputHead, load_head, logit_transforms
from logitstore.pipelines.teacher import TeacherSpec, last_hidden_state

SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def _model(config_class: str, **config):
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**{**SHAPE, **config})
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


# (config class, config overrides, the transform the head must apply)
MODELS = {
    "llama untied": ("LlamaConfig", {"tie_word_embeddings": False}, ()),
    "llama tied": ("LlamaConfig", {"tie_word_embeddings": True}, ()),
    "gemma2 soft-capped": (
        "Gemma2Config",
        {"final_logit_softcapping": 0.5, "head_dim": 16},
        ("final_logit_softcapping",),
    ),
    "cohere scaled": ("CohereConfig", {"logit_scale": 0.25}, ("logit_scale",)),
    "granite scaled": ("GraniteConfig", {"logits_scaling": 4.0}, ("logits_scaling",)),
}


@pytest.mark.parametrize("name", MODELS)
def test_the_head_alone_gives_the_models_own_logits(name, tmp_path):
    """The head loaded from the saved weights alone, applied to the body's final hidden states, gives what
    the whole model's forward gives: tied or untied, with Gemma 2's soft cap and Cohere's and Granite's scales."""
    config_class, overrides, transforms = MODELS[name]
    model = _model(config_class, **overrides)
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 12))
    with torch.inference_mode():
        expected = model(ids).logits.float()
        hidden = last_hidden_state(model, ids, None)
        head = load_head(TeacherSpec(name=name, kind="hf_dir", path=tmp_path), device="cpu", dtype=torch.float32)
        got = head(hidden)
        of_model = OutputHead.of_model(model)(hidden)
    assert tuple(t for t, _ in head.transforms) == transforms
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(of_model, expected, atol=1e-5, rtol=1e-5)
    if transforms:  # the transform matters: without it the logits differ
        plain = OutputHead(linear=head.linear)(hidden)
        assert (plain - expected).abs().max() > 1e-2


def test_a_transform_logitstore_does_not_know_is_refused():
    model = _model("LlamaConfig")
    model.config.output_logit_multiplier = 2.0  # a future model's, unknown here
    with pytest.raises(HeadError, match="output_logit_multiplier.*--vllm-output logprobs"):
        logit_transforms(model.config)
    model.config.attn_logit_softcapping = 50.0  # inside the body: not the head's business
    del model.config.output_logit_multiplier
    assert logit_transforms(model.config) == ()


def test_close_gives_the_torch_engines_teacher_back(tiny_teacher, monkeypatch):
    """Outside `shared_teachers()` the engine holds the only reference to its teacher: close() lets it go
    (and a closed engine refuses to compute)."""
    from logitstore.format.sparsity import default_sparsity
    from logitstore.pipelines.engines import torch_engine
    from logitstore.pipelines.engines.settings import WorkerSettings
    from logitstore.pipelines.teacher import resolve_teacher

    monkeypatch.setattr(torch_engine, "_shared", None)  # the tests' shared teacher cache, off for this one
    settings = WorkerSettings(
        teacher_spec=resolve_teacher(tiny_teacher),
        device="cpu",
        dtype="float32",
        sparsity=default_sparsity(),
        batch_tokens=256,
        seed=0,
    )
    engine = torch_engine.TorchEngine(settings, lock=threading.Lock())
    model = weakref.ref(engine.teacher.model)
    engine.close()
    engine.close()  # idempotent
    gc.collect()
    assert model() is None
    with pytest.raises(AssertionError, match="closed"):
        engine.compute(["a"], [torch.arange(4).numpy()], seed=0)


def _top8_engine_of_one_sample_batches(tiny_teacher):
    """The torch engine on the tiny teacher, top-8, batches of 32 tokens: one 32-token sample per batch."""
    from logitstore.format.sparsity import Sparsity
    from logitstore.pipelines.engines import torch_engine
    from logitstore.pipelines.engines.settings import WorkerSettings
    from logitstore.pipelines.teacher import resolve_teacher

    settings = WorkerSettings(
        teacher_spec=resolve_teacher(tiny_teacher),
        device="cpu",
        dtype="float32",
        sparsity=Sparsity(k=8),
        batch_tokens=32,
        seed=0,
    )
    return torch_engine.TorchEngine(settings, lock=threading.Lock())


def test_the_next_batch_is_launched_before_the_host_reads_the_last(tiny_teacher, monkeypatch):
    """A queue of depth `IN_FLIGHT`: batches i + 1 .. i + IN_FLIGHT are launched (forward pass and copy)
    before the host turns batch i into samples, so a GPU never waits for the host; and the samples are the
    same as one batch at a time."""
    import numpy as np

    from logitstore.pipelines import sparsify
    from logitstore.pipelines.engines import torch_engine

    events = []
    launch, finish = sparsify.forward_selected, sparsify.HostSelected.samples

    def launched(*args, lengths, **kwargs):
        events.append("launch")
        return launch(*args, lengths=lengths, **kwargs)

    def finished(self, **kwargs):
        events.append("read")
        return finish(self, **kwargs)

    engine = _top8_engine_of_one_sample_batches(tiny_teacher)
    tokens = [np.arange(1, 33) + i for i in range(4)]
    ids = [f"s{i}" for i in range(4)]
    alone = [engine.compute([sid], [t], seed=0) for sid, t in zip(ids, tokens)]
    monkeypatch.setattr(sparsify, "forward_selected", launched)
    monkeypatch.setattr(sparsify.HostSelected, "samples", finished)
    together = engine.compute(ids, tokens, seed=0)
    depth = torch_engine.IN_FLIGHT
    assert 1 <= depth < 3, "four batches show the queue"
    assert events == ["launch"] * (depth + 1) + ["read", "launch"] * (3 - depth) + ["read"] * (depth + 1)
    for i, samples in enumerate(alone):
        one = together.select(i)
        assert one.sample_ids == samples.sample_ids
        np.testing.assert_array_equal(one.entry_ids, samples.entry_ids)
        np.testing.assert_array_equal(one.entry_logprobs, samples.entry_logprobs)
        np.testing.assert_array_equal(one.tail, samples.tail)


def test_two_calls_side_by_side_launch_one_after_the_other(tiny_teacher, monkeypatch):
    """Two units computed at once on one engine (the in-process executor's threads): every batch of one is
    launched before any of the other's, so on a GPU the first unit finishes, and is written, while the
    second runs (interleaved, both would finish together and the device would wait for both writes). Each
    gives what it gives alone. The host's reads are slowed so that the calls would interleave otherwise."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from logitstore.pipelines import sparsify

    launches = []
    launch, finish = sparsify.forward_selected, sparsify.HostSelected.samples

    def launched(*args, lengths, **kwargs):
        launches.append(threading.current_thread().name)
        return launch(*args, lengths=lengths, **kwargs)

    def finished(self, **kwargs):
        time.sleep(0.02)  # outside the teacher's lock: the other call could launch meanwhile
        return finish(self, **kwargs)

    engine = _top8_engine_of_one_sample_batches(tiny_teacher)
    units = [([f"u{u}s{i}" for i in range(4)], [np.arange(1, 33) + 10 * u + i for i in range(4)]) for u in range(2)]
    alone = [engine.compute(ids, tokens, seed=u) for u, (ids, tokens) in enumerate(units)]
    monkeypatch.setattr(sparsify, "forward_selected", launched)
    monkeypatch.setattr(sparsify.HostSelected, "samples", finished)
    with ThreadPoolExecutor(2, thread_name_prefix="unit") as pool:
        side_by_side = list(pool.map(lambda u: engine.compute(*units[u], seed=u), range(2)))
    first, second = launches[0], next(name for name in launches if name != launches[0])
    assert launches == [first] * 4 + [second] * 4
    for got, expected in zip(side_by_side, alone):
        assert got.sample_ids == expected.sample_ids
        np.testing.assert_array_equal(got.entry_ids, expected.entry_ids)
        np.testing.assert_array_equal(got.entry_logprobs, expected.entry_logprobs)
