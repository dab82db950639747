"""`build --dry-run`: writes nothing, and its estimate is near the real build on the same data (tokens and
samples exact where it tokenized the whole input, bytes within 2x; time is printed, never asserted)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.pipelines import estimate
from logitstore.pipelines.build import BuildConfig
from logitstore.store.store import Store
from logitstore.testing.cli import sample_corpus_head, small_build


@pytest.fixture
def data(tmp_path_factory):
    return sample_corpus_head(tmp_path_factory.mktemp("data") / "corpus.jsonl", docs=8, chars=700, first_chars=2000)


def files_under(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_dry_run_writes_nothing_and_estimates_the_real_build(data, tiny_teacher, tmp_path):
    store = tmp_path / "store"
    args = small_build(tiny_teacher, store, data)
    before = files_under(tmp_path)
    result = CliRunner().invoke(app, [*args, "--dry-run", "--json"])
    assert result.exit_code == 0, result.stderr
    assert files_under(tmp_path) == before  # no store, nothing else
    (guess,) = json.loads(result.stdout)["teachers"]
    assert guess["exact"] and guess["already_stored"] == 0 and guess["measured_tokens"] > 0
    assert guess["teacher_tokens_per_second"] > 0 and guess["seconds"] > guess["load_seconds"]

    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.stderr
    real = json.loads(result.stdout)
    assert (guess["tokens"], guess["samples"]) == (real["tokens"], real["samples"])
    assert 0.5 <= guess["bytes_per_token"] / real["bytes_per_token"] <= 2
    assert 0.5 <= guess["stored_bytes"] / real["stored_bytes"] <= 2

    # Again on the built store: nothing left to compute, and the store keeps its one version.
    versions = len(Store.open(str(store)).log())
    result = CliRunner().invoke(app, [*args, "--dry-run"])
    assert result.exit_code == 0, result.stderr
    assert f"~0 tokens in ~0 samples (already stored: {real['samples']:,} samples)" in result.stdout
    assert "nothing written" in result.stdout and len(Store.open(str(store)).log()) == versions


def test_a_dry_run_scales_a_sample_of_a_long_input(data, tiny_teacher, tmp_path, monkeypatch):
    cfg = dict(store=str(tmp_path / "store"), teacher=tiny_teacher, data=str(data), id_column="id", max_length=32)
    whole = estimate.estimate_build(BuildConfig(**cfg, unit_tokens=64, progress=False))
    monkeypatch.setattr(estimate, "SAMPLE_SIZE", 3000)  # the first two or three of eight documents
    scaled = estimate.estimate_build(BuildConfig(**cfg, unit_tokens=64, progress=False))
    assert whole.exact and not scaled.exact and scaled.tokenized_documents < scaled.documents == whole.documents
    assert 0.5 <= scaled.tokens / whole.tokens <= 2 and 0.5 <= scaled.samples / whole.samples <= 2
    assert not (tmp_path / "store").exists()
