"""Hub ids (`org/name[@revision]`) for --teacher, --student and --student-tokenizer, from a Hugging Face
cache laid out in a temporary folder (no network: HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.testing.cli import without_progress
from logitstore.testing.teachers import save_tiny_llama

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_in_cache(cache, repo: str, save) -> None:
    """`save(folder)` writes a model or tokenizer; place it as `repo`'s main snapshot in the cache layout."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    save(root / "snapshots" / COMMIT)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A tiny Llama with the default teacher's tokenizer as `testorg/tiny-llama`, GPT-2's tokenizer as
    `openai-community/gpt2`."""
    from logitstore.pipelines.teacher import describe_teacher
    from logitstore.testing.gpt2 import gpt2_tokenizer

    cache = tmp_path_factory.mktemp("hf") / "hub"
    tokenizer = describe_teacher(None).tokenizer

    put_in_cache(
        cache, "testorg/tiny-llama", lambda folder: save_tiny_llama(folder, tokenizer, max_position_embeddings=512)
    )
    put_in_cache(cache, "openai-community/gpt2", lambda folder: gpt2_tokenizer().save_pretrained(str(folder)))
    return cache


@pytest.fixture
def offline(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_resolve_from_the_cache_offline(offline):
    from logitstore.pipelines.teacher import resolve_teacher
    from logitstore.text.hub import is_hub_id
    from logitstore.text.tokenizer_io import load_tokenizer

    spec = resolve_teacher("testorg/tiny-llama")
    assert (spec.name, spec.kind, spec.path.name) == ("tiny-llama", "hf_dir", COMMIT)
    assert resolve_teacher("testorg/tiny-llama@main").path == spec.path
    assert load_tokenizer("openai-community/gpt2")("Hello world")["input_ids"] == [15496, 995]
    assert is_hub_id("org/name@v1.0") and not is_hub_id("name") and not is_hub_id("a/b/c")


def test_build_and_eval_take_hub_ids(offline, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"d{i}", "text": f"Document {i} says hello to the Hub."}) + "\n" for i in range(4))
    )
    store = str(tmp_path / "store")
    runner = CliRunner()
    built = runner.invoke(
        app,
        [
            "build",
            "--teacher",
            "testorg/tiny-llama",
            "--data",
            str(data),
            "--store",
            store,
            "--top-k",
            "8",
            "--max-length",
            "64",
            "--json",
        ],
    )
    assert built.exit_code == 0, built.stderr
    assert json.loads(built.stdout)["teacher"] == "tiny-llama"
    evaluated = runner.invoke(
        app,
        [
            "eval",
            "--store",
            store,
            "--student",
            "testorg/tiny-llama",
            "--eval-fraction",
            "1",
            "--seq-len",
            "16",
            "--json",
        ],
    )
    assert evaluated.exit_code == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["kl"] >= 0


@pytest.mark.parametrize(
    "args",
    [
        ["build", "--teacher", "nosuch/model"],
        ["train", "--store", "{store}", "--out", "{store}-run", "--student", "nosuch/student"],
    ],
)
def test_an_id_not_cached_offline_is_one_line(offline, tmp_path, args):
    from logitstore.store.store import Store

    store = str(tmp_path / "store")
    Store.open(store, create=True)
    args = [a.replace("{store}", store) for a in args]
    result = CliRunner().invoke(app, [*args, "--store", store] if args[0] == "build" else args)
    error = without_progress(result.stderr)
    assert result.exit_code == 2 and "not in the local Hugging Face cache" in error and "HF_HUB_OFFLINE" in error
    assert len(error.strip().splitlines()) == 1, error
