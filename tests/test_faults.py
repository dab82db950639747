"""The fault matrix: storage faults mid-run against a real S3 protocol server (moto), through a TCP
proxy the test breaks (`logitstore/testing/faultproxy.py`): refused connections, a stalled endpoint, and recovery.

Every fault must end in one line (`StorageError`, exit 2) while it lasts (a watchdog lifts it long after
any deadline: the tests check that order, not the clock), with the last committed version intact; an outage is never counted as damaged data; after the endpoint comes back
the same work succeeds. Small limits keep the module fast: 1 s per attempt, one retry.
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from urllib.parse import urlparse

import boto3
import pytest
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.errors import LogitstoreError, StorageError
from logitstore.format import codec
from logitstore.storage.bounded import run, storage_errors
from logitstore.storage.limits import StorageLimits
from logitstore.store.store import Store
from logitstore.store.verify import verify
from logitstore.streaming.mixing import WeightedTeacher
from logitstore.streaming.spec import StreamSpec
from logitstore.streaming.stream import store_stream
from logitstore.testing.cli import small_build, without_progress
from logitstore.testing.faultproxy import FaultProxy
from logitstore.testing.stores import VOCAB, assert_matches, teacher, trainer_view, write
from logitstore.testing.synthetic import random_samples

LIMITS = {"LOGITSTORE_STORAGE_TIMEOUT": "1", "LOGITSTORE_STORAGE_RETRIES": "1", "LOGITSTORE_STORAGE_BACKOFF": "0.2"}
DEADLINE_S = 2 * 1 + 1 * 0.2  # attempts x timeout + retries x backoff
# How long a test's fault lasts before a watchdog lifts it: far past any deadline. The tests check the
# order (the call fails, then the fault ends), not the clock: without a deadline the call would wait for
# the fault to end and succeed (or fail after it), whatever the machine's load.
FAULT_S = 120


@contextlib.contextmanager
def failing_before_the_fault_ends(proxy):
    """The block must fail while the fault lasts; a watchdog ends the fault after FAULT_S."""
    lifted = threading.Event()
    watchdog = threading.Timer(FAULT_S, lambda: (lifted.set(), proxy.resume()))
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
    assert not lifted.is_set(), f"it waited {FAULT_S} s, until the fault ended: no deadline"


runner = CliRunner()


@pytest.fixture
def proxy(s3_endpoint, monkeypatch):
    """A proxy in front of moto, with every client of this test pointed at it and the small limits."""
    upstream = urlparse(s3_endpoint)
    with FaultProxy((upstream.hostname, upstream.port)) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
        for name, value in LIMITS.items():
            monkeypatch.setenv(name, value)
        yield p


@pytest.fixture
def uri(proxy):
    return f"s3://logitstore-test/faults-{uuid.uuid4().hex[:12]}"


def assert_one_line(error: BaseException, *, names: str) -> None:
    message = str(error)
    assert "\n" not in message and names in message, message
    assert "Traceback" not in message and len(message) < 600, message


def test_limits_come_from_the_environment(monkeypatch):
    for name in LIMITS:
        monkeypatch.delenv(name, raising=False)
    defaults = StorageLimits.from_env()
    assert 30 <= defaults.deadline_s <= 120  # a lost endpoint on real S3 fails within two minutes
    for name, value in LIMITS.items():
        monkeypatch.setenv(name, value)
    assert StorageLimits.from_env().deadline_s == pytest.approx(DEADLINE_S)
    monkeypatch.setenv("LOGITSTORE_STORAGE_RETRIES", "two")
    with pytest.raises(LogitstoreError, match="LOGITSTORE_STORAGE_RETRIES='two'"):
        StorageLimits.from_env()
    monkeypatch.setenv("LOGITSTORE_STORAGE_RETRIES", "1")
    monkeypatch.setenv("LOGITSTORE_STORAGE_TIMEOUT", "0")
    with pytest.raises(LogitstoreError, match="LOGITSTORE_STORAGE_TIMEOUT='0'"):
        StorageLimits.from_env()


@pytest.mark.parametrize(
    "module, name, base",
    [("pyo3_runtime", "PanicException", BaseException), ("pyo3_async_runtimes", "RustPanic", Exception)],
)
def test_a_panic_in_icechunk_is_a_one_line_storage_error(module, name, base):
    # Icechunk cannot be made to panic on demand, and PyO3's panic classes cannot be imported: a class
    # with the same module and name stands in (that is all `is_panic` can look at, too).
    panic = type(name, (base,), {"__module__": module})
    with pytest.raises(StorageError, match="cannot read store x: boom"):
        with storage_errors("cannot read store x"):
            raise panic("boom")

    async def panicking():
        raise panic("boom")

    with pytest.raises(StorageError, match=r"x: storage failed \(commit\): boom"):
        run(panicking, where="x", what="commit", limits=StorageLimits())


# -- writes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault_at", ["write", "commit"])
def test_refused_mid_write_is_one_line_and_the_last_version_stays(proxy, uri, fault_at):
    store = Store.open(uri, create=True)
    first, second = random_samples(["a", "b"], seed=1), random_samples(["c", "d"], seed=2)
    v1 = write(store, first, message="first")
    with store.writer() as w:
        w.add_teacher(teacher())
        if fault_at == "commit":
            w.write(second, teacher="teacher-a")
        proxy.refuse()
        with failing_before_the_fault_ends(proxy), pytest.raises(StorageError) as caught:
            if fault_at == "write":
                w.write(second, teacher="teacher-a")
            w.commit("second")
    assert_one_line(caught.value, names=uri)
    proxy.resume()
    view = Store.open(uri).read()
    assert view.snapshot_id == v1 and sorted(view.index["sample_id"].to_pylist()) == ["a", "b"]
    assert_matches(view, first)
    # the same write again, as a rerun does, now succeeds
    v2 = write(Store.open(uri), second, message="second")
    view = Store.open(uri).read()
    assert view.snapshot_id == v2 != v1 and sorted(view.index["sample_id"].to_pylist()) == ["a", "b", "c", "d"]
    assert_matches(view, second)


def test_stalled_endpoint_ends_within_the_deadline(proxy, uri):
    store = Store.open(uri, create=True)
    v1 = write(store, random_samples(["a"], seed=1), message="first")
    with store.writer() as w:
        w.add_teacher(teacher())
        proxy.stall()
        with failing_before_the_fault_ends(proxy):
            with pytest.raises(StorageError, match=f"no answer from storage within {DEADLINE_S:g} s") as caught:
                w.write(random_samples(["b"], seed=2), teacher="teacher-a")
                w.commit("second")
            assert_one_line(caught.value, names="LOGITSTORE_STORAGE_TIMEOUT")
            with pytest.raises(StorageError):  # a new command during the stall: opening fails the same way
                Store.open(uri).read()
    proxy.resume()
    assert Store.open(uri).read().snapshot_id == v1


def test_a_new_store_on_a_refusing_endpoint_is_one_line(proxy, uri):
    proxy.refuse()
    with failing_before_the_fault_ends(proxy), pytest.raises(StorageError) as caught:
        Store.open(uri, create=True)
    assert_one_line(caught.value, names=uri)


def test_endpoint_lost_mid_build_stops_it_and_a_rerun_resumes(proxy, uri, s3_endpoint, tiny_teacher, tmp_path):
    text = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. "
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"d{i}", "text": f"Document {i}. " + text * 2}) + "\n" for i in range(12))
    )
    command = small_build(tiny_teacher, uri, data, "--commit-every", "0.001", "--json")
    # The fault comes from outside, as a real one does: once the build has committed twice (its first
    # unit with the teacher, then one more), the endpoint starts refusing.
    direct = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    prefix = urlparse(uri).path.strip("/") + "/logitstore-index/"
    done = threading.Event()

    def break_after_two_commits():
        while not done.is_set():
            if direct.list_objects_v2(Bucket="logitstore-test", Prefix=prefix).get("KeyCount", 0) >= 2:
                proxy.refuse()
                return
            done.wait(0.01)

    watcher = threading.Thread(target=break_after_two_commits, daemon=True)
    watcher.start()
    try:
        result = runner.invoke(app, command)
    finally:
        done.set()
        watcher.join()
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    lines = without_progress(result.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and uri in lines[0], result.stderr
    proxy.resume()
    kept = Store.open(uri).read()
    assert 0 < kept.index.num_rows and verify(kept).ok  # the last committed version, whole
    result = runner.invoke(app, command)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    summary = json.loads(result.stdout)
    assert summary["already_stored"] == kept.index.num_rows  # the rerun skipped what was committed
    final = Store.open(uri).read()
    assert final.index.num_rows == kept.index.num_rows + summary["samples"] and verify(final).ok
    assert {s.split("#")[0] for s in final.index["sample_id"].to_pylist()} == {f"d{i}" for i in range(12)}


# -- the trainer's data stream ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, fault", [("packed", "refuse"), ("packed", "stall"), ("mixed", "refuse")])
def test_outage_in_the_data_stream_stops_it_and_skips_nothing(proxy, uri, kind, fault):
    args = dict(seq_len=32, micro_batch=4, rank=0, world_size=1, seed=1, prefetch=1, on_error="skip")
    if kind == "packed":
        view, sources = trainer_view(uri), None
    else:  # two teachers of one tokenizer: the reads of logitstore/streaming/mixing.py
        view = trainer_view(uri, teachers=("teacher-a", "teacher-b"))
        sources = [WeightedTeacher("teacher-a", 0.5, None), WeightedTeacher("teacher-b", 0.5, None)]
    # A budget of two parts: windows of one part, so the stream keeps reading from storage, as on a
    # store larger than memory (a store that fits would be read whole before the fault).
    probe = store_stream(view, StreamSpec(**args), sources=sources)
    budget = 2 * int(probe.source.part_bytes().max())
    probe.close()
    stream = store_stream(view, StreamSpec(memory_budget=budget, **args), sources=sources)
    assert stream.window_parts == 1
    batches = iter(stream)
    try:
        next(batches)
        getattr(proxy, fault)()
        with failing_before_the_fault_ends(proxy), pytest.raises(StorageError) as caught:
            for _ in range(stream.steps_per_epoch):
                next(batches)
    finally:
        stream.close()
    assert stream.skipped_samples == 0  # an outage is not damage: nothing was skipped and trained around
    assert_one_line(caught.value, names=uri)


def test_outage_while_reading_the_stored_tokenizer_for_the_final_export(proxy, uri, gpt2_tokenizer_dir):
    """What `train` reads from the store last: the tokenizer it saves beside the final model."""
    samples = random_samples(["a"], seed=1)
    tokenizer_json = (gpt2_tokenizer_dir / "tokenizer.json").read_text()  # large: its chunk is not inlined
    with Store.open(uri, create=True).writer() as w:
        w.add_teacher(
            teacher(),
            tokenizer_json=tokenizer_json,
            code_of_id=codec.frequency_id_order(samples.entry_ids, vocab_size=VOCAB),
        )
        w.write(samples, teacher="teacher-a")
        w.commit("first")
    view = Store.open(uri).read()
    proxy.stall()
    with failing_before_the_fault_ends(proxy), pytest.raises(StorageError, match="no answer from storage") as caught:
        view.tokenizer()
    assert_one_line(caught.value, names=uri)
    proxy.resume()
    assert view.tokenizer().get_vocab_size() > 50_000  # the same view reads once the endpoint is back


# -- commands that read ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, fault", [(["info"], "refuse"), (["info"], "stall"), (["show", "a"], "stall"), (["log"], "refuse")]
)
def test_reading_commands_during_an_outage_exit_2_with_one_line(proxy, uri, command, fault):
    write(Store.open(uri, create=True), random_samples(["a", "b"], seed=1))
    getattr(proxy, fault)()
    with failing_before_the_fault_ends(proxy):
        result = runner.invoke(app, [command[0], uri, *command[1:]])
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {uri}") and "Traceback" not in result.stderr, result.stderr
    proxy.resume()
    assert runner.invoke(app, [command[0], uri, *command[1:]]).exit_code == 0
