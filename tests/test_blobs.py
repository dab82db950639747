"""One conformance suite for every BlobStore backend (local, memory, S3 on loopback)."""

from __future__ import annotations

import pytest

from logitstore.storage.location import Location


@pytest.fixture
def blobs(store_uri):
    return Location.parse(store_uri).storage_and_blobs()[1]


def test_put_get_overwrite(blobs):
    blobs.put("a/b.parquet", b"one")
    assert blobs.get("a/b.parquet") == b"one" and blobs.exists("a/b.parquet")
    blobs.put("a/b.parquet", b"two")
    assert blobs.get("a/b.parquet") == b"two"


def test_missing_key_raises_key_error(blobs):
    assert not blobs.exists("nope")
    with pytest.raises(KeyError):
        blobs.get("nope")


def test_list_by_prefix(blobs):
    for key in ("x/1", "x/2", "y/1"):
        blobs.put(key, key.encode())
    assert blobs.list("x/") == ["x/1", "x/2"]
    assert blobs.list() == ["x/1", "x/2", "y/1"]


def test_large_object(blobs):
    data = bytes(range(256)) * 40_000  # 10 MB: above S3 multipart thresholds in some clients
    blobs.put("big", data)
    assert blobs.get("big") == data


def test_url_names_the_object(blobs, store_uri):
    blobs.put("k", b"v")
    assert blobs.url("k").endswith("k")


def test_location_parsing():
    assert Location.parse("memory://x").scheme == "memory"
    s3 = Location.parse("s3://bucket/some/prefix")
    assert (s3.bucket, s3.prefix) == ("bucket", "some/prefix")
    assert Location.parse("file:///tmp/a").path == "/tmp/a"
    assert Location.parse("relative/dir").scheme == "file"
