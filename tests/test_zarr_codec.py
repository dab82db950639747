"""The log-probability grid as a Zarr v3 codec: plain `zarr` reads a store's values as log-probabilities
(found through the entry point, in a fresh interpreter that never imports logitstore), docs/store-format.md's
plain reading snippet runs as written, and every code survives the float32 round trip."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from logitstore.format import codec
from logitstore.format.grid import GRIDS, Q_MAX
from logitstore.format.layout import GRID_ARRAYS
from logitstore.format.zarr_codec import as_codes
from logitstore.store.store import Store
from logitstore.testing.stores import teacher, write
from logitstore.testing.synthetic import random_samples


@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_every_code_comes_back_from_its_float32_value(grid):
    params = GRIDS[grid]
    codes = np.arange(Q_MAX + 1, dtype=np.uint16)
    assert (as_codes(codec.dequantize(codes, params=params), params) == codes).all()


def fresh_python(code: str, *, cwd: Path) -> str:
    """Run `code` in a new interpreter (no logitstore imported unless the code does) and return stdout."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_plain_zarr_reads_log_probabilities(tmp_path):
    store = Store.open(str(tmp_path / "store"), create=True)
    samples = random_samples(["a", "b"], k=8)
    write(store, samples)
    view = store.read()
    row = view.index.slice(0, 1).to_pylist()[0]
    base = f"teachers/{row['teacher']}/parts/{row['part']}"
    # A packed part (store format 3): each array from its zarr.json and its shards in the packed object.
    code = f"""
import json, sys, icechunk, zarr
from zarr.core.buffer import cpu
print("@@", "logitstore" in sys.modules)
repo = icechunk.Repository.open(icechunk.local_filesystem_storage({str(tmp_path / "store")!r}))
packed = zarr.open_group(repo.readonly_session(branch="main").store, mode="r")[{base!r}]["packed"]
blob, members = packed[:].tobytes(), packed.attrs["logitstore_members"]
def member(name):
    objects = {{"zarr.json": json.dumps(members[name]["zarr"]).encode()}}
    objects |= {{f"c/{{i}}": blob[s[0] : s[0] + s[1]] for i, s in enumerate(members[name]["objects"]) if s}}
    return zarr.open_array({{k: cpu.Buffer.from_bytes(b) for k, b in objects.items()}}, mode="r")
part = {{name: member(name) for name in members}}
print("@@", json.dumps({{name: [str(part[name].dtype), part[name][:].tolist()] for name in {list(GRID_ARRAYS)!r}}}))
"""
    out = [line[3:] for line in fresh_python(code, cwd=tmp_path).splitlines() if line.startswith("@@ ")]
    assert out[-2] == "False"  # nothing imported logitstore: zarr loads the codec through its entry point
    read = json.loads(out[-1])
    stored = codec.encode(
        samples,
        params=view.teachers["teacher-a"].codec,
        code_of_id=Store.open(str(tmp_path / "store")).writer().part_writer().code_of_id("teacher-a"),
        vocab_size=1000,
    )
    for name in GRID_ARRAYS:
        dtype, values = read[name]
        assert dtype == "float32"
        expected = codec.dequantize(getattr(stored, name), params=view.teachers["teacher-a"].codec)
        np.testing.assert_array_equal(np.array(values, dtype=np.float32), expected, err_msg=name)


def test_a_format_1_teacher_keeps_codes_and_reads_as_before(tmp_path):
    from logitstore.testing.samples import assert_samples_close

    store = Store.open(str(tmp_path / "store"), create=True)
    samples = random_samples(["a", "b", "c"], k=8)
    write(store, samples, meta=dataclasses.replace(teacher(), values="codes"))
    view = store.read()
    assert view.teachers["teacher-a"].values == "codes"
    row = view.index.slice(0, 1).to_pylist()[0]
    assert view.array("teacher-a", row["part"], "entry_logprobs").dtype == np.uint16
    params = view.teachers["teacher-a"].codec
    for i, sid in enumerate(samples.sample_ids):
        assert_samples_close(
            view.sample(sid),
            samples.select(i),
            bound=params.error_bound,
            bound_fine=params.error_bound_fine,
            coarse_below=params.coarse_below,
        )


def test_the_plain_reading_snippet_of_the_store_format_docs_runs_as_written(tmp_path):
    from logitstore.testing.stores import write_store

    view = write_store(str(tmp_path / "quick"), n=6).read()
    readme = (Path(__file__).parents[1] / "docs" / "store-format.md").read_text()
    section = readme.split("## Reading a store without logitstore", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    sid = view.index["sample_id"][0].as_py()
    printed = next(line for line in fresh_python(snippet, cwd=tmp_path).splitlines() if line.startswith(sid + " "))
    s = view.sample(sid)
    first = s.n_entries[0]
    assert str(s.entry_ids[:first]) in printed and str(s.entry_logprobs[:first]) in printed
