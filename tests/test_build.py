"""Stage one end to end with the real default teacher: stored entries equal a dense reference,
resuming after a kill duplicates nothing, and the worker count never changes what is stored."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.format.grid import GRIDS
from logitstore.format.sparsity import Sparsity
from logitstore.pipelines.build import BuildConfig, run_build
from logitstore.pipelines.engines.torch_engine import load_teacher_once
from logitstore.pipelines.teacher import resolve_teacher
from logitstore.store.store import Store
from logitstore.testing.cli import CLI, sample_corpus_head, without_progress

MAX_LENGTH = 64
UNIT_TOKENS = 128


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """~450 teacher tokens of real prose: three documents of the sample corpus, cut short."""
    return sample_corpus_head(tmp_path_factory.mktemp("data") / "small.jsonl", docs=3, chars=600)


def build(store, data, **kwargs):
    cfg = dict(
        store=str(store),
        data=str(data),
        id_column="id",
        max_length=MAX_LENGTH,
        unit_tokens=UNIT_TOKENS,
        sparsity=Sparsity(k=64),
        progress=False,
    )  # top-64: the dense-reference test checks exact entries
    return run_build(BuildConfig(**{**cfg, **kwargs}), log=lambda _: None)


@pytest.fixture(scope="module")
def built(small_data, tmp_path_factory):
    store = tmp_path_factory.mktemp("built") / "store"
    return store, build(store, small_data)


def hashes(store) -> dict[str, str]:
    index = Store.open(str(store)).read().index
    return dict(zip(index["sample_id"].to_pylist(), index["content_hash"].to_pylist()))


def assert_same_samples(store, reference) -> None:
    """The same samples with the same tokens, entry ids and counts; each stored log-probability
    equal or one grid step away, the tails equal to float error. A worker process runs torch on one thread
    (workers.py), so its matmuls sum in another order than the two threads of an in-process build, and
    a value within float rounding of a grid boundary may take the neighbouring code (seen: 1 of 3,776
    entries on this test's data, 2026-11-25). Builds with the same worker count are byte-identical."""
    got, want = Store.open(str(store)).read(), Store.open(str(reference)).read()
    ids = sorted(want.index["sample_id"].to_pylist())
    assert sorted(got.index["sample_id"].to_pylist()) == ids
    grid = got.teachers[next(iter(got.teachers))].codec
    for sample_id in ids:
        a, b = got.sample(sample_id), want.sample(sample_id)
        for name in ("input_ids", "n_entries", "entry_ids", "entry_counts"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), (sample_id, name)
        for name in ("entry_logprobs", "target_logprobs"):
            got_values, want_values = getattr(a, name), getattr(b, name)
            step = np.where(want_values < grid.coarse_below, grid.coarse_step, grid.fine_step)
            assert (got_values != want_values).mean() < 0.01, (sample_id, name)
            assert (np.abs(got_values - want_values) <= step * 1.01).all(), (sample_id, name)
        assert np.allclose(a.tail, b.tail, rtol=1e-2, atol=1e-5), sample_id


def test_stored_entries_equal_a_dense_reference(built):
    store, summary = built
    view = Store.open(str(store)).read()
    assert summary.samples == view.index.num_rows > 3 and summary.version == view.snapshot_id
    assert "#w1" in " ".join(view.index["sample_id"].to_pylist())  # long documents were windowed
    params = view.teachers[summary.teacher].codec
    model = load_teacher_once(resolve_teacher(None), "cpu", "auto").model  # the build's own load
    for sample_id in view.index["sample_id"].to_pylist():
        s = view.sample(sample_id)
        with torch.inference_mode():
            ref = model(torch.as_tensor(s.input_ids)[None]).logits[0, :-1].double().log_softmax(-1).numpy()
        ids = s.entry_ids.reshape(-1, 64)
        lp = s.entry_logprobs.reshape(-1, 64)
        ref_sorted = -np.sort(-ref, axis=1)
        kth = ref_sorted[:, 63]
        ref_at = np.take_along_axis(ref, ids, axis=1)
        assert (ref_at >= kth[:, None] - 1e-4).all(), "an entry outside the reference top-64 (beyond ties)"
        limit = np.where(ref_at >= params.coarse_below, params.error_bound_fine, params.error_bound) + 1e-4
        assert (np.abs(lp - ref_at) <= limit).all()
        target = ref[np.arange(len(ref)), s.input_ids[1:]]
        assert np.allclose(s.target_logprobs, target, atol=params.error_bound + 1e-4)
        ref_tail = -np.expm1(np.logaddexp.reduce(ref_sorted[:, :64], axis=1))
        assert np.allclose(np.log(s.tail), np.log(ref_tail), atol=params.error_bound + 1e-3)


def test_cli_build_json_summary_and_sparsity_modes(small_data, tmp_path):
    runner = CliRunner()
    cases = (
        (["--top-p", "0.8", "--top-k", "16", "--value-grid", "coarse"], "topp"),
        (["--sample", "8"], "sampled"),
        ([], "sampled"),
    )  # no sparsity flag: the default, 16 draws (README "Choosing a budget")
    for i, (extra, check) in enumerate(cases):
        store = tmp_path / f"{check}-{i}"
        result = runner.invoke(
            app, ["build", "--data", str(small_data), "--store", str(store), "--max-length", "64", "--json", *extra]
        )
        assert result.exit_code == 0, result.stderr
        summary = json.loads(result.stdout)
        assert {"samples", "tokens", "skipped", "seconds", "tokens_per_second", "bytes_per_token", "version"} <= set(
            summary
        )
        view = Store.open(str(store)).read()
        assert view.teachers["smollm2-135m-instruct"].sparsity.mode == check
        grid = "coarse" if "--value-grid" in extra else "default"
        assert view.teachers["smollm2-135m-instruct"].codec == GRIDS[grid]
        s = view.sample(view.index["sample_id"][0].as_py())
        mass = np.add.reduceat(np.exp(s.entry_logprobs.astype(np.float64)), s.entry_offsets[:-1])
        if check == "topp":
            assert s.n_entries.max() <= 16 and s.n_entries.min() >= 1 and len(set(s.n_entries.tolist())) > 1
            assert ((mass >= 0.8 - 0.05) | (s.n_entries == 16)).all()
        else:
            draws = 8 if extra else 16
            assert view.teachers["smollm2-135m-instruct"].sparsity.n == draws
            assert (np.add.reduceat(s.entry_counts, s.entry_offsets[:-1]) == draws).all()
        assert np.allclose(mass + s.tail, 1, atol=0.05)


@pytest.mark.slow
def test_two_worker_processes_write_the_same_bytes(built, small_data, tmp_path):
    store, _ = built
    summary = build(tmp_path / "two", small_data, workers=2)
    assert summary.samples == len(hashes(store))
    assert_same_samples(tmp_path / "two", store)


@pytest.mark.slow
def test_ray_local_cluster_with_two_actors(built, small_data, tmp_path):
    pytest.importorskip("ray")
    store, _ = built
    build(tmp_path / "ray", small_data, workers=2, ray_address="local")
    assert_same_samples(tmp_path / "ray", store)


@pytest.mark.slow
def test_killed_build_resumes_without_recomputing_or_duplicating(built, small_data, tmp_path):
    reference, _ = built
    store = tmp_path / "store"
    command = [*CLI, "build", "--data", str(small_data), "--store", str(store), "--id-column", "id"]
    command += [
        "--max-length",
        str(MAX_LENGTH),
        "--unit-tokens",
        str(UNIT_TOKENS),
        "--top-k",
        "64",
        "--commit-every",
        "0.001",
    ]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and child.poll() is None:
        if store.exists() and _samples(store) > 0:
            break
        time.sleep(0.2)
    child.send_signal(signal.SIGKILL)
    child.wait()
    partial = _samples(store)
    assert 0 < partial < len(hashes(reference)), "the kill should land between checkpoints"
    summary = build(store, small_data)
    assert summary.already_stored == partial and summary.samples == len(hashes(reference)) - partial
    assert hashes(store) == hashes(reference)


def _samples(store) -> int:
    try:
        return Store.open(str(store)).read().index.num_rows
    except Exception:
        return 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--text-column", "nope"], "nope"),
        (["--teacher", "/no/such/model"], "no such file or directory"),
        (["--top-k", "100000"], "larger than the teacher's vocabulary"),
        (["--max-length", "1"], "--max-length"),
        (["--top-p", "1.5"], "--top-p"),
        (["--value-grid", "tiny"], "'tiny' is not one of"),
    ],
)
def test_bad_build_input_is_one_clear_line(small_data, tmp_path, args, message):
    result = CliRunner().invoke(app, ["build", "--data", str(small_data), "--store", str(tmp_path / "s"), *args])
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("content, message", [(b'{"text": "   "}\n', "empty"), (b'{"text": "ok \xff\xfe"}\n', "UTF-8")])
def test_bad_rows_are_refused_and_the_store_is_unchanged(built, tmp_path, content, message):
    store, _ = built
    before = Store.open(str(store)).resolve()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    result = CliRunner().invoke(app, ["build", "--data", str(bad), "--store", str(store), "--top-k", "64"])
    assert result.exit_code == 2 and message in result.stderr
    assert Store.open(str(store)).resolve() == before


def test_a_build_failing_after_the_teacher_loads_leaves_no_store_or_branch(built, tmp_path):
    # The 70th row is bad: past the rows checked before the teacher loads, so it fails in planning.
    bad = tmp_path / "late.jsonl"
    bad.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(69)) + '{"text": " "}\n')
    result = CliRunner().invoke(app, ["build", "--data", str(bad), "--store", str(tmp_path / "new")])
    assert result.exit_code == 2 and "empty" in result.stderr and not (tmp_path / "new").exists()
    store, _ = built
    result = CliRunner().invoke(
        app, ["build", "--data", str(bad), "--store", str(store), "--top-k", "64", "--branch", "trial"]
    )
    assert result.exit_code == 2 and "trial" not in Store.open(str(store)).branches()


def test_a_store_of_another_teacher_is_refused(built, small_data):
    store, _ = built
    before = Store.open(str(store)).resolve()
    result = CliRunner().invoke(app, ["build", "--data", str(small_data), "--store", str(store), "--top-k", "8"])
    assert result.exit_code == 2 and "sparsity" in result.stderr
    assert Store.open(str(store)).resolve() == before


@pytest.mark.parametrize("teacher", ["tiny", "default"])  # a Hugging Face folder; the default teacher, a GGUF file
def test_the_vllm_engine_here_is_one_line_and_writes_nothing(small_data, tiny_teacher, tmp_path, teacher):
    vllm = [
        "build",
        "--data",
        str(small_data),
        "--store",
        str(tmp_path / "s"),
        *"--engine vllm --max-length 128".split(),
    ]
    result = CliRunner().invoke(app, [*vllm, "--teacher", tiny_teacher if teacher == "tiny" else teacher])
    message = "needs vLLM: pip install 'logitstore[vllm]'"  # on a machine without vLLM
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert len(without_progress(result.stderr).splitlines()) == 1 and not (tmp_path / "s").exists()
    result = CliRunner().invoke(app, [*vllm, "--teacher", tiny_teacher, "--vllm-output", "logprobs", "--sample", "16"])
    assert result.exit_code == 2 and "cannot store --sample" in result.stderr and not (tmp_path / "s").exists()


def test_a_teacher_keeps_one_engine_and_dtype(small_data, tiny_teacher, tmp_path):
    # The teacher's metadata records engine, dtype and engine version; a build of the same teacher in
    # another dtype is refused (store unchanged) unless it is stored under another name.
    store = str(tmp_path / "s")
    first = [
        "build",
        "--data",
        str(small_data),
        "--store",
        store,
        "--teacher",
        tiny_teacher,
        *"--top-k 8 --max-length 128".split(),
    ]
    assert CliRunner().invoke(app, first).exit_code == 0
    before = Store.open(store).resolve()
    result = CliRunner().invoke(app, [*first, "--dtype", "bfloat16"])
    assert result.exit_code == 2 and "computed by the torch engine in float32" in result.stderr
    assert "--teacher-name" in result.stderr and Store.open(store).resolve() == before
    result = CliRunner().invoke(app, [*first, "--dtype", "bfloat16", "--teacher-name", "tiny-bf16"])
    assert result.exit_code == 0, result.stderr
    teachers = {t["name"]: t for t in json.loads(CliRunner().invoke(app, ["info", store, "--json"]).stdout)["teachers"]}
    assert {name: (t["engine"], t["dtype"]) for name, t in teachers.items()} == {
        "tiny-teacher": ("torch", "float32"),
        "tiny-bf16": ("torch", "bfloat16"),
    }
    assert teachers["tiny-bf16"]["engine_version"].startswith(f"torch {torch.__version__}")
    text = CliRunner().invoke(app, ["info", store]).stdout
    assert "torch engine in float32" in text and "torch engine in bfloat16" in text


def test_show_decodes_tokens_with_the_stored_tokenizer(built):
    store, _ = built
    sample_id = Store.open(str(store)).read().index["sample_id"][0].as_py()
    result = CliRunner().invoke(app, ["show", str(store), sample_id, "--json"])
    assert result.exit_code == 0, result.stderr
    obj = json.loads(result.stdout)
    assert len(obj["tokens"]) == len(obj["input_ids"]) and len(obj["entry_tokens"]) == len(obj["positions"])
    assert any(t.startswith(" ") for t in obj["tokens"]) and not any("Ġ" in t for t in obj["tokens"])


def test_the_in_process_executor_overlaps_units_keeps_their_order_and_raises_their_errors(monkeypatch):
    """Units run in `OVERLAP` threads (a write beside the next forward pass); the driver still gets
    them in input order, and a unit's error reaches it after the units before it."""
    import threading

    from logitstore.errors import LogitstoreError
    from logitstore.pipelines import workers

    running, most, closed = [0], [0], []
    lock = threading.Lock()

    class Worker:
        def __init__(self, settings, *, hand_over=None):
            pass

        def close(self):
            closed.append(running[0])  # after the pool: no unit is running any more

        def process(self, unit, writer):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.02 * (unit.index % 3 == 0))  # some finish out of order
            with lock:
                running[0] -= 1
            if unit.index == 5:
                raise LogitstoreError("unit 5 failed")
            return writer, unit

    class Writer:
        def fork(self):
            return "fork"

    monkeypatch.setattr(workers, "TeacherWorker", Worker)
    executor = workers.InProcessExecutor(settings=None)
    got = []
    with pytest.raises(LogitstoreError, match="unit 5 failed"):
        for _written, unit in executor.map(
            (workers.Unit(index=i) for i in range(8)), writer_for=Writer, max_in_flight=2
        ):
            got.append(unit.index)
    executor.close()
    assert got == [0, 1, 2, 3, 4] and 1 < most[0] <= workers.OVERLAP
    assert closed == [0]  # the engine closed once, after its last unit


def test_the_input_is_checked_before_the_teacher_even_when_the_teacher_loads_beside_the_planning(tmp_path):
    """The torch engine loads its teacher in a thread while the build plans; a build whose input and teacher
    are both wrong still names the input first, as a build that loads the teacher afterwards does."""
    from logitstore.pipelines.inputs import DataError

    cfg = BuildConfig(store=str(tmp_path / "store"), data=str(tmp_path / "missing.jsonl"), teacher=str(tmp_path / "no"))
    with pytest.raises(DataError, match="missing.jsonl"):
        run_build(cfg, log=lambda _: None)
    assert not (tmp_path / "store").exists()
