"""Object storage pays per request: how many a part's read takes, and reads under a fixed latency per
request, against moto's S3 server through a proxy that counts the HTTP requests and can delay each
(`logitstore/testing/faultproxy.py`). Counts and order only, never wall time."""

from __future__ import annotations

import uuid
from collections import Counter
from urllib.parse import urlparse

import pytest

from logitstore.store.reader import PartReader, TeacherRows
from logitstore.store.store import Store
from logitstore.testing.faultproxy import FaultProxy
from logitstore.testing.streams import assert_same, build_store, stream, take, windowed


@pytest.fixture
def proxy(s3_endpoint, monkeypatch):
    """A proxy in front of moto, with every client of this test pointed at it."""
    upstream = urlparse(s3_endpoint)
    with FaultProxy((upstream.hostname, upstream.port)) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
        yield p


def gets(proxy: FaultProxy) -> Counter:
    """GET requests by the kind of Icechunk object (chunks, manifests, snapshots, ...)."""
    kinds = Counter()
    for method, path in proxy.requests:
        if method == "GET":
            parts = urlparse(path).path.strip("/").split("/")  # bucket, store prefix, kind, id
            kinds[parts[2] if len(parts) > 3 else "other"] += 1
    return kinds


@pytest.mark.parametrize("part_layout", ["packed", "arrays"])
def test_a_part_read_whole_takes_one_object_request(proxy, part_layout):
    """Store format 3: a part is one object, so reading it whole is one GET of its chunk (and, read for
    the first time, one of its manifest). Before (one object per array): one of each per array."""
    uri = f"s3://logitstore-test/requests-{uuid.uuid4().hex[:12]}"
    build_store(uri, n=30, parts=3, part_layout=part_layout)
    view = Store.open(uri).read()
    reader = PartReader(view, teacher="teacher-a", rows=TeacherRows.of(view, teacher="teacher-a"))
    arrays = len(reader.names)  # six for a top-k teacher
    for code in range(3):
        first, again = twice(proxy, lambda code=code: reader.read(code))
        if part_layout == "packed":
            assert first == {"manifests": 1, "chunks": 1} and again == {"chunks": 1}
        else:  # an array's chunk under 512 bytes lies inline in its manifest (Icechunk's default)
            assert first["manifests"] == arrays and first["chunks"] <= arrays
            assert set(first) <= {"manifests", "chunks"} and again == {"chunks": first["chunks"]}


@pytest.mark.parametrize("part_layout", ["packed+students", "packed"])
def test_a_cross_tokenizer_part_read_whole_takes_one_object_request(proxy, part_layout):
    """Store format 4: a cross-tokenizer part's student arrays are in its one object, so a reader of
    the student's tokens reads the part whole in one GET (and its manifest, the first time, or once
    warmed). Format 3: each student array is an object of its own, with a manifest of its own."""
    from logitstore.testing.students import STUDENT, TEACHER, cross_store

    uri = f"s3://logitstore-test/requests-{uuid.uuid4().hex[:12]}"
    cross_store(uri, n=24, parts=3, part_layout=part_layout)
    view = Store.open(uri).read()
    rows = TeacherRows.of(view, teacher=TEACHER, student=STUDENT)
    reader = PartReader(view, teacher=TEACHER, rows=rows, student=STUDENT)
    own = 1 if part_layout == "packed+students" else 1 + len(reader.hashed_names)  # manifests per part
    for code in range(3):
        first, again = twice(proxy, lambda code=code: reader.read(code))
        assert reader.read(code).students is not None
        if part_layout == "packed+students":
            assert first == {"manifests": 1, "chunks": 1} and again == {"chunks": 1}
        else:  # the student arrays' chunks, under 512 bytes here, lie inline in their manifests
            assert first["manifests"] == own and again["chunks"] >= 1
    view = Store.open(uri).read()  # a new session: no manifest cached
    view.id_of_code(TEACHER)
    fresh = PartReader(view, teacher=TEACHER, rows=rows, student=STUDENT)
    proxy.requests.clear()
    fresh.warm(0)
    assert gets(proxy) == {"manifests": own}  # every manifest the read needs, and no chunk
    proxy.requests.clear()
    fresh.read(0)
    assert "manifests" not in gets(proxy)


def twice(proxy: FaultProxy, read) -> tuple[dict, dict]:
    """The requests of `read()` done twice: (the first time's, the second time's), counted by kind."""
    counts = []
    for _ in range(2):
        proxy.requests.clear()
        read()
        counts.append(gets(proxy))
    return counts[0], counts[1]


def read_under_latency(proxy: FaultProxy, make, *, parts: int, **kw) -> None:
    """A store of `parts` parts on S3, read one epoch by `make` (a stream factory) without latency and
    then with 50 ms before every request: the same batches. The proxy then holds the delayed read's
    requests only (the teacher's id order, read once by any reader, left out)."""
    uri = f"s3://logitstore-test/latency-{uuid.uuid4().hex[:12]}"
    build_store(uri, n=10 * parts, parts=parts)
    reference = make(Store.open(uri).read(), seq_len=64)
    expected = take(reference, reference.steps_per_epoch)
    reference.close()
    proxy.latency_s = 0.05
    view = Store.open(uri).read()
    view.id_of_code("teacher-a")
    proxy.peak_in_flight = 0
    proxy.requests.clear()
    delayed = make(view, seq_len=64, **kw)
    got = take(delayed, delayed.steps_per_epoch)
    delayed.close()
    for x, y in zip(got, expected, strict=True):
        assert_same(x, y)


def test_a_stream_under_latency_gives_the_same_batches_with_requests_in_flight_together(proxy):
    """The same batches as without latency, and the reader keeps several requests waiting at once
    (its read threads), which is what hides the latency."""
    read_under_latency(proxy, stream, parts=12)
    assert gets(proxy)["chunks"] == 12  # each part once, one request each
    assert proxy.peak_in_flight >= 4  # of the 8 read threads, several wait on storage together


def test_windows_under_latency_read_each_part_and_its_manifest_once(proxy):
    """Windows of one part (a memory budget of two): the engine reads one window ahead and warms the
    manifests of the window after (`HeldParts.warm`), so each part costs one chunk request when it is read;
    nothing is requested twice, and the batches are those without latency."""
    read_under_latency(proxy, windowed, parts=8, prefetch=0)  # prefetch 0: no batches of the next epoch
    counts = gets(proxy)
    # each part once (and the next epoch's first window, read ahead at the last), each manifest once
    assert 8 <= counts["chunks"] <= 9 and counts["manifests"] == 8
