"""A build over ids the store already holds: text changed under the same id is refused in one line
unless `--on-duplicate skip` or `replace` says what to do, and a replacement stores exactly the new
text's windows (none left of the old text, even when the new text yields no window).

The tiny random teacher with the default teacher's tokenizer: what is stored, not its values, is the point."""

from __future__ import annotations

import json

from logitstore.store.store import Store
from logitstore.store.verify import verify
from logitstore.testing.cli import LONG, OTHER, build, jsonl, one_line_error, run
from logitstore.testing.stores import index_of


def test_changed_text_under_the_same_id_is_an_error_unless_replaced_or_skipped(tiny_teacher, tmp_path):
    store = tmp_path / "store"
    first = [{"id": "doc", "text": "The first text of this document."}, {"id": "long", "text": LONG}]
    assert build(tiny_teacher, store, jsonl(tmp_path / "a.jsonl", first)).exit_code == 0
    stored = index_of(store)
    old_windows = sorted(s for s in stored if s.startswith("long"))
    assert "doc" in stored and len(old_windows) == 3
    second = [{"id": "doc", "text": "Now the document says something else."}, {"id": "long", "text": OTHER}]
    data = jsonl(tmp_path / "b.jsonl", second)
    before = Store.open(str(store)).resolve()

    error = one_line_error(build(tiny_teacher, store, data), 2)
    assert "'doc'" in error and "stored with other text" in error and "--on-duplicate replace" in error
    assert Store.open(str(store)).resolve() == before

    result = build(tiny_teacher, store, data, "--on-duplicate", "skip")
    assert result.exit_code == 0 and json.loads(result.stdout)["changed"] == 2
    assert index_of(store) == stored

    result = build(tiny_teacher, store, data, "--on-duplicate", "replace")
    summary = json.loads(result.stdout)
    assert result.exit_code == 0 and summary["changed"] == 2
    replaced = index_of(store)
    from logitstore.pipelines.inputs import text_hash

    windows = sorted(s for s in replaced if s.startswith("long"))
    assert windows == [f"long#w{i}" for i in range(len(windows))] and len(windows) == 2  # no stale window left
    assert {h for s, (_, h) in replaced.items() if s.startswith("long")} == {text_hash(OTHER)}
    assert replaced["doc"][1] == text_hash(second[0]["text"]) != stored["doc"][1]
    assert build(tiny_teacher, store, data).exit_code == 0  # now stored as given: a rerun is a no-op
    assert index_of(store) == replaced and verify(Store.open(str(store)).read()).ok


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
