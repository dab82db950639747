"""`build --generate` with several `--teacher`s: the answers are generated once, by the first teacher's
pass, and every teacher scores those same answers (same ids, same token ids, the generation recorded on
each); a teacher with another tokenizer is refused before anything is written; and `--dry-run
--generate` estimates the generation without writing anything."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

import logitstore
from logitstore.cli.app import app
from logitstore.cli.text import print_estimates
from logitstore.pipelines.estimate import BuildEstimate
from logitstore.pipelines.teacher import describe_teacher
from logitstore.testing.prompts import PROMPTS, write_prompts
from logitstore.testing.teachers import save_tiny_llama


def generate_args(store, data, *teachers, extra=()) -> list[str]:
    args = ["build", "--store", str(store), "--data", str(data), "--prompt-column", "prompt", "--generate", "12"]
    return [*args, "--max-length", "48", "--seed", "5", *[a for t in teachers for a in ("--teacher", t)], *extra]


def build(args) -> dict:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.stderr + result.stdout
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def second_teacher(tmp_path_factory) -> str:
    """Another tiny teacher with the first one's tokenizer (SmolLM2's) and other weights."""
    path = tmp_path_factory.mktemp("teachers") / "tiny-second"
    save_tiny_llama(path, describe_teacher(None).tokenizer, max_position_embeddings=128, intermediate_size=24)
    return str(path)


@pytest.fixture(scope="module")
def two(tiny_teacher, second_teacher, tmp_path_factory):
    """The prompts answered once by a build of the first teacher alone (what a kill between the two
    passes leaves: the first teacher's answers committed, the second's not), then twice each by a build
    of both teachers, then that build run again."""
    root = tmp_path_factory.mktemp("two")
    data = write_prompts(root / "prompts.jsonl", PROMPTS)
    alone = build(generate_args(root / "store", data, tiny_teacher))
    args = generate_args(root / "store", data, tiny_teacher, second_teacher, extra=["--samples-per-prompt", "2"])
    return root / "store", alone, build(args), build(args)


def test_every_teacher_scores_the_same_answers_generated_once(two):
    store, alone, summary, again = two
    view = logitstore.open(str(store))
    first, second = (part["teacher"] for part in summary["teachers"])
    ids = sorted(f"{p}/g{n}" for p in PROMPTS for n in (0, 1))
    for name in (first, second):
        rows = view.index.filter(view.index["teacher"].to_numpy() == name)
        assert sorted(rows["sample_id"].to_pylist()) == ids
    lengths = {}
    for sid in ids:
        a, b = view.sample(sid, teacher=first), view.sample(sid, teacher=second)
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
        lengths[sid] = int(a.loss_mask.sum())
    assert view.answer("story/g1", teacher=first) == view.answer("story/g1", teacher=second)
    [record] = view.generations(first).values()
    assert view.generations(second) == {record["id"]: record} and record == summary["generation"] == alone["generation"]
    assert record["generator"]["name"] == first  # no --generator: the first teacher answers
    # generated once: g0 by the first build, g1 by the first pass of the second; its second pass generated nothing
    assert (alone["answers"], summary["prompts"], summary["answers"]) == (len(PROMPTS), len(PROMPTS), len(PROMPTS))
    assert summary["generated_tokens"] == sum(n for sid, n in lengths.items() if sid.endswith("/g1"))
    assert alone["generated_tokens"] == sum(n for sid, n in lengths.items() if sid.endswith("/g0"))
    one, two_ = summary["teachers"]
    assert (one["answers"], one["already_stored"], two_["answers"], two_["generated_tokens"]) == (4, 4, 0, 0)
    assert (one["samples"], two_["samples"], summary["samples"], two_["no_answer"]) == (4, len(ids), 4 + len(ids), 0)
    # run again: nothing generated, nothing scored, every answer of both teachers already stored
    assert (again["answers"], again["samples"], again["already_stored"]) == (0, 0, 2 * len(ids))
    shown = CliRunner().invoke(app, ["show", str(store), "story/g1", "--teacher", second, "--top", "1"])
    assert shown.exit_code == 0 and "answer 1 to prompt 'story'" in shown.stdout, shown.stderr


def test_a_teacher_with_another_tokenizer_is_refused_before_anything_is_written(
    tiny_teacher, gpt2_tokenizer_dir, tmp_path
):
    other = tmp_path / "tiny-gpt2"
    save_tiny_llama(other, AutoTokenizer.from_pretrained(str(gpt2_tokenizer_dir)), max_position_embeddings=128)
    data = write_prompts(tmp_path / "p.jsonl", {"a": "Hi there"})
    for extra in ([], ["--dry-run"]):
        result = CliRunner().invoke(app, generate_args(tmp_path / "s", data, tiny_teacher, str(other), extra=extra))
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1 and "tokenizer differs" in errors[0], result.stderr
        assert "Traceback" not in result.stderr and not (tmp_path / "s").exists()


def test_a_dry_run_estimates_the_generation_and_writes_nothing(tiny_teacher, second_teacher, tmp_path, capsys):
    prompts = {f"p{i}": f"Question {i}: what comes next" for i in range(6)}
    data = write_prompts(tmp_path / "p.jsonl", prompts)
    # two prompts per generator call (48-token samples, 2 answers each, 192-token units): 6 prompts scale by 3
    args = generate_args(tmp_path / "s", data, tiny_teacher, second_teacher, extra=["--samples-per-prompt", 2])
    args = [*map(str, args), "--unit-tokens", "192", "--batch-tokens", "192", "--dry-run"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.stderr
    first, second = json.loads(result.stdout)["teachers"]
    assert (first["prompts"], first["answers"], first["answers_per_prompt"], first["measured_answers"]) == (6, 12, 2, 4)
    assert 1 <= first["mean_answer_tokens"] <= 12 and first["generator_tokens_per_second"] > 0
    assert first["generated_tokens"] == round(12 * first["mean_answer_tokens"])
    assert first["generation_seconds"] > 0 and first["seconds"] > first["generation_seconds"]
    assert first["answer_stored_bytes"] > 0 and first["generation"]["max_new_tokens"] == 12
    # the second teacher scores the first's sample answers: the same tokens, no generation of its own
    assert (second["answers_of"], second["answers"], second["tokens"]) == (first["teacher"], 0, first["tokens"])
    assert second["generation"] == first["generation"] and second["teacher_tokens_per_second"] > 0
    print_estimates([BuildEstimate(**first), BuildEstimate(**second)])  # the text of the same estimates
    out = capsys.readouterr().out
    assert "6 documents (the first 2 tokenized, the rest scaled by count)" in out
    assert "generate ~12 answers (2 per prompt to ~6 prompts)" in out and f"teacher {first['teacher']} generates" in out
    assert not (tmp_path / "s").exists()
