"""How many bytes one sample's read fetches, against the shard (write unit) it lives in.

Writes a store shaped like a real top-64 build (synthetic distributions with the real teacher's
vocabulary, so the compressed sizes are realistic only roughly) and reads single samples through a
byte-counting wrapper around the Icechunk store: Zarr's sharding fetches the shard index and the
inner chunks it needs with range requests, never the whole shard.

    python benchmarks/chunking.py
    python benchmarks/chunking.py --smoke          # 8 samples of 256 tokens
"""

from __future__ import annotations

import argparse
import time

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs
import zarr
from zarr.storage import WrapperStore

from logitstore.format import codec
from logitstore.format.layout import CHUNK_BYTES, CHUNKS_PER_SHARD
from logitstore.format.sparsity import Sparsity
from logitstore.store.meta import TeacherMeta
from logitstore.store.store import Store
from logitstore.testing.synthetic import random_samples

SMOKE = {"samples": 8, "tokens": 256}


class CountingStore(WrapperStore):
    """Counts requests and bytes returned by `get` (what an object store would bill)."""

    def __init__(self, store):
        super().__init__(store)
        self.requests = 0
        self.bytes = 0

    async def get(self, key, prototype, byte_range=None):
        buf = await self._store.get(key, prototype, byte_range)
        self.requests += 1
        self.bytes += 0 if buf is None else len(buf)
        return buf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--k", type=int, default=64)
    args = smoke.parse_args(parser, sizes=SMOKE)
    vocab = 49152
    samples = random_samples(
        [f"s{i}" for i in range(args.samples)], vocab=vocab, k=args.k, min_tokens=args.tokens, max_tokens=args.tokens
    )
    store = Store.open(f"memory://chunking-{time.time_ns()}", create=True)
    meta = TeacherMeta(name="t", vocab_size=vocab, content_hash="-", tokenizer_hash="-", sparsity=Sparsity(k=args.k))
    with store.writer() as w:
        w.add_teacher(meta, code_of_id=codec.frequency_id_order(samples.entry_ids, vocab_size=vocab))
        w.write(samples, teacher="t")
        w.commit("chunking benchmark")
    view = store.read()
    counter = CountingStore(store.repo.readonly_session(snapshot_id=view.snapshot_id).store)
    view.root = zarr.open_group(counter, mode="r")
    view.decode_row(0)  # opens array metadata
    counter.requests = counter.bytes = 0
    start = time.perf_counter()
    view.decode_row(args.samples // 2)
    elapsed = time.perf_counter() - start
    stored = view.info()["stored_bytes"]
    entries_array = view.array("t", view.index["part"][0].as_py(), "entry_codes")
    print(f"store: {args.samples} samples x {args.tokens} tokens, top-{args.k}: {stored:,} bytes stored")
    print(
        f"inner chunk {CHUNK_BYTES // 1024} KiB uncompressed, up to {CHUNKS_PER_SHARD} per shard; "
        f"entry arrays: {entries_array.chunks[0]:,} entries per chunk, {entries_array.shards[0]:,} per shard"
    )
    print(
        f"one sample read: {counter.requests} requests, {counter.bytes:,} bytes fetched "
        f"({counter.bytes / stored:.1%} of the store), {elapsed * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
