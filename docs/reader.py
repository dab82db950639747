"""One sample of a logitstore store, read with icechunk, zarr, numpy and pyarrow alone: the executable
definition of the store's layout (docs/store-format.md, "Reading a store without logitstore").

    python docs/reader.py STORE SAMPLE [--teacher NAME] [--branch main]

STORE is a folder or s3://bucket/prefix (S3 settings from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION
and AWS_ENDPOINT_URL). It prints one JSON object, as `logitstore show --json` does: {"sample_id", "teacher",
"input_ids", "positions": [{"ids", "logprobs", "tail", "target_logprob"}, ...]}, entries highest probability
first, `counts` added where sampled. It reads store formats 3 and 4 and refuses others in one line (exit 2).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import threading
import time

import icechunk
import numpy as np
import pyarrow.compute as pc
import pyarrow.fs
import pyarrow.parquet as pq
import zarr
from zarr.core.buffer import cpu

READS = (3, 4)  # the store formats whose parts this reader knows: one packed object per part
GRID_CODEC = "logitstore.logprob_grid"  # float32 log-probabilities over uint16 codes of the value grid
MINUS_INFINITY = 65535  # the grid's code for a log-probability of minus infinity (a tail of exactly 0)
if "ICECHUNK_LOG" not in os.environ:  # its warning on every local open concerns writers only
    icechunk.set_logs_filter("icechunk=error")


@atexit.register  # registered after Zarr's own handler (on import), so it runs before it
def settle(limit_s: float = 5.0) -> None:
    """At exit, wait until no thread that Python did not start is inside Python: an Icechunk thread entering
    it while the interpreter finalizes aborts the process (logitstore/storage/bounded.py, "exit")."""
    deadline = time.monotonic() + limit_s
    ours = lambda: {t.ident for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}  # noqa: E731
    while set(sys._current_frames()) - ours() and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL to the thread that waits for it


class Refused(Exception):
    """What this reader cannot read, said in one line."""


def open_store(store: str) -> tuple[icechunk.Repository, pyarrow.fs.FileSystem, str]:
    """The Icechunk repository, and the filesystem and folder of the Parquet indexes beside it."""
    if not store.startswith("s3://"):
        return (
            icechunk.Repository.open(icechunk.local_filesystem_storage(os.path.abspath(store))),
            pyarrow.fs.LocalFileSystem(),
            os.path.join(os.path.abspath(store), "logitstore-index"),
        )
    bucket, _, prefix = store[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    storage = icechunk.s3_storage(
        bucket=bucket,
        prefix=prefix or None,
        region=region,
        endpoint_url=endpoint,
        allow_http=bool(endpoint and endpoint.startswith("http://")),
        force_path_style=bool(endpoint),  # MinIO, moto and Ceph rarely serve virtual-host-style buckets
        from_env=True,
    )
    scheme, _, host = (endpoint or "https://").partition("://")
    files = pyarrow.fs.S3FileSystem(endpoint_override=host or None, scheme=scheme, region=region)
    return icechunk.Repository.open(storage), files, "/".join(p for p in (bucket, prefix, "logitstore-index") if p)


def index_row(repo, session, files, folder: str, sample: str, teacher: str | None) -> dict:
    """The sample's row of the version's index: the commit's metadata names the Parquet file."""
    name = repo.lookup_snapshot(session.snapshot_id).metadata["logitstore"]["index"]
    index = pq.read_table(f"{folder}/{name}", filesystem=files)
    rows = index.filter(pc.equal(index["sample_id"], sample)).to_pylist()
    held = sorted(r["teacher"] for r in rows)
    rows = [r for r in rows if teacher in (None, r["teacher"])]
    if not rows:
        raise Refused(f"no sample {sample!r}{f' of teacher {teacher!r}' if teacher else ''} (teachers: {held})")
    if len(rows) > 1:
        raise Refused(f"sample {sample!r} is held by teachers {held}; name one with --teacher")
    return rows[0]


def member(packed: zarr.Array, blob: bytes, name: str) -> zarr.Array:
    """One array of a packed part: its own zarr.json, its shards cut out of the packed object. The
    log-probability arrays are read as the uint16 codes their bytes hold (logitstore's grid codec, which
    turns them into float32, is logitstore's; `dequantize` does it here)."""
    entry = packed.attrs["logitstore_members"][name]
    document = as_codes(json.loads(json.dumps(entry["zarr"])))
    objects = {"zarr.json": json.dumps(document).encode()}
    objects |= {f"c/{i}": blob[s[0] : s[0] + s[1]] for i, s in enumerate(entry["objects"]) if s}
    return zarr.open_array({key: cpu.Buffer.from_bytes(b) for key, b in objects.items()}, mode="r")


def as_codes(document: dict) -> dict:
    """A zarr.json without the grid codec: declared as the uint16 codes it stores."""

    def strip(codecs: list) -> tuple[list, bool]:
        kept = [codec for codec in codecs if codec["name"] != GRID_CODEC]
        found = len(kept) < len(codecs)
        for codec in kept:
            if codec["name"] == "sharding_indexed":
                codec["configuration"]["codecs"], inside = strip(codec["configuration"]["codecs"])
                found = found or inside
        return kept, found

    document["codecs"], found = strip(document["codecs"])
    if found:
        document["data_type"], document["fill_value"] = "uint16", 0
    return document


def dequantize(codes: np.ndarray, grid: dict) -> np.ndarray:
    """float32 log-probabilities of the two-slope grid's codes: `fine_step` nats a step down to
    `coarse_below`, `coarse_step` nats a step below it, the largest code minus infinity."""
    fine, coarse, below = grid["fine_step"], grid["coarse_step"], grid["coarse_below"]
    fine_levels = round(-below / fine)
    q = codes.astype(np.float64)
    nats = np.where(q <= fine_levels, q * fine, -below + (q - fine_levels) * coarse)
    values = (-nats).astype(np.float32)
    values[codes == MINUS_INFINITY] = -np.inf
    return values


def read_sample(store: str, sample: str, *, teacher: str | None = None, branch: str = "main") -> dict:
    repo, files, folder = open_store(store)
    session = repo.readonly_session(branch=branch)
    root = zarr.open_group(session.store, mode="r")
    if root.attrs["logitstore"]["format"] > max(READS):
        raise Refused(f"{store} has store format {root.attrs['logitstore']['format']}; this reader reads 3 and 4")
    row = index_row(repo, session, files, folder, sample, teacher)
    group = root[f"teachers/{row['teacher']}"]
    meta = group.attrs["logitstore_teacher"]
    layout = meta.get("part_layout", "arrays")  # written since format 3; older teachers lack it
    needs = {"packed+students": 4, "packed": 3}.get(layout, 2 if meta.get("values") == "logprobs" else 1)
    if needs not in READS:  # before format 3 a part's arrays are Zarr arrays of their own, one object each
        raise Refused(
            f"teacher {row['teacher']!r} is stored in format {needs}; this reader reads formats 3 and 4 "
            "(logitstore show reads every format)"
        )
    packed = root[f"teachers/{row['teacher']}/parts/{row['part']}/packed"]
    blob = packed[:].tobytes()  # the part's one object: every member's shards end to end
    part = {name: member(packed, blob, name) for name in packed.attrs["logitstore_members"]}
    t0, p0, e0 = row["token_start"], row["position_start"], row["entry_start"]
    n_positions, n_entries = row["n_tokens"] - 1, row["n_entries"]
    per_position = part["n_entries"][p0 : p0 + n_positions].astype(np.int64)
    # Entry ids: per position, running sums of gaps give codes; codes are ids in the teacher's frequency
    # order (`code_of_id`, a permutation; absent where the order is the identity).
    gaps = part["entry_codes"][e0 : e0 + n_entries].astype(np.int64)
    running = np.concatenate([[0], np.cumsum(gaps)])
    starts = np.cumsum(per_position) - per_position
    codes = running[1:] - np.repeat(running[starts], per_position)
    ids = np.argsort(group["code_of_id"][:])[codes] if "code_of_id" in group else codes
    logprobs = dequantize(part["entry_logprobs"][e0 : e0 + n_entries], meta["codec"])
    tail = np.exp(dequantize(part["tail"][p0 : p0 + n_positions], meta["codec"]))  # mass outside the entries
    target = dequantize(part["target_logprobs"][p0 : p0 + n_positions], meta["codec"])
    counts = part["entry_counts"][e0 : e0 + n_entries] if "entry_counts" in part else None
    position = np.repeat(np.arange(n_positions), per_position)
    order = np.lexsort((-logprobs, position))  # highest probability first within each position
    ids, logprobs = ids[order], logprobs[order]
    counts = None if counts is None else counts[order]
    positions = []
    for p, (a, b) in enumerate(zip(starts.tolist(), (starts + per_position).tolist())):  # the output's shape
        entry = {
            "ids": ids[a:b].tolist(),
            "logprobs": [float(x) for x in logprobs[a:b]],
            "tail": float(tail[p]),
            "target_logprob": float(target[p]),
        }
        if counts is not None:
            entry["counts"] = counts[a:b].tolist()
        positions.append(entry)
    input_ids = part["input_ids"][t0 : t0 + row["n_tokens"]].tolist()
    return {"sample_id": sample, "teacher": row["teacher"], "input_ids": input_ids, "positions": positions}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", help="a store's folder or s3://bucket/prefix")
    parser.add_argument("sample", help="the sample's id")
    parser.add_argument("--teacher", help="the teacher, when several hold the sample")
    parser.add_argument("--branch", default="main", help="the branch whose tip is read (default: main)")
    args = parser.parse_args(argv)
    try:
        print(json.dumps(read_sample(args.store, args.sample, teacher=args.teacher, branch=args.branch)))
    except (Refused, icechunk.IcechunkError, FileNotFoundError) as e:  # no store there, no such branch
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
