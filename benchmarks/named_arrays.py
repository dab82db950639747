"""What it would cost to name a packed part's arrays again with Icechunk virtual chunk references.

Store formats 3 and 4 keep a part's arrays in one object (`parts/<p>/packed`), so plain Zarr sees one
uint8 array per part, not `entry_logprobs`. Of the ways to give the arrays their names back, only
Icechunk's virtual chunk references keep both the bytes and the one request per part: Zarr's sharding
codec holds one array's chunks per shard (the members differ in dtype and length), a Zarr codec sees
only its own chunk's bytes (it cannot reach into another array's object), and Icechunk 1.1's Python API
writes native chunks only as objects of their own (no reference into a byte range of one).

This script builds a format-4 store (synthetic teacher output through logitstore's own writer), then
on a branch `named` of the same repository rewrites each packed part the way a format with named arrays
would: the packed bytes as an object of logitstore's own (`logitstore-parts/<teacher>/<part>`, beside
the Parquet indexes), `parts/<p>/packed/c/0` a virtual reference to it, and each member a Zarr array of
its own (`parts/<p>/<name>`, its zarr.json as the member table has it) whose shards are virtual
references into the same object. It measures, side by side on local disk and on moto's S3 behind a
request-counting proxy: the bytes each layout stores per part (objects, manifests, snapshot), the
requests a whole-part read takes, whether plain Zarr reads the named arrays (and with what), and what
Icechunk's readonly sessions, garbage collection and a moved store do with the references.

    python benchmarks/named_arrays.py [--tokens 48000] [--parts 3] [--mode sampled] [--k 16] [--json]
    python benchmarks/named_arrays.py --smoke       # 3,000 tokens in 2 parts, local disk only
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs
import icechunk
import numpy as np
import zarr

from logitstore.format import codec, layout
from logitstore.format.zarr_codec import as_codes
from logitstore.storage import packed
from logitstore.storage.location import Location  # noqa: E402
from logitstore.store.meta import Sparsity, TeacherMeta  # noqa: E402
from logitstore.store.store import Store  # noqa: E402
from logitstore.testing.synthetic import random_samples

# Random logits over the full 49,152 ids cost minutes to draw; entry ids are what change with the vocabulary,
# and the question here is the per-part overhead of each layout, not the codec's bytes per token.
VOCAB = 2_048
TEACHER = "teacher-a"
PARTS_PREFIX = "logitstore-parts"
BRANCH = "named"
GRID_CODEC = "logitstore.logprob_grid"
SMOKE = {"tokens": 3000, "parts": 2, "where": ["local"]}  # S3 (moto behind a proxy): the real run's


def build(uri: str, *, tokens: int, parts: int, mode: str, k: int) -> list[str]:
    """A format-4 store of `parts` parts, about `tokens` tokens in all; the parts' names."""
    per_sample = 1024
    n = max(parts, tokens // per_sample)
    ids = [f"doc-{i:05d}" for i in range(n)]
    batches = [
        random_samples(list(chunk), seed=i, mode=mode, k=k, vocab=VOCAB, min_tokens=per_sample, max_tokens=per_sample)
        for i, chunk in enumerate(np.array_split(ids, parts))
    ]
    meta = TeacherMeta(
        name=TEACHER,
        vocab_size=VOCAB,
        content_hash="w",
        tokenizer_hash="t",
        sparsity=Sparsity.from_meta({"mode": mode, "k": k, "n": k}),
    )
    store = Store.open(uri, create=True)
    with store.writer() as w:
        w.add_teacher(meta, code_of_id=codec.frequency_id_order(batches[0].entry_ids, vocab_size=VOCAB))
        for samples in batches:
            w.write(samples, teacher=TEACHER)
        w.commit("data")
    view = store.read()
    return sorted(name for name, _ in layout.group_at(view.root, layout.parts_path(TEACHER)).groups())


class Place:
    """Where the repository lives, as Icechunk and a plain reader name it."""

    def __init__(self, uri: str):
        self.uri = uri
        self.location = Location.parse(uri)
        self.storage, _ = self.location.storage_and_blobs()

    @property
    def prefix_url(self) -> str:
        """The URL prefix of the repository's own objects: what a virtual chunk container must name."""
        if self.location.scheme == "file":
            return f"file://{self.location.path.rstrip('/')}/"
        return f"s3://{self.location.bucket}/{self.location.prefix.strip('/')}/"

    def object_store(self):
        if self.location.scheme == "file":
            return icechunk.local_filesystem_store(self.location.path)
        endpoint = os.environ["AWS_ENDPOINT_URL"]
        return icechunk.s3_store(
            region="us-east-1", endpoint_url=endpoint, allow_http=True, s3_compatible=True, force_path_style=True
        )

    def credentials(self):
        if self.location.scheme == "file":
            return None
        return icechunk.s3_credentials(
            access_key_id=os.environ["AWS_ACCESS_KEY_ID"], secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"]
        )

    def put(self, key: str, data: bytes) -> None:
        if self.location.scheme == "file":
            path = Path(self.location.path) / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            return
        import boto3

        boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1").put_object(
            Bucket=self.location.bucket, Key=f"{self.location.prefix.strip('/')}/{key}", Body=data
        )

    def get(self, key: str) -> bytes:
        if self.location.scheme == "file":
            return (Path(self.location.path) / key).read_bytes()
        import boto3

        client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
        return client.get_object(Bucket=self.location.bucket, Key=f"{self.location.prefix.strip('/')}/{key}")[
            "Body"
        ].read()

    def sizes(self, kind: str) -> dict[str, int]:
        """Icechunk's objects of one kind (chunks, manifests, snapshots) by id, with their sizes."""
        if self.location.scheme == "file":
            folder = Path(self.location.path) / kind
            return {p.name: p.stat().st_size for p in folder.iterdir()} if folder.exists() else {}
        import boto3

        client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
        prefix = f"{self.location.prefix.strip('/')}/{kind}/"
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket, Prefix=prefix)
        return {o["Key"].rsplit("/", 1)[1]: o["Size"] for page in pages for o in page.get("Contents", [])}

    def repository(self, *, authorize: bool) -> icechunk.Repository:
        access = icechunk.containers_credentials({self.prefix_url: self.credentials()}) if authorize else None
        return icechunk.Repository.open(self.storage, authorize_virtual_chunk_access=access)


def name_parts(place: Place, parts: list[str], *, grid_as_codes: bool) -> str:
    """Branch `named`: each packed part's bytes as an object of logitstore's own, its packed array and
    every member a Zarr array whose chunks are virtual references into it. Returns the new snapshot.
    `grid_as_codes`: the grid-coded arrays declared as what their bytes are, uint16 codes, with the
    grid's numbers as an attribute (`as_codes_document`), so no codec outside Zarr is needed."""
    config = icechunk.RepositoryConfig.default()
    config.set_virtual_chunk_container(icechunk.VirtualChunkContainer(place.prefix_url, place.object_store()))
    repo = icechunk.Repository.open(place.storage, config=config)
    repo.save_config()  # the container travels with the repository; a reader still has to authorize it
    main = repo.lookup_branch("main")
    repo.create_branch(BRANCH, main)
    session = repo.writable_session(BRANCH)
    store = session.store
    for part in parts:
        path = layout.packed_path(TEACHER, part)
        packed_array = zarr.open_array(store, path=path, mode="r")
        blob = bytes(np.asarray(packed_array[:]))
        members = dict(packed_array.attrs[layout.MEMBERS])
        key = f"{PARTS_PREFIX}/{TEACHER}/{part}"
        place.put(key, blob)
        url = place.prefix_url + key
        store.set_virtual_ref(packed.chunk_key(path), url, offset=0, length=len(blob))
        part_path = layout.part_path(TEACHER, part)
        for name, member in members.items():
            document = member["zarr"]
            if grid_as_codes and name in layout.GRID_ARRAYS:
                document = as_codes_document(document)
            _write_document(store, f"{part_path}/{name}", document)
            for shard, where in enumerate(member["objects"]):
                if where is not None:
                    store.set_virtual_ref(f"{part_path}/{name}/c/{shard}", url, offset=where[0], length=where[1])
    metadata = repo.lookup_snapshot(main).metadata  # the same index: the same samples
    return session.commit("parts named by virtual references", metadata=metadata)


def as_codes_document(document: dict) -> dict:
    """A grid-coded array's zarr.json without logitstore's codec: uint16 codes (the same bytes), the
    grid's numbers in the attribute `logitstore_grid` for a reader to turn codes into log-probabilities."""
    document = json.loads(json.dumps(document))
    grid = None
    for codec_ in document["codecs"]:
        if codec_["name"] == "sharding_indexed":
            inner = codec_["configuration"]["codecs"]
            grid = next(c for c in inner if c["name"] == GRID_CODEC)
            inner.remove(grid)
    assert grid is not None, "a grid-coded member is sharded, its grid codec inside the shard"
    document.update(data_type="uint16", fill_value=0)
    document["attributes"] = {**document.get("attributes", {}), "logitstore_grid": grid["configuration"]}
    return document


def _write_document(store, path: str, document: dict) -> None:
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    sync(store.set(f"{path}/zarr.json", default_buffer_prototype().buffer.from_bytes(json.dumps(document).encode())))


def stored_bytes(place: Place, snapshot: str, repo: icechunk.Repository) -> dict:
    """One version's manifests (how many, their bytes), its snapshot file's bytes and its nodes."""
    info = json.loads(asyncio.run(repo.inspect_snapshot_async(snapshot)))  # the sync call holds the GIL
    manifests = sum(m["size_bytes"] for m in info["manifests"])
    snapshots = place.sizes("snapshots")
    nodes = len(info["nodes"])
    return {
        "manifests": len(info["manifests"]),
        "manifest_bytes": manifests,
        "snapshot_bytes": snapshots[snapshot],
        "nodes": nodes,
    }


PLAIN_READER = r"""
import json, sys
class _NoLogitstore:  # a reader without logitstore: its package (and so its Zarr codec) cannot be imported
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "logitstore":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _NoLogitstore())
import icechunk, numpy as np, zarr
spec = json.loads(sys.argv[1])
if spec["s3"]:
    storage = icechunk.s3_storage(bucket=spec["bucket"], prefix=spec["prefix"], region="us-east-1",
        endpoint_url=spec["endpoint"], allow_http=True, force_path_style=True, from_env=True)
    creds = icechunk.s3_credentials(from_env=True)
else:
    storage, creds = icechunk.local_filesystem_storage(spec["path"]), None
access = icechunk.containers_credentials({spec["url"]: creds}) if spec["authorize"] else None
repo = icechunk.Repository.open(storage, authorize_virtual_chunk_access=access)
part = zarr.open_group(repo.readonly_session(branch=spec["branch"]).store, mode="r")[spec["part"]]
out = {}
for name in spec["names"]:
    try:
        out[name] = np.asarray(part[name][:]).tolist()
    except Exception as e:
        out[name] = "error: " + " ".join(str(e).split())[:240]
print(json.dumps(out))
"""


def plain_read(place: Place, *, part: str, names: list[str], branch: str, authorize: bool, python: str) -> dict:
    """Every named array of one part, read in a child interpreter with icechunk and zarr in which
    logitstore cannot be imported (`PLAIN_READER` blocks it, as if it were not installed)."""
    loc = place.location
    spec = {
        "s3": loc.scheme == "s3",
        "bucket": loc.bucket if loc.scheme == "s3" else None,
        "prefix": loc.prefix if loc.scheme == "s3" else None,
        "endpoint": os.environ.get("AWS_ENDPOINT_URL"),
        "path": loc.path,
        "url": place.prefix_url,
        "authorize": authorize,
        "branch": branch,
        "part": layout.part_path(TEACHER, part),
        "names": names,
    }
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [python, "-I", "-c", PLAIN_READER, json.dumps(spec)], capture_output=True, text=True, env=env, cwd="/"
    )
    lines = done.stdout.strip().splitlines()  # Icechunk logs its warnings to stdout: the answer is the last line
    # A reader without logitstore has no `bounded.settle`: Icechunk's threads can abort it at exit (a signal,
    # nothing on stderr) after it printed its answer, which stands; anything else is the reader's error.
    if done.returncode < 0 and lines and lines[-1].startswith("{"):
        return json.loads(lines[-1])
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]}
    return json.loads(lines[-1])


def expected(place: Place, part: str, names: list[str], *, grid_as_codes: bool) -> dict:
    """The same arrays as logitstore reads them from the packed part (main): the grid-coded ones as
    float32 log-probabilities, or with `grid_as_codes` as the uint16 codes stored."""
    view = Store.open(place.uri).read()
    out = {name: np.asarray(view.array(TEACHER, part, name)[:]) for name in names}
    if grid_as_codes:
        params = view.teachers[TEACHER].codec
        out |= {name: as_codes(out[name], params) for name in layout.GRID_ARRAYS if name in out}
    return out


def compare(got: dict, want: dict) -> dict:
    out = {}
    for name, values in want.items():
        value = got.get(name)
        if isinstance(value, str) or value is None:
            out[name] = value or "missing"
        else:
            out[name] = "equal" if np.array_equal(np.asarray(value, dtype=values.dtype), values) else "differs"
    return out


def run(place: Place, args, *, python: str, proxy=None) -> dict:
    say = lambda what: print(what, file=sys.stderr, flush=True)  # noqa: E731
    say("build")
    parts = build(place.uri, tokens=args.tokens, parts=args.parts, mode=args.mode, k=args.k)
    repo = place.repository(authorize=False)
    main = repo.lookup_branch("main")
    chunks_before = place.sizes("chunks")
    say("name")
    named = name_parts(place, parts, grid_as_codes=args.grid_as_codes)
    repo = place.repository(authorize=True)
    one = parts[0]
    main_store = repo.readonly_session(branch="main").store
    members = dict(zarr.open_array(main_store, path=layout.packed_path(TEACHER, one)).attrs[layout.MEMBERS])
    names = list(members)
    blob_sizes = [len(place.get(f"{PARTS_PREFIX}/{TEACHER}/{p}")) for p in parts]
    out = {
        "store": place.uri,
        "parts": len(parts),
        "part_object_bytes": blob_sizes,
        "format4": stored_bytes(place, main, repo),
        "named": stored_bytes(place, named, repo),
        "chunk_objects_format4": sum(chunks_before.values()),
    }
    say("plain")
    want = expected(place, one, names, grid_as_codes=args.grid_as_codes)
    out["plain_zarr_named_unauthorized"] = compare(
        plain_read(place, part=one, names=names, branch=BRANCH, authorize=False, python=python), want
    )
    out["plain_zarr_named_authorized"] = compare(
        plain_read(place, part=one, names=names, branch=BRANCH, authorize=True, python=python), want
    )
    if proxy is not None:
        say("requests")
        out["requests"] = count_requests(place, parts, names, proxy=proxy)
    say("gc")
    out["gc"] = collect_garbage(place)
    if place.location.scheme == "file":
        out["moved"] = moved(place, one, names, want, python=python)
    return out


def count_requests(place: Place, parts: list[str], names: list[str], *, proxy) -> dict:
    """GETs of one whole-part read per layout, by kind of object, counted by the proxy (second part,
    fresh repository handle, so its manifests are not cached)."""
    part = parts[1]
    out = {}

    def counted(fn) -> dict:
        proxy.requests.clear()
        fn()
        kinds = Counter()
        for method, path in proxy.requests:
            if method == "GET":
                pieces = urlparse(path).path.strip("/").split("/")
                kinds[pieces[2] if len(pieces) > 3 else "other"] += 1
        return dict(kinds)

    session = place.repository(authorize=True).readonly_session(branch="main")
    out["format4_packed_through_icechunk"] = counted(
        lambda: zarr.open_array(session.store, path=layout.packed_path(TEACHER, part), mode="r")[:]
    )
    session = place.repository(authorize=True).readonly_session(branch=BRANCH)
    out["named_packed_through_icechunk_virtual"] = counted(
        lambda: zarr.open_array(session.store, path=layout.packed_path(TEACHER, part), mode="r")[:]
    )
    out["named_part_object_direct"] = counted(lambda: place.get(f"{PARTS_PREFIX}/{TEACHER}/{part}"))
    session = place.repository(authorize=True).readonly_session(branch=BRANCH)
    group = zarr.open_group(session.store, mode="r", path=layout.part_path(TEACHER, part))
    out["named_every_array_by_name"] = counted(lambda: [group[name][:] for name in names])
    return out


def collect_garbage(place: Place) -> dict:
    """Expire every version but the branch tips and collect: do the part objects survive (Icechunk
    knows nothing of objects outside its own folders), and do the branches still read?"""
    repo = place.repository(authorize=True)
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=1)
    asyncio.run(repo.expire_snapshots_async(later))  # (the sync calls hold the GIL the in-process S3 needs)
    summary = asyncio.run(repo.garbage_collect_async(later))
    left = [p for p in (place.sizes(PARTS_PREFIX + "/" + TEACHER) or {})]
    session = place.repository(authorize=True).readonly_session(branch=BRANCH)
    group = zarr.open_group(session.store, mode="r", path=layout.parts_path(TEACHER))
    first = sorted(name for name, _ in group.groups())[0]
    readable = zarr.open_group(session.store, mode="r", path=layout.part_path(TEACHER, first))
    return {
        "chunks_deleted": summary.chunks_deleted,
        "part_objects_left": len(left),
        "named_reads_after_gc": bool(len(readable["input_ids"][:])),
    }


def moved(place: Place, part: str, names: list[str], want: dict, *, python: str) -> dict:
    """The store copied elsewhere, the original removed: virtual references name absolute URLs."""
    new = Path(place.location.path).with_name(Path(place.location.path).name + "-moved")
    shutil.copytree(place.location.path, new)
    shutil.rmtree(place.location.path)
    copy = Place(str(new))
    got = plain_read(copy, part=part, names=names[:1], branch=BRANCH, authorize=True, python=python)
    got_old_url = plain_read(place, part=part, names=names[:1], branch=BRANCH, authorize=True, python=python)
    return {"authorized_at_new_place": compare(got, {names[0]: want[names[0]]}), "old_place": str(got_old_url)[:200]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48_000)
    parser.add_argument("--parts", type=int, default=3)
    parser.add_argument("--mode", default="sampled")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument(
        "--python", default=sys.executable, help="the plain reader's interpreter (logitstore is blocked in it)"
    )
    parser.add_argument("--grid-as-codes", action="store_true", help="declare the grid-coded arrays as uint16 codes")
    parser.add_argument("--where", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    parser.add_argument("--json", action="store_true")
    args = smoke.parse_args(parser, argv, sizes=SMOKE)
    results = {}
    if "local" in args.where:
        with tempfile.TemporaryDirectory() as tmp:
            results["local"] = run(Place(str(Path(tmp) / "store")), args, python=args.python)
    if "s3" in args.where:
        results["s3"] = _on_s3(args)
    print(json.dumps(results, indent=None if args.json else 1, default=str))


def _on_s3(args) -> dict:
    import boto3
    from moto.server import ThreadedMotoServer

    from logitstore.testing.faultproxy import FaultProxy

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1")
    try:
        with FaultProxy((host, port)) as proxy:
            os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
            boto3.client("s3", endpoint_url=proxy.endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
            return run(Place(f"s3://bench/named-{uuid.uuid4().hex[:8]}"), args, python=args.python, proxy=proxy)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
