"""Teachers for tests and benchmarks: a tiny random Llama saved as a Hugging Face folder, and a loaded
teacher behind the test server (`openai_server.py`) scoring through the torch engine's forward pass.
torch and transformers load inside the functions: importing this module costs neither."""

from __future__ import annotations

import threading

import numpy as np

from logitstore.testing.openai_server import OpenAIServer, Scores

KEY = "sk-logitstore-test-4f1c9a"  # the API key tests give a served teacher


def save_tiny_llama(folder, tokenizer, **config) -> None:
    """A 1-layer random Llama (hidden 16, seed 0) with `tokenizer`, saved as a Hugging Face folder;
    `config` overrides `LlamaConfig` (vocab_size: the tokenizer's length unless given)."""
    import torch  # torch and transformers: seconds to import, paid only where a teacher is made or run
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    LlamaForCausalLM(LlamaConfig(**{"vocab_size": len(tokenizer), **shape, **config})).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def torch_scorer(teacher):
    """A loaded `Teacher` through the torch engine's top-k forward pass, one prompt of shape [1, T] at a
    time (what `--engine torch --batch-tokens 2` computes). The rank of a prompt token outside the top-k
    is given as k + 1: only "inside or outside" matters to a client."""
    # torch and the teacher's forward pass: seconds to import, paid only where a teacher runs
    import torch

    from logitstore.pipelines.teacher import TeacherForward, sparse_topk_forward  # as torch, above

    forward = TeacherForward.of_model(teacher.model)
    lock = threading.Lock()  # one forward pass at a time: the server answers from several threads

    def score(tokens: np.ndarray, k: int) -> Scores:
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None]
        with lock, torch.inference_mode():
            batch = sparse_topk_forward(forward, ids, torch.ones_like(ids), k=k)
        top = batch.ids[0].numpy()
        targets = np.asarray(tokens[1:])
        inside = top == targets[:, None]
        rank = np.where(inside.any(axis=1), inside.argmax(axis=1) + 1, k + 1)
        return Scores(top, batch.logprobs[0].numpy(), batch.target_logprob[0].numpy(), rank)

    return score


def scoring_teacher(path):
    """(spec, loaded teacher) of `path` (None: the default teacher), on the CPU in fp32, for `torch_scorer`."""
    # the torch engine imports torch: seconds, paid only where a teacher is loaded
    from logitstore.pipelines.engines.torch_engine import load_teacher_once
    from logitstore.pipelines.teacher import resolve_teacher

    spec = resolve_teacher(path)
    return spec, load_teacher_once(spec, "cpu", "float32")


def serve_teacher(path, *, max_logprobs: int):
    """The teacher at `path` (None: the default) behind the test server (`logitstore/testing/openai_server.py`)
    on 127.0.0.1, answering through `torch_scorer`; started, and closed by `with` or `.close()`."""
    spec, teacher = scoring_teacher(path)
    return OpenAIServer(
        model=spec.name, scorer=torch_scorer(teacher), tokenizer=teacher.tokenizer, max_logprobs=max_logprobs
    )
