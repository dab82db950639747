"""Exit codes you can script against (issue 29): one regression test per defect found by the second
adversarial pass, each named after what broke. The exit codes themselves are docs/exit-codes.md."""

from __future__ import annotations

import json

from tests.test_safety import build, index_of, jsonl, one_line_error, run

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
