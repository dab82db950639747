"""A stream over a weighted mix of a store's versions (`logitstore/streaming/version_mix.py`): two rounds,
the second replacing some of the first's ids as `build --on-duplicate replace` does, and a version on
another branch whose parts the main branch's tree lacks."""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections import Counter

import numpy as np
import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.cli.rounds import Rounds, train_flags
from logitstore.store.store import Store
from logitstore.streaming.spec import StreamConfigError, StreamSpec
from logitstore.streaming.stream import store_stream
from logitstore.streaming.version_mix import VersionsSource, WeightedVersion, multiplicity, pinned, shown
from logitstore.testing.cli import one_line_error
from logitstore.testing.stores import write, write_store
from logitstore.testing.streams import assert_same, build_store, take
from logitstore.testing.synthetic import random_samples
from logitstore.trainer import checkpoint, run_folder
from logitstore.trainer.config import TrainConfig
from logitstore.trainer.train import check_before_launch

REPLACED = [f"doc-{i:03d}" for i in range(0, 60, 3)]  # round 2's answers to a third of the prompts


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    """(round-1 view, round-2 view, a view on another branch): round 2 replaces `REPLACED`."""
    uri = str(tmp_path_factory.mktemp("versions") / "store")
    first = build_store(uri, n=60, parts=3)
    store = Store.open(uri)
    store.tag("round-1", version=first.snapshot_id)
    meta = first.teachers["teacher-a"]
    with store.writer(on_duplicate="replace") as w:
        w.write(random_samples(REPLACED, seed=99, max_tokens=60, k=8), teacher="teacher-a")
        w.commit("round 2")
    store.tag("round-2", version=store.resolve())
    store.create_branch("side", version=store.log()[-1].id)  # the store as created: no parts
    write(store, random_samples(["side-0", "side-1", "doc-001"], seed=7, max_tokens=60, k=8), meta=meta, branch="side")
    return store.read("round-1"), store.read("round-2"), store.read("side")


def _stream(mix, **kw):
    spec = StreamSpec(seq_len=32, micro_batch=1, rank=0, world_size=1, seed=1, eval_fraction=0.0, **kw)
    return store_stream(mix[0].view, spec, versions=mix)


def _version_of(views, sample_id, a, tokens):
    """The views whose stored sample `sample_id` holds `tokens` at `a`."""
    return [v.snapshot_id for v in views if np.array_equal(_tokens(v, sample_id)[a : a + len(tokens)], tokens)]


def _tokens(view, sample_id):
    key = (view.snapshot_id, sample_id)
    if key not in _TOKENS:
        held = view.index.filter(pc.equal(view.index["sample_id"], sample_id)).num_rows
        _TOKENS[key] = view.sample(sample_id).input_ids if held else np.zeros(0, np.int64)
    return _TOKENS[key]


_TOKENS: dict = {}


def _fragments(batches, views):
    """(sample id, version, first token) of every fragment of the batches."""
    seen = []
    for batch in batches:
        flat = batch.input_ids.reshape(-1).numpy()
        for sid, a, f, m in batch.segments:
            found = _version_of(views, sid, a, flat[f : f + m])
            assert found, f"fragment of {sid} matches no version"
            seen.append((sid, tuple(found), a))
    return seen


def test_mix_reads_each_version_by_its_weight(rounds):
    one, two, _ = rounds
    mix = [WeightedVersion(one, 0.5), WeightedVersion(two, 1.0)]
    with _stream(mix) as s:
        assert (
            isinstance(s.source, VersionsSource) and len(s.source._readers) == 1
        )  # round 2's tree holds round 1's parts
        assert s.state_dict()["version"] == {one.snapshot_id: 0.5, two.snapshot_id: 1.0}
        ids = Counter(s.table.sample_ids)
        kept = multiplicity([f"doc-{i:03d}" for i in range(60)], version=one.snapshot_id, weight=0.5)
        assert 15 <= int(kept.sum()) <= 45  # about half of round 1's
        for i, k in enumerate(kept.tolist()):  # round 2's 60 samples once each, round 1's drawn ones once more
            assert ids[f"doc-{i:03d}"] == 1 + k
        epoch = _fragments(take(s, s.steps_per_epoch), [one, two])
    # A replaced id's two copies are two samples, each read with its own version's tokens.
    starts = Counter((sid, found) for sid, found, a in epoch if a == 0)
    both = [sid for i, sid in enumerate(f"doc-{i:03d}" for i in range(60)) if sid in REPLACED and kept[i]]
    assert both
    read_both = [sid for sid in both if starts[(sid, (one.snapshot_id,))] and starts[(sid, (two.snapshot_id,))]]
    assert len(read_both) >= len(both) - 1  # the epoch's cut last row may drop one sample's start
    assert sum(starts.values()) >= len(s.table.sample_ids) - 2


def test_mix_resumes_mid_epoch_and_whole_weights_repeat(rounds):
    one, two, _ = rounds
    mix = [WeightedVersion(two, 1.0), WeightedVersion(one, 1.5)]
    with _stream(mix) as a, _stream(list(reversed(mix))) as b:
        ahead = take(a, 4)
        take(b, 3)  # elsewhere in the epoch
        state = ahead[1].data_state
        b.load_state_dict(state)  # the flags' order does not matter: the same stream
        for x, y in zip(ahead[2:], take(b, 2)):
            assert_same(x, y)
        b.load_state_dict(state)
        with pickle.loads(pickle.dumps(b)) as c:  # as a DataLoader worker gets it: from its recipe
            assert_same(ahead[2], take(c, 1)[0])
        counts = Counter(a.table.sample_ids)
        assert min(counts.values()) >= 2  # round 1 at 1.5: every sample once, some twice, plus round 2's
    with _stream([WeightedVersion(two, 1.0), WeightedVersion(one, 0.5)]) as other:
        with pytest.raises(StreamConfigError, match="resume on the same version"):
            other.load_state_dict(state)


def test_mix_across_branches_reads_each_tree(rounds):
    one, _, side = rounds
    mix = [WeightedVersion(one, 1.0), WeightedVersion(side, 2.0)]
    with _stream(mix) as s:
        assert len(s.source._readers) == 2  # neither tree holds the other's parts
        assert Counter(s.table.sample_ids)["side-0"] == 2
        epoch = _fragments(take(s, s.steps_per_epoch), [one, side])
    assert {found for sid, found, _ in epoch if sid == "doc-001"} == {(one.snapshot_id,), (side.snapshot_id,)}


def test_mix_refuses_one_version_twice(rounds):
    one, _, _ = rounds
    with pytest.raises(StreamConfigError, match="given twice"):
        _stream([WeightedVersion(one, 1.0), WeightedVersion(Store.open(one.store.location.uri).read("round-1"), 0.5)])


# -- the flag, the run's records and resume, and the rounds driver ---------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["round-1"], "--version-weight 'round-1': expected VERSION=WEIGHT with a weight > 0"),
        (["round-1=0"], "--version-weight 'round-1=0': expected VERSION=WEIGHT with a weight > 0"),
        (["round-1=x"], "--version-weight 'round-1=x': expected VERSION=WEIGHT with a weight > 0"),
        (["a=1", "a=2"], "--version-weight: version 'a' given twice"),
        (["a=1", "--version", "b"], "--version and --version-weight exclude each other"),
    ],
)
def test_a_bad_version_weight_is_one_line_and_exit_2(values, message):
    args = ["train", "--store", "s", "--out", "o", "--print-config"]
    for value in values:
        args += [value] if value.startswith("--") or args[-1] == "--version" else ["--version-weight", value]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and result.stderr.strip() == f"error: {message}", result.stderr


def test_a_weight_past_any_epoch_or_one_version_named_twice_is_one_line_exit_2(tmp_path):
    uri, out = str(tmp_path / "store"), tmp_path / "run"
    store = write_store(uri, n=12)
    store.tag("round-1", version=store.resolve())
    snapshot = store.resolve("round-1")
    flags = ["train", "--store", uri, "--out", out, "--steps", 1, "--seq-len", 32, "--eval-fraction", 0]
    for weights, message in (
        (["main=1", "round-1=1"], "--version-weight: 'main' and 'round-1' name one version"),  # was: trained on one
        (["round-1=1", f"{snapshot}=1"], f"'round-1' and '{snapshot}' name one version ({snapshot}); give it once"),
        (["round-1=1e18"], "--version-weight: weight 1e+18 repeats the 12 samples of version"),  # was: a traceback
    ):
        args = [*flags, *(a for w in weights for a in ("--version-weight", w))]
        assert message in one_line_error(CliRunner().invoke(app, [str(a) for a in args]), 2)
        assert not out.exists()  # refused before the run took --out


def test_a_mixed_run_records_its_mix_and_resumes_only_on_it(tmp_path):
    uri, out = str(tmp_path / "store"), tmp_path / "run"
    store = write_store(uri, n=12)
    store.tag("round-1", version=store.resolve())
    with store.writer(on_duplicate="replace") as w:
        w.write(random_samples([f"doc-{i}" for i in range(0, 12, 2)], seed=5, max_tokens=80, k=8), teacher="teacher-a")
        w.commit("round 2")
    store.tag("round-2", version=store.resolve())
    one, two = store.resolve("round-1"), store.resolve("round-2")
    flags = ["--store", uri, "--out", out, "--seq-len", 32, "--micro-batch", 2, "--eval-fraction", 0]
    train = lambda *args: CliRunner().invoke(app, ["train", *map(str, [*flags, *args])])
    result = train("--steps", 1, "--version-weight", "round-1=0.5", "--version-weight", "round-2=1")
    assert result.exit_code == 0, result.stderr
    first, second = {one: 0.5, two: 1.0}, {one: 1.0, two: 1.0}
    # --resume reads the mix the run pinned, and its stream takes the checkpoint's data state (no step run).
    resume = TrainConfig.from_flags(store=uri, out=str(out), steps=2, seq_len=32, micro_batch=2, eval_fraction=0.0)
    plan = run_folder.plan(dataclasses.replace(resume, output=dataclasses.replace(resume.output, resume=True)))
    assert (plan.snapshot, plan.versions, plan.new_data) == (first, (first,), False)
    check_before_launch(resume.with_version(plan.snapshot), plan, world_size=1)
    other = ["--version-weight", "round-1=1", "--version-weight", "round-2=1"]
    refused = train("--steps", 2, "--resume", *other)
    assert refused.exit_code == 2 and f"but --version-weight is {shown(pinned({one: 1, two: 1}))};" in refused.stderr
    result = train("--steps", 2, "--resume", "--new-version", *other)
    assert result.exit_code == 0, result.stderr
    state = checkpoint.train_state(checkpoint.latest(out))
    assert (state["step"], state["snapshot"], state["versions"]) == (2, second, [first, second])
    assert state["data"]["version"] == second
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["versions"] for s in lines if s.get("event") == "start"] == [[first], [first, second]]
    assert [(r["step"], r["version"]) for r in lines if "step" in r] == [(1, first), (2, second)]


def test_rounds_mix_earlier_rounds_at_their_weight():
    r = Rounds(store="s", out="o", prompts="p", rounds=3, steps_per_round=2, earlier_rounds_weight=0.25)
    assert train_flags(r, 1, resume=False)["version"] == "round-1"
    third = train_flags(r, 3, resume=True)
    assert third["version_weights"] == {"round-3": 1.0, "round-1": 0.25, "round-2": 0.25} and "version" not in third
    assert TrainConfig.from_flags(**third).data.version_weights == third["version_weights"]
    assert train_flags(dataclasses.replace(r, earlier_rounds_weight=0.0), 3, resume=True)["version"] == "round-3"
