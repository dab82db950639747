"""`build --generate`: prompts answered by a generator (the default teacher, or a trained student's
`RUN/final`), the answers scored by the teacher with only their positions supervised, keyed
`PROMPTID/gN`, the same for the same seed, readable with `show` and `StoreVersion.answer`, and a
resumed or killed build generating no answer twice."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import datasets
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import logitstore
from logitstore.cli.app import app
from logitstore.errors import StoreNotFoundError
from logitstore.pipelines.engines.shared import cut_at_stop, stop_token_ids
from logitstore.pipelines.engines.torch_engine import nucleus, seeded_uniform
from logitstore.pipelines.teacher import describe_teacher
from logitstore.store.generation import answer_source_hash, generation_of, parse_answer_id, seed_of
from logitstore.store.store import Store
from logitstore.store.verify import verify
from logitstore.testing.cli import CLI, one_line_error
from logitstore.testing.prompts import PROMPTS, answers, write_prompts


def generate_args(store, data, *extra, teacher=None) -> list[str]:
    teacher_args = ["--teacher", str(teacher)] if teacher else []
    base = ["build", "--store", str(store), "--data", str(data), "--prompt-column", "prompt", "--generate", "16"]
    return [*base, "--max-length", "64", *teacher_args, *map(str, extra), "--json"]


def given(messages: list[dict]) -> list[dict]:
    """Messages as given: a table holds every key in each row, None where a message has none."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def build(args) -> dict:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr + result.stdout
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", PROMPTS)


@pytest.fixture(scope="module")
def twice(prompts, tmp_path_factory):
    """Two builds of the same prompts with one seed, by the default teacher answering itself."""
    root = tmp_path_factory.mktemp("generated")
    return [(root / name, build(generate_args(root / name, prompts, "--seed", 7))) for name in ("a", "b")]


def test_answers_are_supervised_and_prompts_are_not(twice):
    (store, summary), _ = twice
    tokenizer = describe_teacher(None).tokenizer
    view = logitstore.open(str(store))
    assert sorted(view.index["sample_id"].to_pylist()) == sorted(f"{p}/g0" for p in PROMPTS)
    assert (summary["prompts"], summary["answers"]) == (len(PROMPTS), len(PROMPTS))
    assert summary["generated_tokens"] == sum(len(a) for a in answers(store).values())
    for prompt_id, text in PROMPTS.items():
        s = view.sample(f"{prompt_id}/g0")
        prompt = tokenizer(text)["input_ids"]
        answer = s.input_ids[len(prompt) :]
        assert s.input_ids[: len(prompt)].tolist() == prompt and 1 <= len(answer) <= 16
        assert s.loss_mask.tolist() == [0] * len(prompt) + [1] * len(answer)
        # entries only where the next token is the answer's: the prompt's positions but its last hold none
        assert (s.n_entries[: len(prompt) - 1] == 0).all() and (s.n_entries[len(prompt) - 1 :] > 0).all()
        got = view.answer(f"{prompt_id}/g0")
        assert got["text"] == tokenizer.decode(answer.tolist()) and got["prompt_text"] == text
    assert summary["answers_cut"] == sum(
        1 for a in answers(store).values() if len(a) == 16 and a[-1] != tokenizer.eos_token_id
    )


def test_one_seed_gives_the_same_answers_and_the_store_records_the_generation(twice):
    (a, summary), (b, _) = twice
    assert answers(a) == answers(b)
    view = logitstore.open(str(a))
    [record] = view.generations().values()
    assert record == summary["generation"] == view.answer("france/g0")["generation"]
    assert record["generator"]["name"] == summary["teacher"] and record["generator"]["run"] is None
    assert (record["seed"], record["max_new_tokens"], record["temperature"], record["top_p"]) == (7, 16, 1.0, 1.0)
    assert view.info()["teachers"][0]["generations"] == [record]
    shown = CliRunner().invoke(app, ["show", str(a), "story/g0", "--top", "1"])
    assert shown.exit_code == 0 and "answer 0 to prompt 'story'" in shown.stdout


def test_a_resumed_build_generates_only_the_answers_not_stored(twice, prompts, tmp_path):
    (store, _), _ = twice
    again = build(generate_args(store, prompts, "--seed", 7))
    assert (again["answers"], again["already_stored"], again["samples"]) == (0, len(PROMPTS), 0)
    more = build(generate_args(store, prompts, "--seed", 7, "--samples-per-prompt", 2, "--commit-every", 1))
    assert (more["answers"], more["already_stored"]) == (len(PROMPTS), len(PROMPTS))
    view = logitstore.open(str(store))
    assert len(view.generations()) == 1  # more samples per prompt: the same generation
    assert sorted(view.index["sample_id"].to_pylist()) == sorted(f"{p}/g{n}" for p in PROMPTS for n in (0, 1))
    other = CliRunner().invoke(app, generate_args(store, prompts, "--seed", 8))
    assert other.exit_code == 2 and "stored with other text" in other.stderr and "--on-duplicate" in other.stderr


def test_answers_export_as_chat_rows_with_the_prompt_as_the_user_turn(twice, tmp_path):
    (_, summary), (store, _) = twice
    out = tmp_path / "answers.parquet"
    result = CliRunner().invoke(app, ["export", str(store), str(out)])
    assert result.exit_code == 0 and f"wrote {len(PROMPTS)} answers to {len(PROMPTS)} prompts" in result.stdout
    rows = {r["prompt_id"]: r for r in datasets.load_dataset("parquet", data_files=str(out), split="train")}
    view = logitstore.open(str(store))
    tokenizer = view.tokenizer()
    stops = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    for prompt_id, text in PROMPTS.items():
        answer = view.answer(f"{prompt_id}/g0")
        assert answer["messages"] == [{"role": "user", "content": text}]
        ids = answer["token_ids"][:-1] if answer["token_ids"][-1] in stops else answer["token_ids"]  # less its stop
        assistant = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=False)}
        assert rows[prompt_id]["messages"] == [*answer["messages"], assistant]
        assert rows[prompt_id]["generation"] == summary["generation"]["id"]
    assert verify(view).ok  # the prompts read whole, one per answer


def test_noise_depends_on_the_seed_and_step_only():
    seeds = torch.tensor([seed_of(7, "a", 0), seed_of(7, "b", 0), seed_of(7, "a", 1)])
    together = seeded_uniform(seeds, step=3, vocab=1000)
    assert torch.equal(seeded_uniform(seeds[1:2], step=3, vocab=1000)[0], together[1])  # any batch: the same row
    assert not torch.equal(seeded_uniform(seeds, step=4, vocab=1000), together)
    assert ((together > 0) & (together < 1)).all() and abs(float(together.mean()) - 0.5) < 0.02
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(nucleus(logits, top_p=0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(nucleus(logits, top_p=0.1)).tolist() == [[False, True, True, True]]


def test_answer_keys_stop_tokens_and_source_hashes():
    assert parse_answer_id("doc/7/g12") == ("doc/7", 12) and parse_answer_id("doc#w1") is None
    source = answer_source_hash("abc", "0123456789ab")
    assert len(source) == 32 and generation_of(source) == "0123456789ab" and generation_of("f" * 32) is None
    assert cut_at_stop(np.array([5, 2, 2, 2]), [2]).tolist() == [5, 2]
    assert cut_at_stop(np.array([5, 6]), [2]).tolist() == [5, 6]

    class Config:
        eos_token_id = [2, 0]

    assert stop_token_ids(Config(), None) == [0, 2] and stop_token_ids(None, Config()) == [0, 2]


def test_chat_prompts_are_answered_after_the_generation_prompt(tiny_teacher, tmp_path):
    data = tmp_path / "chat.jsonl"
    system = {"role": "system", "content": "Be brief.", "name": "rules"}  # extra keys are kept as given
    rows = [
        {"id": "q", "messages": [system, {"role": "user", "content": "Hi there"}]},
        {"id": "r", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    args = ["build", "--store", str(tmp_path / "s"), "--data", str(data), "--chat-column", "messages"]
    summary = build([*args, "--teacher", tiny_teacher, "--generate", "8", "--max-length", "64", "--json"])
    assert summary["answers"] == 1
    view = logitstore.open(str(tmp_path / "s"))
    answer = view.answer("q/g0")
    assert answer["prompt_text"].endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert answer["messages"] == rows[0]["messages"]
    # exported as a chat row: the conversation as given, then the answer as the assistant's turn
    exported = build(["export", str(tmp_path / "s"), str(tmp_path / "answers.jsonl"), "--json"])
    assert (exported["answers"], exported["prompts_not_stored"]) == (1, 0)
    [row] = datasets.load_dataset("json", data_files=str(tmp_path / "answers.jsonl"), split="train").to_list()
    [made] = view.answers_dataset().to_list()
    conversation = [*rows[0]["messages"], {"role": "assistant", "content": answer["text"]}]
    assert given(row["messages"]) == given(made["messages"]) == conversation
    assert (row["prompt_id"], row["sample"], row["generation"]) == ("q", 0, summary["generation"]["id"])
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(app, [*args, "--teacher", tiny_teacher, "--generate", "8", "--max-length", "64"])
    assert result.exit_code == 2 and "'r' (input row 1)" in result.stderr and "user turn" in result.stderr


@pytest.mark.parametrize(
    ("rows", "extra", "message"),
    [
        ([{"id": "a", "prompt": "Hello"}], ["--generate", "0"], "--generate must be at least 1"),
        ([{"id": "a", "text": "Hello"}], ["--generate", "4"], "no column 'prompt' (--prompt-column)"),
        (
            [{"id": "a", "prompt": "Hi"}, {"id": "b", "prompt": " "}],
            ["--generate", "4"],
            "row 1, document 'b': text column 'prompt' is empty",
        ),
        ([{"id": "a", "prompt": "one two three four five six"}], ["--generate", "28"], "'a' (input row 0) has"),
        ([{"id": "a", "prompt": "Hi"}], ["--generate", "4", "--generator", "/no/such/model"], "--generator"),
        (
            [{"id": "a", "prompt": "Hi"}],
            ["--generate", "4", "--generation-temperature", "inf"],
            "--generation-temperature must be a number of at least 0, got inf",
        ),
        (
            [{"id": "a", "prompt": "Hi"}],
            ["--generate", "4", "--samples-per-prompt", str(10**12), "--limit", "1"],
            "--samples-per-prompt must be between 1 and 10,000, got 1000000000000",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tiny_teacher, tmp_path, rows, extra, message):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["build", "--teacher", tiny_teacher, "--store", str(tmp_path / "s"), "--data", str(data)]
    result = CliRunner().invoke(app, [*args, "--prompt-column", "prompt", "--max-length", "32", *extra])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and message in errors[0], result.stderr
    assert not (tmp_path / "s").exists()


def test_a_generator_that_cannot_load_writes_nothing(tiny_teacher, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 49152}))
    data = write_prompts(tmp_path / "p.jsonl", {"a": "Hi"})
    result = CliRunner().invoke(app, generate_args(tmp_path / "s", data, "--generator", broken, teacher=tiny_teacher))
    assert result.exit_code == 2 and "--generator" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "s").exists()


def stored_rows(store) -> int:
    """The rows the store's main branch holds; 0 while the build is still creating the store (its folder
    can exist before the repository does)."""
    try:
        return logitstore.open(str(store)).index.num_rows if Store.open(str(store)).branches() else 0
    except StoreNotFoundError:
        return 0


@pytest.mark.slow
def test_a_killed_build_resumes_and_answers_every_prompt_once(tiny_teacher, tmp_path):
    prompts = {f"p{i}": f"Prompt number {i} asks" for i in range(24)}
    data = write_prompts(tmp_path / "p.jsonl", prompts)
    store = tmp_path / "s"
    # one prompt per generator call (batches and units of 64 tokens at most): the kill lands mid-generation
    limits = ["--unit-tokens", 40, "--batch-tokens", 64, "--commit-every", 0.01]
    args = generate_args(store, data, *limits, teacher=tiny_teacher)
    child = subprocess.Popen([*CLI, *args[:-1]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and child.poll() is None:  # until a checkpoint holds some answers
            if stored_rows(store):
                break
            time.sleep(0.2)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    stored = logitstore.open(str(store)).index.num_rows
    assert 0 < stored < len(prompts), "the kill came before the first checkpoint or after the last"
    summary = build(args)
    assert summary["already_stored"] == stored and summary["answers"] == len(prompts) - stored
    ids = logitstore.open(str(store)).index["sample_id"].to_pylist()
    assert sorted(ids) == sorted(f"{p}/g0" for p in prompts)


def test_a_trained_student_generates_and_the_store_records_its_run(twice, prompts, tmp_path):
    from logitstore.trainer.config import TrainConfig
    from logitstore.trainer.train import launch

    (store, _), _ = twice
    run = tmp_path / "run"
    launch(TrainConfig.from_flags(store=str(store), out=str(run), steps=5, seq_len=32, micro_batch=1, eval_fraction=0))
    summary = build(generate_args(tmp_path / "student", prompts, "--seed", 7, "--generator", run / "final"))
    generator = summary["generation"]["generator"]
    assert (generator["run"], generator["step"], generator["source"]) == (str(run.resolve()), 5, str(run / "final"))
    view = logitstore.open(str(tmp_path / "student"))
    assert view.generations()[summary["generation"]["id"]]["generator"]["step"] == 5
    assert answers(tmp_path / "student") != answers(store)
    assert os.path.isdir(run / "final") and sys.executable


def test_rounds_refuse_what_training_refuses_before_round_one(prompts, tiny_teacher, tmp_path):
    store, a_file = tmp_path / "store", tmp_path / "a-file"
    a_file.write_text("not a run folder")
    args = ["rounds", "--prompts", prompts, "--prompt-column", "prompt", "--store", store, "--teacher", tiny_teacher]
    sizes = ["--rounds", 1, "--steps-per-round", 1, "--generate", 4, "--max-length", 64]
    for flags, message in (
        (["--out", tmp_path / "run", "--seq-len", 0], "--seq-len must be at least 2"),
        (["--out", tmp_path / "run", "--micro-batch", 0], "--micro-batch must be at least 1"),
        (["--out", a_file], f"--out {a_file} is a file, not a folder"),
    ):
        result = CliRunner().invoke(app, [str(a) for a in [*args, *sizes, *flags]])
        assert message in one_line_error(result, 2)
        assert not store.exists() and not (tmp_path / "run").exists()  # was: round 1 built and committed first


@pytest.mark.slow
def test_two_on_policy_rounds_train_on_each_new_version_and_the_run_records_both(prompts, tmp_path):
    from logitstore.trainer import checkpoint

    store, run = tmp_path / "onpolicy", tmp_path / "run"
    args = ["rounds", "--prompts", prompts, "--prompt-column", "prompt", "--store", store, "--out", run]
    sizes = ["--rounds", 2, "--steps-per-round", 2, "--generate", 8, "--max-length", 64, "--seq-len", 32]
    result = CliRunner().invoke(app, [*map(str, [*args, *sizes, "--micro-batch", 1]), "--json"])
    assert result.exit_code == 0, result.stderr + result.stdout
    first, second = json.loads(result.stdout)
    versions = [first["version"], second["version"]]
    assert versions[0] != versions[1] and second["train"]["step"] == 4
    state = checkpoint.train_state(checkpoint.latest(run))
    assert (state["step"], state["snapshot"], state["versions"]) == (4, versions[1], versions)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["versions"] for s in lines if s.get("event") == "start"] == [versions[:1], versions]
    assert [(r["step"], r["version"]) for r in lines if "step" in r] == [
        (1, versions[0]),
        (2, versions[0]),
        (3, versions[1]),
        (4, versions[1]),
    ]
    record = second["build"]["generation"]
    assert (record["round"], record["generator"]["run"], record["generator"]["step"]) == (2, str(run.resolve()), 2)
    view = logitstore.open(str(store), "round-2")  # round 2's answers replaced round 1's
    assert set(view.index["sample_id"].to_pylist()) == {f"{p}/g0" for p in PROMPTS}
    assert {generation_of(h) for h in view.index["source_hash"].to_pylist()} == {record["id"]}
    assert len(logitstore.open(str(store), "round-1").generations()) == 1 and len(view.generations()) == 2
    resume = ["train", "--out", str(run), "--resume", "--new-version"]
    refused = CliRunner().invoke(app, resume)
    assert refused.exit_code == 2 and "give --version" in refused.stderr
    refused = CliRunner().invoke(app, [*resume, "--version", "round-1"])  # the run is at step 4 already
    assert refused.exit_code == 2 and "larger --steps" in refused.stderr


def test_vllm_generation_plans_one_seeded_request_per_answer():
    """vLLM's generator, as far as it runs without vLLM: its engine arguments and its requests."""
    from logitstore.pipelines.engines.vllm.engine import sampling_arguments
    from logitstore.pipelines.engines.vllm.hardware import CPU, CUDA, plan_generation

    seeds = [seed_of(3, "a", 0), seed_of(3, "a", 1)]
    requests = sampling_arguments(seeds, max_new_tokens=16, temperature=0.7, top_p=0.9, stop_ids=[2])
    assert [r["seed"] for r in requests] == seeds and seeds[0] != seeds[1]
    assert requests[0] == {
        "n": 1,
        "max_tokens": 16,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": seeds[0],
        "stop_token_ids": [2],
        "detokenize": False,
    }
    common = dict(model="m", dtype="bfloat16", tensor_parallel=1, max_length=2048, batch_tokens=8192)
    gpu = plan_generation(**common, platform=CUDA).llm
    assert (gpu["max_model_len"], gpu["max_num_batched_tokens"], gpu["gpu_memory_utilization"]) == (2048, 8192, 0.4)
    cpu = plan_generation(**common, platform=dataclasses.replace(CPU, kv_cache_bytes=1 << 30)).llm
    assert cpu["enforce_eager"] and cpu["kv_cache_memory_bytes"] == 1 << 30 and "gpu_memory_utilization" not in cpu
