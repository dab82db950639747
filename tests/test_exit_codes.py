"""Exit codes you can script against (issue 29): one regression test per defect found by the second
adversarial pass, each named after what broke. The exit codes themselves are docs/exit-codes.md."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from benchmarks.synthetic import random_samples
from logitstore.errors import InvalidSampleError
from logitstore.store.store import Store
from logitstore.store.verify import verify
from tests.conftest import CLI, run_in_child, sample_corpus_head, small_build
from tests.test_faults import trainer_view
from tests.test_safety import LONG, OTHER, build, index_of, jsonl, one_line_error, run, write_store

ROOT = Path(__file__).resolve().parent.parent

# -- 1. a replacement whose new text yields no window ------------------------------------------------


def test_replacing_a_document_with_text_too_short_for_a_window_removes_the_old_text(tiny_teacher, tmp_path):
    store = tmp_path / "store"
    first = [{"id": "d1", "text": "short replacement text for d1"}, {"id": "d2", "text": "another document here"}]
    assert build(tiny_teacher, store, jsonl(tmp_path / "a.jsonl", first)).exit_code == 0
    assert "d1" in index_of(store)
    second = [{"id": "d1", "text": "x"}, {"id": "d2", "text": "another document here"}]
    result = build(tiny_teacher, store, jsonl(tmp_path / "b.jsonl", second), "--on-duplicate", "replace")
    summary = json.loads(result.stdout)
    assert result.exit_code == 0 and summary["changed"] == 1 and summary["skipped"] == 1
    assert summary["commits"] == 1  # was: 0, the removal queued on a unit that was never computed
    assert "d1" not in index_of(store) and "d2" in index_of(store)
    error = one_line_error(run("show", store, "d1"), 2)
    assert "d1" in error


# -- 2. an object the snapshot lists but storage lacks is damage, not an outage ------------------------


def delete_largest_chunk(uri: str) -> None:
    """Delete the largest chunk object (a part's entries) behind Icechunk's back: on disk or on S3."""
    if uri.startswith("s3://"):
        import boto3

        bucket, prefix = uri[len("s3://") :].split("/", 1)
        s3 = boto3.client("s3")
        objects = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/chunks/")["Contents"]
        s3.delete_object(Bucket=bucket, Key=max(objects, key=lambda o: o["Size"])["Key"])
    else:
        max(Path(uri, "chunks").iterdir(), key=lambda p: p.stat().st_size).unlink()


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_missing_chunk_is_damage_that_verify_names_and_train_can_skip(backend, tmp_path, request):
    from logitstore.streaming.spec import StreamSpec
    from logitstore.streaming.stream import store_stream

    if backend == "s3":
        request.getfixturevalue("s3_endpoint")
        uri = f"s3://logitstore-test/{uuid.uuid4().hex[:12]}"
    else:
        uri = str(tmp_path / "store")
    view = trainer_view(uri)
    delete_largest_chunk(uri)

    result = run("verify", uri)
    assert result.exit_code == 1, (result.stdout, result.stderr)  # was: 2, "storage failed ... No such file"
    damaged = [line for line in result.stderr.splitlines() if line.startswith("damaged: teacher-a/doc-")]
    assert damaged and all("a stored object is missing" in line for line in damaged), result.stderr
    error = one_line_error(run("show", uri, damaged[0].split("/")[1].split(":")[0]), 1)
    assert "a stored object is missing" in error

    stream = store_stream(view, StreamSpec(seq_len=32, micro_batch=4, rank=0, world_size=1, seed=1, on_error="skip"))
    try:
        batches = [next(iter_) for iter_ in [iter(stream)] for _ in range(stream.steps_per_epoch)]
    finally:
        stream.close()
    assert batches and 0 < stream.skipped_samples < 24  # was: StorageError, whatever --on-error said


# -- 3. every check that the store and the flags allow, before --out is claimed ---------------------------


@pytest.fixture(scope="module")
def chat_store(tiny_teacher, tmp_path_factory) -> str:
    """The shipped chat sample, distilled by the tiny teacher for the completion only (the default)."""
    store = str(tmp_path_factory.mktemp("chat") / "store")
    result = run(
        "build", "--teacher", tiny_teacher, "--store", store, "--chat-column", "messages", "--max-length", "64"
    )
    assert result.exit_code == 0, result.stderr
    return store


def test_train_refusals_that_need_the_store_come_before_out_is_claimed(chat_store, tmp_path):
    base = ["train", "--store", chat_store, "--steps", "1", "--seq-len", "32", "--micro-batch", "2"]
    cases = [
        (["--train-on", "prompt+completion"], "holds entries for completion tokens only"),
        (["--memory-budget", "1KB"], "smaller than two parts"),
        (["--micro-batch", "100000"], "fewer than one micro-batch"),
    ]
    for k, (args, message) in enumerate(cases):
        out = tmp_path / f"run{k}"
        error = one_line_error(run(*base, "--out", out, *args), 2)
        assert message in error, error
        assert not out.exists()  # was: claimed, so the corrected command was refused
    result = run(*base, "--out", tmp_path / "run0", "--eval-fraction", "0")  # the corrected command
    assert result.exit_code == 0, result.stderr


# -- 4. no abort at exit: every command that touches a store, 200 times ------------------------------------


# Icechunk requests still in flight when the interpreter exits: their results are handed over by tokio
# threads while Python finalizes, the race behind the aborts, made frequent (7 of 30 runs aborted).
IN_FLIGHT_AT_EXIT = """
import asyncio, sys
import icechunk
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
import logitstore.storage.bounded  # what every logitstore process imports: it registers bounded.settle at exit

store = icechunk.Repository.open(icechunk.local_filesystem_storage(sys.argv[1])).readonly_session(branch="main").store

async def start():
    for _ in range(200):
        asyncio.get_running_loop().create_task(store.get("zarr.json", default_buffer_prototype()))

sync(start())
"""


def test_icechunk_requests_in_flight_at_exit_do_not_abort_the_process(tmp_path):
    uri = str(tmp_path / "store")
    write_store(uri, n=2)
    for _ in range(20):
        done = subprocess.run([sys.executable, "-c", IN_FLIGHT_AT_EXIT, uri], capture_output=True, text=True)
        assert done.returncode == 0, (done.returncode, done.stderr[-1000:])  # was: -6 (SIGABRT) or -11


@pytest.mark.slow
def test_every_command_that_touches_a_store_exits_0_in_200_runs(tiny_teacher, tmp_path):
    """Was: `tag` exited 134 (SIGABRT at interpreter exit, after printing `tagged ...`) in ~1 run of 25
    with four at once on 2 cores: an Icechunk thread handing over a result while Python finalized
    (`bounded.settle`); then `ls` exited 134 in ~2 runs of 100 (Arrow's thread pool dropping a buffer that
    held Python bytes, `index._arrow_owned`). The runs are forked from one interpreter that imported logitstore once
    (tests/exit_stress.py), two at a time."""
    data = sample_corpus_head(tmp_path / "data.jsonl", docs=4, chars=300)
    store = str(tmp_path / "store")
    assert subprocess.run([*CLI, *small_build(tiny_teacher, store, data)], capture_output=True).returncode == 0
    first = json.loads(run("log", store, "--json").stdout)[-1]["id"]
    sample = json.loads(run("ls", store, "--json").stdout)[0]["sample_id"]
    light = {
        "info": ["info", store],
        "ls": ["ls", store],
        "show": ["show", store, sample],
        "log": ["log", store],
        "diff": ["diff", store, first, "main"],
        "tag": ["tag", store, "t{i}"],
        "verify": ["verify", store],
    }
    heavy = {
        "build": small_build(tiny_teacher, f"{tmp_path}/built-{{i}}", data),
        "train": [
            *("train", "--store", store, "--out", f"{tmp_path}/run-{{i}}", "--steps", "1"),
            *("--seq-len", "32", "--micro-batch", "1", "--eval-fraction", "0"),
        ],
        "eval": ["eval", "--store", store, "--student", "llama-tiny", "--seq-len", "32", "--eval-fraction", "1"],
    }
    # What the commands import, imported once before the forks; torch only where the commands need it
    # (a process with torch and transformers loaded takes seconds longer to tear down).
    # pandas: what pyarrow imports on its first conversion of Python objects; numba: the kernels' compiler
    store_modules = [
        "pandas",
        "numba",
        "logitstore.cli.app",
        "logitstore.store.store",
        "logitstore.store.verify",
        "logitstore.store.show",
    ]
    torch_modules = [
        *store_modules,
        "logitstore.pipelines.build",
        "logitstore.pipelines.teacher",
        "logitstore.trainer.train",
        "transformers.models.llama.modeling_llama",  # what build and train load lazily
        "matplotlib.pyplot",
    ]
    for commands, modules in [(light, store_modules), (heavy, torch_modules)]:
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"runs": 200, "parallel": 2, "imports": modules, "commands": commands}))
        done = subprocess.run(
            [sys.executable, "-m", "tests.exit_stress", str(spec)], capture_output=True, text=True, cwd=ROOT
        )
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout)
        assert {name: r["failed"] for name, r in report.items() if r["failed"]} == {}


# -- 5. what a commit holds: no double count, no orphaned parts, no empty commits ---------------------------


def test_a_write_whose_samples_a_concurrent_writer_committed_first_commits_nothing(tmp_path):
    store = write_store(str(tmp_path / "store"), n=3)
    samples = random_samples(["new-0", "new-1"], seed=5, max_tokens=30, k=8)
    first, second = (store.writer(on_duplicate="skip") for _ in range(2))  # both on the same base
    for writer in (first, second):
        assert writer.merge(write_part(writer, samples)) == 2
    first.commit("first")
    versions = len(store.log())
    second.commit("second")  # rebases onto the first, whose commit holds both samples
    assert second.result is not None and not second.result.committed  # was: a commit adding nothing
    assert (second.result.samples, second.result.dropped) == (0, 2)
    assert len(store.log()) == versions
    later = store.writer(on_duplicate="skip")  # a build's next checkpoint transaction
    assert later.merge(write_part(later, samples)) == 0 and not later.has_changes  # was: an empty commit
    report = verify(store.read())
    assert report.ok and report.unreferenced == {}


def write_part(writer, samples):
    """A part written through a fork, as a build's worker writes it."""
    return writer.fork().write(samples, teacher="teacher-a")


def test_two_concurrent_builds_count_what_their_commits_hold(tiny_teacher, tmp_path):
    rows = [{"id": f"d{i}", "text": f"Document {i}: " + LONG[: 60 + 20 * i]} for i in range(6)]
    data = jsonl(tmp_path / "d.jsonl", rows)
    store = tmp_path / "store"
    command = [*CLI, *small_build(tiny_teacher, store, data, "--commit-every", "0.001", "--json")]
    children = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    summaries = []
    for child in children:
        out, err = child.communicate(timeout=240)
        assert child.returncode == 0, err[-2000:]
        summaries.append(json.loads(out))
    stored = Store.open(str(store)).read().index.num_rows
    assert sum(s["samples"] for s in summaries) == stored  # was: both counted what the first one stored
    counts = [v.samples or 0 for v in reversed(Store.open(str(store)).log())]  # the first: the empty store
    assert all(b > a for a, b in zip(counts, counts[1:])), counts  # every commit adds samples
    assert verify(Store.open(str(store)).read()).unreferenced == {}


# -- 6. a store path that is a regular file ---------------------------------------------------------------


def test_a_store_path_that_is_a_file_is_one_line_before_any_model_loads(tiny_teacher, tmp_path):
    path = tmp_path / "not-a-store"
    path.write_text("a file")
    for args in (["info", path], ["tag", path, "v1"], ["ls", f"file://{path}"]):
        error = one_line_error(run(*args), 2)  # was: a panic in Icechunk's Rust code, then exit 2
        assert "is a file, not a store folder" in error and "panicked" not in error, error
    data = jsonl(tmp_path / "d.jsonl", [{"id": "d", "text": LONG}])
    status, stderr = run_in_child("build", "--store", path / "sub", "--teacher", tiny_teacher, "--data", data)
    assert status == ["2", "False", "False"], (status, stderr)  # was: the teacher loaded first
    assert stderr.strip().splitlines() == [
        f"error: {path / 'sub'} lies under {path}, which is a file, not a store folder; give a folder's path"
    ]
    assert path.read_text() == "a file"


# -- 7. progress on long documents ----------------------------------------------------------------------------


def test_progress_counts_a_long_documents_windows_as_soon_as_it_is_tokenized(tiny_teacher, tmp_path):
    data = jsonl(tmp_path / "long.jsonl", [{"id": "long", "text": LONG * 12}])
    result = subprocess.run(
        [*CLI, *small_build(tiny_teacher, tmp_path / "store", data, "--batch-tokens", "64", "--json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    total = json.loads(result.stdout)["tokens"]
    lines = [line for line in result.stderr.splitlines() if line.startswith("build: ") and "tokens/s" in line]
    first = lines[0]  # at the first teacher batch, one unit of many into the one document
    assert first.split()[1] != f"{total:,}" and f" of ~{total:,} tokens" in first, (first, total)  # was: no total


def test_progress_lines_come_on_a_clock_while_the_input_is_tokenized():
    from logitstore.pipelines.build import BuildConfig, Planned, Progress

    lines: list[str] = []
    planned = Planned()
    progress = Progress(BuildConfig(store="memory://p"), log=lines.append, every=0.05, planned=planned)
    try:
        for _ in range(600):  # no batch, no unit: the clock alone prints (was: silence until the first batch)
            if lines:
                break
            time.sleep(0.05)
    finally:
        progress.close()
    assert lines and lines[0].startswith("build: 0 tokens") and lines[0].endswith("; reading and tokenizing the input")


def test_a_document_too_large_to_tokenize_whole_is_refused_in_one_line(tiny_teacher, tmp_path, monkeypatch):
    from logitstore.pipelines import plan

    monkeypatch.setattr(plan, "MAX_DOCUMENT_CHARS", 1000)
    data = jsonl(tmp_path / "d.jsonl", [{"id": "small", "text": "short"}, {"id": "huge", "text": "word " * 400}])
    error = one_line_error(build(tiny_teacher, tmp_path / "store", data), 2)
    assert "document 'huge' (input row 1) has 2,000 characters, more than the 1,000" in error, error
    assert not (tmp_path / "store").exists()


# -- 8. chat turns that carry tool calls ------------------------------------------------------------------------

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "18 degrees and sunny"},
    {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."},
]
PLAIN_CHAT = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there!"}]
# ChatML that renders an assistant's tool calls, as tool-calling templates do
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_calls_are_rendered_by_a_template_that_reads_them_or_skipped_and_counted(tiny_teacher, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from logitstore.text import chat

    null_content = [{**m, "content": None} if m.get("tool_calls") else m for m in TOOL_CHAT]  # OpenAI's form
    rows = [{"id": "tool", "messages": TOOL_CHAT}, {"id": "null", "messages": null_content}]
    data = jsonl(tmp_path / "chat.jsonl", [*rows, {"id": "plain", "messages": PLAIN_CHAT}])
    args = ["--chat-column", "messages", "--json"]
    result = build(tiny_teacher, tmp_path / "plain-template", data, *args)  # SmolLM2's template: no tool calls
    summary = json.loads(result.stdout)
    assert result.exit_code == 0 and summary["tool_calls"] == 2, result.stderr  # was: an empty reply, no word
    assert documents_in(tmp_path / "plain-template") == {"plain"}

    teacher = tmp_path / "tool-teacher"
    shutil.copytree(tiny_teacher, teacher)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(teacher)
    messages = chat.as_messages(TOOL_CHAT)
    text, spans = chat.render(tokenizer, messages)
    replies = [text[a:b] for a, b in spans]
    assert replies[0].startswith('<tool_call>{"name": "get_weather"') and "Paris" in replies[0]  # supervised
    result = build(str(teacher), tmp_path / "tool-template", data, *args)
    assert result.exit_code == 0 and json.loads(result.stdout)["tool_calls"] == 0, result.stderr
    assert documents_in(tmp_path / "tool-template") == {"tool", "null", "plain"}


def documents_in(store) -> set[str]:
    return {sample_id.split("#")[0] for sample_id in index_of(store)}


# -- 9. control characters in ids -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["line\nbreak", "nul\x00id", "tab\there", "del\x7f"])
def test_an_id_with_a_control_character_is_refused_naming_its_row(tiny_teacher, tmp_path, bad):
    data = jsonl(tmp_path / "d.jsonl", [{"id": "fine", "text": LONG}, {"id": bad, "text": OTHER}])
    error = one_line_error(build(tiny_teacher, tmp_path / "store", data), 2)  # was: stored, ls printed it raw
    assert "row 1" in error and "control character" in error and bad not in error, error
    assert not (tmp_path / "store").exists()
    samples = random_samples([bad], max_tokens=10)
    with pytest.raises(InvalidSampleError, match="without control characters"):
        samples.validate(vocab_size=1000)


# -- 10. the smaller ones ------------------------------------------------------------------------------------------


def test_build_json_names_its_teacher_and_an_input_with_nothing_to_store_makes_no_store(tiny_teacher, tmp_path):
    result = build(tiny_teacher, tmp_path / "store", jsonl(tmp_path / "d.jsonl", [{"id": "d", "text": LONG}]))
    summary = json.loads(result.stdout)
    assert [t["teacher"] for t in summary["teachers"]] == ["tiny-teacher"]  # was: always []
    assert summary["teachers"][0]["samples"] == summary["samples"] > 0 and "teachers" not in summary["teachers"][0]
    for name, rows in [("empty", []), ("short", [{"id": "s", "text": "x"}])]:
        store = tmp_path / f"store-{name}"
        result = build(tiny_teacher, store, jsonl(tmp_path / f"{name}.jsonl", rows))
        summary = json.loads(result.stdout)
        assert result.exit_code == 0 and summary["commits"] == 0 and summary["version"] is None, result.stderr
        assert not store.exists()  # was: an empty store, reported as "commits 0"
    text = run(*small_build(tiny_teacher, tmp_path / "store-text", jsonl(tmp_path / "e.jsonl", [])))
    assert text.exit_code == 0 and text.stdout.startswith("nothing stored (no store or branch made): 0 samples")


# -- the exit codes: one table, kept by every command ------------------------------------------------------------


def test_the_exit_code_table_is_the_one_the_code_uses():
    from logitstore import errors

    rows = [line.split("|")[1:3] for line in (ROOT / "docs" / "exit-codes.md").read_text().splitlines()]
    table = {int(code): meaning.strip() for code, meaning in (r for r in rows if r and r[0].strip().isdigit())}
    assert table == {
        errors.OK: "ok",
        errors.DAMAGED: "damaged data",
        errors.USAGE_OR_OUTAGE: "usage error or outage",
        errors.INTERRUPTED: "interrupted",
    }
    assert errors.DamagedDataError.exit_code == errors.DAMAGED and errors.StorageError.exit_code == 2
    assert "docs/exit-codes.md" in (ROOT / "README.md").read_text()


def test_output_whose_reader_went_away_is_interrupted_not_damage(tmp_path):
    store = str(tmp_path / "store")
    write_store(store, n=12)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: `logitstore ls STORE | head -0`
    done = subprocess.run([*CLI, "ls", store], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert done.returncode == 130 and done.stderr == "", done.stderr  # was: 1, the code for damaged data


@pytest.mark.slow
def test_a_train_rank_killed_from_outside_is_one_line_exit_2(chat_store, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--store", chat_store, "--out", out, "--steps", "100000", "--seq-len", "32", "--micro-batch", "1"]
    child = subprocess.Popen(
        [*CLI, *map(str, args), "--nproc", "2", "--eval-fraction", "0"], stderr=subprocess.PIPE, text=True
    )
    for line in child.stderr:  # the ranks train: kill one of them as the OOM killer would
        if line.startswith("step "):
            ranks = [
                int(p)
                for p in subprocess.run(["pgrep", "-P", str(child.pid)], capture_output=True, text=True).stdout.split()
            ]
            os.kill(max(ranks), signal.SIGKILL)
            break
    rest = child.stderr.read()
    assert child.wait(timeout=300) == 2, rest[-2000:]  # was: a traceback, exit 1 (the code for damaged data)
    errors = [line for line in rest.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "was killed by SIGKILL" in errors[0] and "--resume" in errors[0], rest[-2000:]
    assert "Traceback" not in rest and "Terminating process" not in rest, rest[-2000:]
    # (Python's resource tracker may still warn of the killed rank's semaphores: its own line, not ours)
