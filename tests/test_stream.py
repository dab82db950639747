"""The stream engine (logitstore/streaming/stream.py) against its contract: determinism, rank sharding, resumption,
the window shuffle and its memory budget, packing against the store's own decoding, the train/eval
split, errors and damaged data."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import logitstore
from logitstore.errors import DamagedDataError, LogitstoreError
from logitstore.format import codec
from logitstore.format.layout import json_attr
from logitstore.store.store import Store
from logitstore.store.verify import verify
from logitstore.streaming.batch import PackedBatch
from logitstore.streaming.order import is_eval_sample
from logitstore.streaming.spec import StreamConfigError
from logitstore.streaming.stream import Stream
from logitstore.testing.stores import VOCAB
from logitstore.testing.streams import MB, SEQ, assert_same, build_store, rows_of, stream, take, windowed
from logitstore.testing.synthetic import random_samples


@pytest.fixture(scope="module")
def view():
    return build_store(f"memory://{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="module")
def sampled_view():
    return build_store(f"memory://{uuid.uuid4().hex[:12]}", n=30, parts=3, mode="sampled")


# -- determinism, sharding, resumption -----------------------------------------------------------------


def test_same_seed_same_batches_other_seed_differs(view):
    a, b, c = stream(view), stream(view, prefetch=0), stream(view, seed=2)
    first, second, other = take(a, 8), take(b, 8), take(c, 8)
    for x, y in zip(first, second):
        assert_same(x, y.to("cpu"))
    assert not all(torch.equal(x.input_ids, z.input_ids) for x, z in zip(first, other))
    assert all(x.n_tokens == MB * SEQ for x in first)  # nothing skipped, nothing padded
    for s in (a, b, c):
        s.close()


def test_ranks_split_the_global_rows(view):
    """Two ranks of a step hold, together and in rank order, the rows one process with their micro-batch
    takes, for the same reader groups; each rank takes the rows of one group."""
    one = stream(view, micro_batch=2 * MB, reader_groups=2)
    ranks = [stream(view, world_size=2, rank=r) for r in (0, 1)]  # reader groups: the world size
    assert ranks[0].steps_per_epoch == ranks[1].steps_per_epoch == one.steps_per_epoch
    steps = ranks[0].steps_per_epoch
    reference = take(one, steps)
    per_rank = [take(s, steps) for s in ranks]
    for i in range(steps):
        assert rows_of(per_rank[0][i]) + rows_of(per_rank[1][i]) == rows_of(reference[i])
    seen = [{(sid, a) for b in batches for sid, a, _, _ in b.segments} for batches in per_rank]
    assert not seen[0] & seen[1]
    assert ranks[0].state_dict() == ranks[1].state_dict()  # rows counted for all ranks together
    assert ranks[0].state_dict()["reader_groups"] == 2


def test_resume_mid_epoch_and_across_an_epoch_boundary(view):
    s = stream(view)
    n = s.steps_per_epoch - 1
    take(s, n)
    state = s.state_dict()
    assert state == {
        "epoch": 0,
        "rows_consumed": n * MB,
        "seed": 1,
        "version": view.snapshot_id,
        "window_parts": None,
        "reader_groups": 1,
    }
    expected = take(s, 3)  # the last batch of epoch 0, then epoch 1
    assert s.state_dict()["epoch"] == 1
    resumed = stream(view)
    resumed.load_state_dict(state)
    for x, y in zip(take(resumed, 3), expected):
        assert_same(x, y)


def test_resume_with_another_world_size(view):
    ranks = [stream(view, world_size=2, rank=r) for r in (0, 1)]
    for s in ranks:
        take(s, 3)
    state = ranks[0].state_dict()
    assert state["rows_consumed"] == 3 * 2 * MB
    single = stream(view)
    single.load_state_dict(state)  # takes the run's reader groups (2), not its own world size's (1)
    reference = take(stream(view, reader_groups=2), 8)
    for x, y in zip(take(single, 2), reference[6:8]):
        assert_same(x, y)


def test_load_state_refuses_another_version_or_seed(view):
    s = stream(view)
    state = s.state_dict()
    with pytest.raises(ValueError, match="version"):
        s.load_state_dict({**state, "version": "0" * 20})
    with pytest.raises(ValueError, match="seed"):
        stream(view, seed=7).load_state_dict(state)


# -- packing ---------------------------------------------------------------------------------------------


def check_batch(view, batch: PackedBatch, cache: dict) -> None:
    """Every segment against `view.sample`: tokens, positions, targets and teacher entries."""
    B, L = batch.input_ids.shape
    flat_ids, flat_pos, flat_doc = batch.input_ids.view(-1), batch.position_ids.view(-1), batch.document_ids.view(-1)
    supervised = []
    for sid, a, f, n in batch.segments:
        if sid not in cache:
            cache[sid] = view.sample(sid)
        sample = cache[sid]
        assert torch.equal(flat_ids[f : f + n], torch.from_numpy(sample.input_ids[a : a + n]))
        assert torch.equal(flat_pos[f : f + n], torch.arange(n))
        assert (flat_doc[f : f + n] == flat_doc[f]).all()
        supervised.append(np.arange(f, f + n - 1))
    # Segments tile every row, and document ids differ between the segments of a row.
    starts = sorted((f, n) for _, _, f, n in batch.segments)
    assert starts[0][0] == 0 and all(f0 + n0 == f1 for (f0, n0), (f1, _) in zip(starts, starts[1:]))
    assert starts[-1][0] + starts[-1][1] == B * L
    for row in range(B):
        firsts = [flat_doc[f].item() for _, _, f, _ in batch.segments if f // L == row]
        assert firsts == list(range(len(firsts)))
    np.testing.assert_array_equal(batch.positions.numpy(), np.concatenate(supervised))
    assert torch.equal(batch.target_ids, flat_ids[batch.positions + 1])
    assert (torch.diff(batch.entry_pos) >= 0).all()
    check_entries(batch, cache)


def by_position_and_id(ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return np.lexsort((ids, np.repeat(np.arange(len(counts)), counts)))


def check_entries(batch: PackedBatch, cache: dict) -> None:
    """Positions [p, p + n - 1) of the batch are positions [a, a + n - 1) of the segment's sample."""
    bounds = np.searchsorted(batch.entry_pos.numpy(), np.arange(len(batch.positions) + 1))
    p = 0
    for sid, a, _, n in batch.segments:
        sample, q = cache[sid], slice(a, a + n - 1)
        offsets = sample.entry_offsets
        got = slice(bounds[p], bounds[p + n - 1])
        want = slice(offsets[a], offsets[a + n - 1])
        counts = np.diff(bounds[p : p + n])
        np.testing.assert_array_equal(counts, sample.n_entries[q])
        g = by_position_and_id(batch.entry_ids[got].numpy(), counts)
        w = by_position_and_id(sample.entry_ids[want], counts)
        np.testing.assert_array_equal(batch.entry_ids[got].numpy()[g], sample.entry_ids[want][w])
        np.testing.assert_array_equal(batch.entry_logprobs[got].numpy()[g], sample.entry_logprobs[want][w])
        if sample.entry_counts is not None:
            np.testing.assert_array_equal(batch.entry_counts[got].numpy()[g], sample.entry_counts[want][w])
        np.testing.assert_array_equal(batch.tail[p : p + n - 1].numpy(), sample.tail[q])
        np.testing.assert_array_equal(batch.target_logprobs[p : p + n - 1].numpy(), sample.target_logprobs[q])
        np.testing.assert_array_equal(batch.target_ids[p : p + n - 1].numpy(), sample.input_ids[a + 1 : a + n])
        p += n - 1
    assert p == len(batch.positions)


SAMPLES: dict = {}  # (version, sample id) -> view.sample(id), shared by the packing tests


@pytest.mark.parametrize("which, windows", [("view", True), ("view", False), ("sampled_view", True)])
def test_packing_matches_the_store(which, windows, request):
    """Windows of one part and the global shuffle (everything in memory) give the store's own decoding."""
    v = request.getfixturevalue(which)
    s = windowed(v, seed=3) if windows else stream(v, seed=3)
    assert (s.window_parts == 1) == windows
    batches = take(s, s.steps_per_epoch)
    cache = SAMPLES.setdefault(v.snapshot_id, {})
    for batch in batches:
        check_batch(v, batch, cache)
    assert (batches[0].entry_counts is not None) == (which == "sampled_view")


def test_epoch_order_and_fragments_follow_the_contract(view):
    s = stream(view, seed=5)
    segments = [seg for b in take(s, s.steps_per_epoch) for seg in b.segments]
    train_ids = sorted(
        sid for sid in view.index["sample_id"].to_pylist() if not is_eval_sample(sid, eval_fraction=0.05)
    )
    order = [train_ids[i] for i in np.random.default_rng([5, 0]).permutation(len(train_ids))]
    walked, expected_a = [], 0
    for sid, a, _f, n in segments:
        if not walked or walked[-1] != sid:
            walked.append(sid)
            expected_a = 0
        assert a == expected_a  # a fragment continues exactly where the previous one was cut
        expected_a = a + n
    assert walked == order[: len(walked)]
    assert any(f % SEQ == 0 and a > 0 for _, a, f, _ in segments)  # some sample was cut across rows
    n_tokens = dict(zip(view.index["sample_id"].to_pylist(), view.index["n_tokens"].to_pylist()))
    assert s.rows_per_epoch == sum(n_tokens[sid] for sid in train_ids) // SEQ


def test_block_causal_mask():
    doc = torch.tensor([[0, 0, 1, 1, -1]])
    batch = PackedBatch(
        input_ids=torch.zeros(1, 5, dtype=torch.long),
        position_ids=torch.zeros(1, 5, dtype=torch.long),
        document_ids=doc,
        positions=torch.zeros(0, dtype=torch.long),
        target_ids=torch.zeros(0, dtype=torch.long),
        signals=[],
        n_tokens=4,
    )
    mask = batch.block_causal_mask(torch.bfloat16)
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bfloat16
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
    assert not torch.isnan(torch.softmax(torch.randn(5, 5) + mask[0, 0].float(), dim=-1)).any()


def test_mask_of_a_real_batch_blocks_other_documents(view):
    batch = take(stream(view), 1)[0]
    allowed = batch.block_causal_mask() == 0
    doc = batch.document_ids
    q, k = torch.meshgrid(torch.arange(SEQ), torch.arange(SEQ), indexing="ij")
    expected = (doc[:, :, None] == doc[:, None, :]) & (k <= q)
    assert torch.equal(allowed[:, 0], expected)


# -- splits ----------------------------------------------------------------------------------------------


def test_is_eval_sample_is_the_documented_hash():
    for sid in ("doc-1", "ünïcode", "x" * 100):
        fraction = int.from_bytes(hashlib.blake2b(sid.encode(), digest_size=8).digest(), "big") / 2**64
        assert is_eval_sample(sid, eval_fraction=fraction + 1e-9) and not is_eval_sample(
            sid, eval_fraction=fraction - 1e-9
        )
    assert not is_eval_sample("anything", eval_fraction=0.0) and is_eval_sample("anything", eval_fraction=1.0)


def test_train_and_eval_are_disjoint_stable_and_eval_is_one_pass(view):
    ids_of = lambda batches: {sid for b in batches for sid, *_ in b.segments}
    train = stream(view, eval_fraction=0.3)
    evaluation = stream(view, split="eval", eval_fraction=0.3, seed=9)
    train_ids = set(train.table.sample_ids)
    eval_ids = set(evaluation.table.sample_ids)
    assert train_ids.isdisjoint(eval_ids) and train_ids | eval_ids == set(view.index["sample_id"].to_pylist())
    assert eval_ids == set(stream(view, split="eval", eval_fraction=0.3, seed=4).table.sample_ids)
    passes = [list(evaluation), list(evaluation)]  # finite; the second iter() is a full pass again
    assert len(passes[0]) == evaluation.steps_per_epoch
    for x, y in zip(*passes):
        assert_same(x, y)
    assert ids_of(passes[0]) <= eval_ids and ids_of(take(train, train.steps_per_epoch)) <= train_ids


@pytest.mark.parametrize("seq_len, micro_batch, world_size", [(SEQ, MB, 1), (4096, 4, 1), (50, 3, 2), (7, 64, 3)])
def test_eval_split_evaluates_every_token_once_however_small(view, seq_len, micro_batch, world_size):
    # A split smaller than a row or a micro-batch still gives one (padded) step on every rank.
    ranks = [
        stream(
            view,
            split="eval",
            eval_fraction=0.3,
            seq_len=seq_len,
            micro_batch=micro_batch,
            world_size=world_size,
            rank=r,
        )
        for r in range(world_size)
    ]
    steps = ranks[0].steps_per_epoch
    assert steps >= 1 and all(len(list(s)) == steps for s in ranks)
    table = ranks[0].table
    tokens = {sid: n for sid, n in zip(table.sample_ids, table.n_tokens.tolist())}
    seen: dict[str, int] = {}
    for s in ranks:
        for batch in s:
            assert batch.input_ids.shape == (micro_batch, seq_len)
            assert batch.n_tokens == int((batch.document_ids >= 0).sum())  # the rest is padding
            for sid, _, _, n in batch.segments:
                seen[sid] = seen.get(sid, 0) + n
        assert s.state_dict()["rows_consumed"] == 0  # the pass is over: rewound
    assert seen == tokens


# -- errors, prefetch and damaged data ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"seq_len": 1}, "seq_len"),
        ({"micro_batch": 0}, "micro_batch"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"split": "test"}, "split"),
        ({"split": "eval", "eval_fraction": 0.0}, "no samples; raise --eval-fraction"),
        ({"seq_len": 4096}, "fewer than one micro-batch"),
        ({"world_size": 64, "micro_batch": 8, "rank": 3}, "fewer than one micro-batch"),
        ({"on_error": "ignore"}, "on_error"),
    ],
)
def test_bad_arguments_are_refused(view, kw, message):
    with pytest.raises(ValueError, match=message) as info:
        stream(view, **kw)
    assert isinstance(info.value, LogitstoreError)


def test_unknown_teacher_is_refused(view):
    with pytest.raises(LogitstoreError, match="no teacher"):
        stream(view, teacher="teacher-z")


def test_prefetch_thread_stops_on_close_and_counts_waiting(view):
    s = stream(view, prefetch=2)
    it = iter(s)
    next(it)
    assert any(t.name == "logitstore-prefetch" for t in threading.enumerate())
    s.close()
    assert not any(t.name == "logitstore-prefetch" and t.is_alive() for t in threading.enumerate())
    assert s.wait_seconds >= 0


@pytest.fixture(scope="module")
def damaged_view(tmp_path_factory):
    """A local store whose largest chunk file has 16 flipped bytes (its CRC32C fails)."""
    root = tmp_path_factory.mktemp("damaged") / "store"
    view = build_store(str(root), n=30, parts=3, max_tokens=400, k=32)
    victim = max((root / "chunks").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    mid = len(data) // 3
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(data))
    return Store.open(str(root)).read(view.snapshot_id)


@pytest.mark.parametrize("windows", [True, False])
def test_damaged_sample_is_named(damaged_view, windows):
    s = (windowed if windows else stream)(damaged_view, seq_len=128, eval_fraction=0.0)
    with pytest.raises(DamagedDataError, match=r"cannot read sample 'doc-\d+' .*checksum"):
        take(s, s.steps_per_epoch)  # raised in the prefetch thread, re-raised here
    s.close()


def test_damaged_samples_are_skipped_alike_in_windows_and_globally(damaged_view):
    damaged_ids = {key.split("/", 1)[1] for key in verify(damaged_view).damaged}
    skipped = []
    for windows in (True, False):
        s = (windowed if windows else stream)(damaged_view, seq_len=128, eval_fraction=0.0, on_error="skip")
        batches = take(s, s.steps_per_epoch)
        s.close()
        assert 0 < s.skipped_samples < 30  # one damaged chunk, not the whole part
        damaged = [b for b in batches if b.n_tokens < MB * 128]  # skipped fragments became padding
        assert damaged and all((b.document_ids == -1).sum() == MB * 128 - b.n_tokens for b in damaged)
        assert all(sid not in s.skipped_ids for b in batches for sid, *_ in b.segments)
        touched = s._plan(0).groups[0].pieces(0, s.steps_per_epoch * MB).row  # the samples this epoch's batches hold
        assert s.skipped_ids == damaged_ids & {s.table.sample_ids[r] for r in touched.tolist()}
        skipped.append(s.skipped_ids)
    assert skipped[0] and skipped[1]  # each order meets some of the damage (they differ in what they drop)


# -- stores of older formats ---------------------------------------------------------------------------------

FORMAT_2_STORE = (
    Path(__file__).parent / "data" / "format2-store"
)  # written before format 3 (tests/data/make_format2_store.py)


@pytest.mark.parametrize("windows", [False, True])
def test_a_store_written_in_format_2_streams_as_the_same_samples_written_now(tmp_path, windows):
    """One object per array (written by logitstore before store format 3) and one object per part
    (written now, from the same samples): the same batches, whole parts and windows alike."""
    shutil.copytree(FORMAT_2_STORE, tmp_path / "old")
    old = Store.open(str(tmp_path / "old")).read()
    assert json_attr(old.root, "logitstore")["format"] == 2 and not old.teachers["teacher-a"].packed
    new = build_store(str(tmp_path / "new"), n=30, parts=3)
    assert json_attr(new.root, "logitstore")["format"] == 4 and new.teachers["teacher-a"].packed
    make = windowed if windows else stream
    a, b = make(old, seq_len=64), make(new, seq_len=64)
    for x, y in zip(take(a, a.steps_per_epoch), take(b, b.steps_per_epoch), strict=True):
        assert_same(x, y)
    a.close(), b.close()
    assert verify(old).ok and verify(new).ok


def test_a_format_2_store_takes_a_packed_teacher_and_reads_both(tmp_path):
    """A new teacher in an old store is packed and raises the store's format; the old teacher's parts
    keep their layout, also for parts added now."""
    shutil.copytree(FORMAT_2_STORE, tmp_path / "old")
    store = Store.open(str(tmp_path / "old"))
    samples = random_samples(["new-1", "new-2"], seed=9, vocab=VOCAB)
    with store.writer() as w:
        w.write(samples, teacher="teacher-a")  # the old teacher: one object per array still
        w.add_teacher(
            dataclasses.replace(store.read().teachers["teacher-a"], name="teacher-b", part_layout="packed"),
            code_of_id=codec.frequency_id_order(samples.entry_ids, vocab_size=VOCAB),
        )
        w.commit("a new teacher")
    with store.writer() as w:
        w.write(samples, teacher="teacher-b")
        w.commit("its samples")
    view = store.read()
    assert json_attr(view.root, "logitstore")["format"] == 3
    assert not view.teachers["teacher-a"].packed and view.teachers["teacher-b"].packed
    for name in ("teacher-a", "teacher-b"):
        np.testing.assert_array_equal(view.sample("new-2", teacher=name).input_ids, samples.select(1).input_ids)
        s = stream(view, teacher=name, seq_len=16, micro_batch=1)
        assert take(s, 1)[0].n_tokens > 0
        s.close()
    assert verify(view).ok


# -- the window shuffle and the memory budget ---------------------------------------------------------------


@pytest.fixture(scope="module")
def many_parts():
    """40 parts of ~100 tokens each: a store a budget of two parts' worth cannot hold."""
    return build_store(f"memory://{uuid.uuid4().hex[:12]}", n=120, parts=40, max_tokens=70)


def test_window_order_is_a_permutation_grouped_by_window(many_parts):
    s = windowed(many_parts, seed=4)
    plan = s._plan(0).groups[0]  # one rank: one reader group
    assert sorted(plan.order.tolist()) == list(range(s.n_samples))  # every sample once per epoch
    windows = np.searchsorted(plan.window_start, np.arange(len(plan.order)), side="right") - 1
    part_window = {}
    for part, window in zip(s.table.part[plan.order].tolist(), windows.tolist()):
        assert part_window.setdefault(part, window) == window  # a part's samples share one window
    assert plan.n_windows == len(s.table.parts)  # windows of one part
    assert not np.array_equal(plan.order, windowed(many_parts, seed=5)._plan(0).groups[0].order)
    np.testing.assert_array_equal(plan.order, windowed(many_parts, seed=4)._plan(0).groups[0].order)
    assert not np.array_equal(plan.order, s._plan(1).groups[0].order)


def test_windows_read_each_part_once_per_epoch_within_the_budget(many_parts):
    s = windowed(many_parts, seed=4, micro_batch=1, prefetch=0)  # prefetch would build into the next epoch
    batches = take(s, s.steps_per_epoch)
    n_parts = len(s.table.parts)
    assert n_parts <= s.part_reads <= n_parts + s.window_parts  # plus the next epoch's first window, read ahead
    assert s.peak_bytes_held <= s.memory_budget
    cache = SAMPLES.setdefault(many_parts.snapshot_id, {})
    for batch in batches[:5]:
        check_batch(many_parts, batch, cache)
    s.close()


def test_windows_read_ahead_into_the_budgets_room(many_parts):
    # A budget of 3.5 parts gives windows of one part (two held) and room for one more: the part of the
    # window after next is read ahead, so a batch crossing into that window finds it read. Same order.
    probe = stream(many_parts, micro_batch=1, prefetch=0)
    sizes = probe.source.part_bytes()
    probe.close()
    budget = int(3.5 * int(sizes.max()))
    s = stream(many_parts, micro_batch=1, prefetch=0, memory_budget=budget)
    assert s.window_parts == 1
    batches = take(s, s.steps_per_epoch)
    assert s.peak_parts_held >= 3  # two windows of one part held, and a third read ahead
    assert s.peak_bytes_held <= budget
    assert len(s.table.parts) <= s.part_reads <= len(s.table.parts) + 1  # each part once (+ next epoch's first)
    narrow = windowed(many_parts, micro_batch=1, prefetch=0)  # windows of one part, no room: the same batches
    for a, b in zip(batches, take(narrow, len(batches))):
        assert torch.equal(a.input_ids, b.input_ids)
    s.close()
    narrow.close()


def test_windowed_resume_is_bit_identical_and_needs_the_same_budget(many_parts):
    s = windowed(many_parts, seed=2)
    n = s.steps_per_epoch - 2
    take(s, n)
    state = s.state_dict()
    assert state["window_parts"] == 1
    expected = take(s, 4)  # across the epoch boundary
    resumed = windowed(many_parts, seed=2)
    resumed.load_state_dict(state)
    for x, y in zip(take(resumed, 4), expected):
        assert_same(x, y)
    with pytest.raises(StreamConfigError, match="same --memory-budget"):
        stream(many_parts, seed=2).load_state_dict(state)  # the default budget holds the store: one window


def test_ranks_split_the_rows_of_a_windowed_stream(many_parts):
    budget = 4 * int(stream(many_parts).source.part_bytes().max())  # windows of 2 parts: 1 per group
    one = stream(many_parts, memory_budget=budget, micro_batch=2 * MB, reader_groups=2)
    ranks = [stream(many_parts, memory_budget=budget, world_size=2, rank=r) for r in (0, 1)]
    steps = ranks[0].steps_per_epoch
    assert one._plan(0).windowed and one._plan(0).groups[0].n_windows > 1
    for x, y, z in zip(take(ranks[0], steps), take(ranks[1], steps), take(one, steps)):
        assert rows_of(x) + rows_of(y) == rows_of(z)
    with pytest.raises(StreamConfigError, match="fewer than one part for each of 4 reader groups"):
        stream(many_parts, memory_budget=budget, reader_groups=4)


def test_a_budget_below_two_parts_is_one_clear_error(many_parts):
    largest = int(stream(many_parts).source.part_bytes().max())
    with pytest.raises(StreamConfigError, match="smaller than two parts") as info:
        stream(many_parts, memory_budget=largest)
    assert "--memory-budget" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(LogitstoreError, match="--memory-budget"):
        stream(many_parts, memory_budget="12 parsecs")


# -- DataLoader worker processes ---------------------------------------------------------------------------


def test_dataloader_workers_yield_the_batches_of_one_process_and_resume(tmp_path):
    """Worker w of W takes the steps w, w + W, ...: a DataLoader yields exactly the single-process
    batches, each worker reading in its own (spawned) process; `batch.data_state` resumes it."""
    local = build_store(str(tmp_path / "store"), n=120, parts=40, max_tokens=70)
    reference = take(windowed(local, seed=3), 12)

    def loader(s: Stream):
        return torch.utils.data.DataLoader(s, batch_size=None, num_workers=2, multiprocessing_context="spawn")

    s = windowed(local, seed=3)
    got = list(itertools.islice(iter(loader(s)), 12))
    for x, y in zip(got, reference):
        assert_same(x, y)
    resumed = windowed(local, seed=3)
    resumed.load_state_dict(got[6].data_state)  # as a training loop resumes from its last batch
    for x, y in zip(itertools.islice(iter(loader(resumed)), 5), reference[7:]):
        assert_same(x, y)
    with pytest.raises(StreamConfigError, match="cannot be sent to another process"):
        import pickle

        pickle.dumps(windowed(many_parts_view(), seed=3))


def many_parts_view():
    return build_store(f"memory://{uuid.uuid4().hex[:12]}", n=12, parts=4, max_tokens=70)


def test_torch_dataset_is_the_stream_as_an_iterable_dataset(view):
    import logitstore

    ds = logitstore.torch_dataset(view, seq_len=SEQ, micro_batch=MB, seed=1, eval_fraction=0.05)
    assert isinstance(ds, torch.utils.data.IterableDataset)
    loaded = list(itertools.islice(iter(torch.utils.data.DataLoader(ds, batch_size=None)), 3))
    for x, y in zip(loaded, take(stream(view), 3)):
        assert_same(x, y)
    ds.close()


def test_the_python_api_lists_the_streams_options_from_their_one_definition():
    """`help(logitstore.stream)` shows every option of `StreamSpec` with its default (the signature is
    made from the dataclass), and the package imports no torch for it."""
    import dataclasses
    import inspect
    import pydoc

    from logitstore.streaming.spec import StreamSpec

    parameters = inspect.signature(logitstore.stream).parameters
    fields = dataclasses.fields(StreamSpec)
    assert list(parameters) == ["view", *(f.name for f in fields)]
    for f in fields:
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert parameters[f.name].default == default, f.name
    shown = pydoc.render_doc(logitstore.stream, renderer=pydoc.plaintext)
    assert (
        "memory_budget: int | str | None = None" in shown
        and "train_on: Literal['completion', 'prompt+completion'] = 'completion'" in shown
    )
    code = "import sys, logitstore; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- reader groups: partitioned reads ------------------------------------------------------------------------


def epoch_of_ranks(view, *, world: int, micro_batch: int = 1, **kw) -> list[list[PackedBatch]]:
    """One epoch of each of `world` ranks (in one process), batch by batch."""
    ranks = [stream(view, world_size=world, rank=r, micro_batch=micro_batch, prefetch=0, **kw) for r in range(world)]
    out = [take(s, s.steps_per_epoch) for s in ranks]
    for s in ranks:
        s.close()
    return out


@pytest.mark.parametrize("groups", [None, 8])  # the default (the world size), and one fixed for every W
def test_each_sample_once_across_all_ranks_for_every_world_size(many_parts, groups):
    """Over an epoch, no token of any sample reaches two ranks (or one twice), and what none sees is
    exactly what the contract drops: each group's last partial row and the epoch's last partial step."""
    for world in range(1, 9):
        probe = stream(many_parts, world_size=world, micro_batch=1, reader_groups=groups)
        tokens = {sid: int(n) for sid, n in zip(probe.table.sample_ids, probe.table.n_tokens.tolist())}
        seen: dict[str, list[tuple[int, int]]] = {}
        for batches in epoch_of_ranks(many_parts, world=world, reader_groups=groups):
            for batch in batches:
                for sid, a, _, n in batch.segments:
                    seen.setdefault(sid, []).append((a, a + n))
        for sid, spans in seen.items():
            covered = np.zeros(tokens[sid], dtype=np.int64)
            for a, b in spans:
                covered[a:b] += 1
            assert covered.max() == 1, (world, sid)  # no token twice
        group_tokens = np.bincount(probe._group_of_sample, probe.table.n_tokens)
        dropped = int((group_tokens % SEQ).sum()) + (probe.rows_per_epoch - probe.steps_per_epoch * world) * SEQ
        assert sum(b - a for spans in seen.values() for a, b in spans) == sum(tokens.values()) - dropped
        assert probe.steps_per_epoch * world >= probe.rows_per_epoch - world + 1


@pytest.mark.parametrize("windows", [False, True])
def test_the_same_batches_for_the_same_groups_whatever_the_world_size(many_parts, windows):
    """8 reader groups, 8 rows a step: 1, 2, 4 or 8 ranks hold, together and in rank order, the same rows
    at every step of the epoch."""
    largest = int(stream(many_parts).source.part_bytes().max())
    budget = {"memory_budget": 2 * 8 * largest} if windows else {}  # windows of 8 parts: 1 per group
    reference = None
    for world in (1, 2, 4, 8):
        epoch = epoch_of_ranks(many_parts, world=world, micro_batch=8 // world, reader_groups=8, **budget)
        steps = [[row for rank in epoch for row in rows_of(rank[i])] for i in range(len(epoch[0]))]
        reference = reference or steps
        assert steps == reference, world
    s = stream(many_parts, reader_groups=8, **budget)
    assert s._plan(0).windowed == windows and s.state_dict()["reader_groups"] == 8


def test_resume_from_four_ranks_to_two_mid_epoch_without_repeats_or_gaps(many_parts):
    four = [stream(many_parts, world_size=4, rank=r, micro_batch=1, prefetch=0) for r in range(4)]
    done = [rows_of(b)[0] for s in four for b in take(s, 7)]
    state = four[0].state_dict()
    assert state["rows_consumed"] == 28 and state["reader_groups"] == 4
    two = [stream(many_parts, world_size=2, rank=r, micro_batch=1, prefetch=0) for r in range(2)]
    for s in two:
        s.load_state_dict(state)  # takes the run's 4 reader groups
        assert s.reader_groups == 4
    rest = [rows_of(b)[0] for s in two for b in take(s, s.steps_per_epoch - 14)]
    assert two[0].state_dict()["rows_consumed"] == 28 + 2 * (two[0].steps_per_epoch - 14)
    one = stream(many_parts, reader_groups=4, micro_batch=1, prefetch=0)
    whole = [rows_of(b)[0] for b in take(one, 28 + len(rest))]
    assert sorted(done + rest) == sorted(whole) and len(set(whole)) == len(whole)
    with pytest.raises(StreamConfigError, match="--reader-groups 4"):
        stream(many_parts, world_size=2, rank=0, reader_groups=2).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "reader_groups"}  # a state from before reader groups
    legacy = stream(many_parts, world_size=2, rank=0)
    legacy.load_state_dict(old)
    assert legacy.reader_groups == 1


@pytest.mark.parametrize("windows", [False, True])
def test_ranks_read_each_part_about_once_per_epoch(many_parts, windows):
    """The read counter: all ranks together fetch at most 1.3x the parts of an epoch (before reader groups,
    W ranks fetched W x)."""
    largest = int(stream(many_parts).source.part_bytes().max())
    n_parts = len(stream(many_parts).table.parts)
    for world in (2, 4, 8):
        budget = {"memory_budget": 2 * world * largest} if windows else {}  # windows of 1 part a group
        ranks = [
            stream(many_parts, world_size=world, rank=r, micro_batch=1, prefetch=0, **budget) for r in range(world)
        ]
        for s in ranks:
            take(s, s.steps_per_epoch)
        assert ranks[0]._plan(0).windowed == windows
        assert sum(s.part_reads for s in ranks) <= 1.3 * n_parts, world
        one_group = [stream(many_parts, world_size=world, rank=r, micro_batch=1, reader_groups=1) for r in range(2)]
        for s in one_group:
            take(s, s.steps_per_epoch)
        assert sum(s.part_reads for s in one_group) >= 1.5 * n_parts  # one group: each rank reads most parts


def test_dataloader_workers_share_their_ranks_partition(many_parts, monkeypatch):
    """With reader groups a multiple of ranks x micro-batch x workers, the workers of a rank read disjoint
    parts (here: each worker's stream run in this process, as its worker slice makes it); with one group
    per rank, each worker reads most of its rank's parts."""
    workers, world = 2, 2
    n_parts = len(stream(many_parts).table.parts)

    def reads(groups: int | None, **kw) -> int:
        total = 0
        for rank in range(world):
            for w in range(workers):
                monkeypatch.setattr(Stream, "_worker_slice", lambda self, w=w: (w, workers))
                s = stream(
                    many_parts, world_size=world, rank=rank, micro_batch=2, prefetch=0, reader_groups=groups, **kw
                )
                take(s, len(range(w, s.steps_per_epoch, workers)))  # its steps of the epoch
                total += s.part_reads
        return total

    assert reads(8) <= 1.3 * n_parts
    assert reads(None, loader_workers=workers) <= 1.3 * n_parts  # the default: 2 ranks x 2 rows x 2 workers
    with pytest.warns(UserWarning, match="pass loader_workers=2"):
        assert reads(None) >= 1.5 * n_parts  # the world size: each worker reads most of its rank's parts
