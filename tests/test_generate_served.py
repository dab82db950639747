"""`build --generate` with served models (`ServerGenerator`): the teacher on a server answering its
own prompts and scoring its answers in the same request, and a `--generator-url` whose answers a local
teacher scores. The test server (`logitstore/testing/openai_server.py`) generates with the real default
teacher through the torch engine's seeded sampler and scores with its top-k forward pass, in vLLM's JSON."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

import logitstore
from logitstore.cli.app import app
from logitstore.format.sparsity import Sparsity
from logitstore.pipelines.engines.server.completions import answer_top_logprobs, generation_request
from logitstore.pipelines.engines.server.preflight import PROBE_TEXT, answer_logprobs_are_raw
from logitstore.pipelines.engines.settings import WorkerSettings
from logitstore.pipelines.engines.shared import cut_at_stop
from logitstore.pipelines.engines.torch_engine import TorchGenerator, load_teacher_once
from logitstore.pipelines.teacher import resolve_teacher
from logitstore.testing.openai_server import Generate, OpenAIServer, Scores, render_generation
from logitstore.testing.prompts import PROMPTS, answers, write_prompts
from logitstore.testing.stores import stored
from logitstore.testing.teachers import KEY, scoring_teacher, torch_scorer

N = 8  # --generate: answers of up to 8 tokens keep each build to seconds on the real teacher


def torch_generator(spec) -> tuple[Generate, list[int]]:
    """The torch engine's `TorchGenerator` for a server, one prompt at a time (what a served teacher with a seeded
    sampler answers), and its stop tokens. A request without a seed draws a fresh one, as vLLM does."""
    settings = WorkerSettings(
        teacher_spec=spec, device="cpu", dtype="float32", sparsity=Sparsity(k=16), batch_tokens=4096, seed=0
    )
    generator = TorchGenerator(settings, spec=spec, shares_teacher=True)
    lock = threading.Lock()

    def generate(prompt: list[int], request: dict) -> list[int]:
        seed = request.get("seed")
        seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
        with lock:
            [answer] = generator.generate(
                [np.asarray(prompt)],
                [seed],
                max_new_tokens=request["max_tokens"],
                temperature=request.get("temperature", 1.0),
                top_p=request.get("top_p", 1.0),
            )
        return cut_at_stop(answer, [*generator.stop_ids, *(request.get("stop_token_ids") or [])]).tolist()

    return generate, generator.stop_ids


@pytest.fixture(scope="module")
def server():
    spec = resolve_teacher(None)
    teacher = load_teacher_once(spec, "cpu", "float32")
    generate, stops = torch_generator(spec)
    scorer = torch_scorer(teacher)
    with OpenAIServer(
        model=spec.name, scorer=scorer, tokenizer=teacher.tokenizer, max_logprobs=32, generate=generate, stop_ids=stops
    ) as s:
        yield s


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("served-prompts") / "p.jsonl", dict(list(PROMPTS.items())[:2]))


def build(store, prompts, *args, env=None):
    common = ["build", "--store", str(store), "--data", str(prompts), "--prompt-column", "prompt"]
    sizes = ["--generate", str(N), "--max-length", "48", "--top-k", "16", "--seed", "7", "--json"]
    return CliRunner().invoke(app, [*common, *sizes, *map(str, args)], env=env)


def summary(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


@pytest.fixture(scope="module")
def served_teacher(server, prompts, tmp_path_factory):
    """The teacher on the server answers its prompts; the requests it took while building."""
    store = tmp_path_factory.mktemp("served-teacher") / "s"
    before = (server.completions, server.generations)
    result = summary(build(store, prompts, "--engine", "server", "--server-url", server.url))
    return store, result, (server.completions - before[0], server.generations - before[1])


def test_a_served_teacher_scores_its_answers_in_the_generating_request(served_teacher, server, prompts, tmp_path):
    """Answers supervised and prompts not; no scoring request beyond the preflight's. A second build with the
    same seed, its answers from the same server as --generator-url and scored by the torch engine, has the
    same answers and bit-equal entries."""
    store, result, (completions, generations) = served_teacher
    assert (result["prompts"], result["answers"], generations) == (2, 2, 2)
    assert completions == generations + 1  # the preflight scores one probe; the answers need no request more
    view = logitstore.open(str(store))
    for prompt_id, text in list(PROMPTS.items())[:2]:
        s = view.sample(f"{prompt_id}/g0")
        n_answer = len(view.answer(f"{prompt_id}/g0")["token_ids"])
        n_prompt = len(s.input_ids) - n_answer
        assert 1 <= n_answer <= N and s.loss_mask.tolist() == [0] * n_prompt + [1] * n_answer
        assert (s.n_entries[: n_prompt - 1] == 0).all() and (s.n_entries[n_prompt - 1 :] > 0).all()
        assert view.answer(f"{prompt_id}/g0")["prompt_text"] == text
    record = result["generation"]
    assert (record["engine"], record["generator"]["name"], record["seed"]) == ("server", server.model, 7)
    torch_store = tmp_path / "torch"
    url = server.url.replace("http://", "http://user:secret@")  # recorded without its credentials
    local = summary(build(torch_store, prompts, "--generator-url", url, "--batch-tokens", 2))
    assert answers(torch_store) == answers(store)
    assert stored(torch_store) == stored(store)  # bit-equal entries, one sample per batch
    generator = local["generation"]["generator"]
    assert generator["server"] == {"model": server.model, "version": server.version, "urls": [server.url]}
    assert (generator["name"], generator["source"], generator["content_hash"]) == (server.model, None, None)


def test_the_key_reaches_the_generator_and_no_file_and_another_seed_other_answers(
    served_teacher, server, prompts, tmp_path
):
    """--generator-url with the server's key (LOGITSTORE_SERVER_API_KEY): every request carries it, no file of
    the store holds it; and --seed 8 gives other answers than --seed 7."""
    server.api_key, seen = KEY, len(server.keys_seen)
    try:
        env = {"LOGITSTORE_SERVER_API_KEY": KEY}
        result = summary(build(tmp_path / "s", prompts, "--generator-url", server.url, "--seed", 8, env=env))
    finally:
        server.api_key = None
    assert server.keys_seen[seen:] and all(key == f"Bearer {KEY}" for key in server.keys_seen[seen:])
    for root, _, names in os.walk(tmp_path / "s"):
        for name in names:
            assert KEY.encode() not in (Path(root) / name).read_bytes(), name
    assert result["generation"]["seed"] == 8 and answers(tmp_path / "s") != answers(served_teacher[0])
    assert result["answers"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--generator-url", "http://127.0.0.1:9"], "--generator-url http://127.0.0.1:9: cannot reach the server"),
        (["--engine", "server", "--server-url", "http://127.0.0.1:9"], "--server-url http://127.0.0.1:9"),
        (["--generator", "x", "--generator-url", "http://127.0.0.1:9"], "give one"),
    ],
)
def test_an_unreachable_generator_is_one_line_and_writes_nothing(prompts, tmp_path, args, message):
    result = build(tmp_path / "s", prompts, *args)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "s").exists()


def test_an_empty_answer_is_counted_and_not_stored(tiny_teacher, tmp_path):
    """A served generator that answers one prompt with no token: that answer is counted (`answers_empty`),
    not stored as a sample with nothing supervised; the other prompt's answer is stored."""
    spec, teacher = scoring_teacher(tiny_teacher)
    empty, other = list(PROMPTS)[:2]

    def generate(prompt: list[int], request: dict) -> list[int]:  # the other prompt: its last three tokens
        return [] if PROMPTS[empty] in teacher.tokenizer.decode(prompt) else prompt[-3:]

    data = write_prompts(tmp_path / "p.jsonl", {empty: PROMPTS[empty], other: PROMPTS[other]})
    with OpenAIServer(
        model=spec.name, scorer=torch_scorer(teacher), tokenizer=teacher.tokenizer, generate=generate
    ) as s:
        result = summary(build(tmp_path / "s", data, "--teacher", tiny_teacher, "--generator-url", s.url))
    assert logitstore.open(str(tmp_path / "s")).index["sample_id"].to_pylist() == [f"{other}/g0"]
    assert (result["answers"], result["answers_empty"], result["samples"]) == (2, 1, 1)


def test_answer_top_logprobs_read_as_the_dict_form_says():
    """The answer positions' `logprobs` read back: the chosen token first, K or K + 1 keys a position."""
    prompt, answer = [5, 6, 7], [9, 3, 11]
    ids = np.array([[6, 1, 2], [7, 1, 2], [9, 1, 2], [1, 2, 4], [11, 0, 1]])
    logprobs = np.tile(np.array([-0.5, -1.5, -2.5], dtype=np.float32), (5, 1))
    target = np.array([-0.5, -0.5, -0.5, -3.5, -0.5], dtype=np.float32)
    scores = Scores(ids, logprobs, target, np.array([1, 1, 1, 4, 1]))
    body = generation_request("m", prompt, seed=1, max_new_tokens=3, temperature=1, top_p=1, stop_ids=[2], k=3)
    request = json.loads(body)
    assert (request["seed"], request["n"], request["top_k"], request["stop_token_ids"]) == (1, 1, -1, [2])
    assert request["return_tokens_as_token_ids"] and request["return_token_ids"]
    answer_body = render_generation(prompt, answer, model="m", request=request, finish_reason="length", scores=scores)
    flat = answer_top_logprobs(answer_body, positions=3)
    assert flat.starts.tolist() == [0, 3, 7, 10]  # 9 and 11 in their top-3 (3 keys), 3 outside it (4 keys)
    assert flat.ids.tolist() == [9, 1, 2, 3, 1, 2, 4, 11, 0, 1]
    assert flat.logprobs.tolist()[3:7] == [-3.5, -0.5, -1.5, -2.5]


def test_processed_answer_logprobs_are_found_before_they_are_stored(server):
    """A server that sends the answer's log-probabilities tempered (vLLM --logprobs-mode processed_logprobs)
    is found by the generator's check, which then scores answers by a second request."""
    settings = SimpleNamespace(server_urls=(server.url,), server_api_key=None, server_timeout=30.0)
    probe = server.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    check = dict(k=8, temperature=0.7, top_p=1.0)
    assert answer_logprobs_are_raw(settings, server.model, probe, **check)
    server.logprobs_mode = "processed_logprobs"
    try:
        assert not answer_logprobs_are_raw(settings, server.model, probe, **check)
        assert answer_logprobs_are_raw(settings, server.model, probe, **{**check, "temperature": 1.0})
    finally:
        server.logprobs_mode = "raw_logprobs"
