"""Bytes per token and encode/decode speed of the store's codec against naive layouts, side by side.

Runs the default teacher over the shipped sample corpus, keeps the top-k entries per position, then
measures in one run (so machine noise hits every variant alike):

  fp32+int64     MaxText-style offline records: raw float32 logprobs and int64 ids
  fp16+int32     the usual "just make it smaller" layout
  fp16+int32+zstd  the same, zstd level 3 (what Megatron's cached logits do, roughly)
  logitstore     this codec (ids renumbered by frequency, sorted, delta-coded; two-slope quantized
                 log-probabilities; byte-shuffle + zstd), as the store writes it
  logitstore (store)  the same data written through a real store; bytes counted from the store

Throughput is on one core (Blosc and numpy single-threaded), in tokens per second, for encode (arrays
in memory -> compressed bytes) and decode (compressed bytes -> the arrays the loss consumes).

    python benchmarks/codec.py                 # ~8k tokens, k=64, ~1 minute on 2 CPU cores
    python benchmarks/codec.py --tokens 50000 --k 64
    python benchmarks/codec.py --smoke         # a toy teacher, 512 tokens; writes no table unless --out
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs
import numcodecs
import numpy as np
import torch
from _timing import timed  # as _smoke

from logitstore.format import codec
from logitstore.format.grid import CodecParams
from logitstore.format.layout import BLOSC_LEVEL, CHUNK_BYTES
from logitstore.format.samples import SparseSamples
from logitstore.format.sparsity import Sparsity
from logitstore.store.meta import TeacherMeta
from logitstore.store.store import Store

numcodecs.blosc.set_nthreads(1)
torch.set_num_threads(2)
RESULTS = Path(__file__).parent / "results" / "codec.md"
SMOKE = {"tokens": 512, "window": 128, "out": None}  # the smoke leaves the recorded table alone


def teacher_output(teacher_path: str | None, *, tokens: int, k: int, window: int) -> tuple[SparseSamples, object]:
    """Top-k output of the teacher (None: the default) over the first `tokens` tokens of the sample corpus."""
    from logitstore.data import SAMPLE_CORPUS
    from logitstore.pipelines.teacher import load_teacher, sparse_topk_forward

    teacher = load_teacher(teacher_path)
    texts = [json.loads(line)["text"] for line in SAMPLE_CORPUS.read_text().splitlines()]
    ids = np.concatenate([teacher.tokenizer(t)["input_ids"] for t in texts])[: tokens + 1]
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) >= 2]
    out = {"input_ids": [], "topk_ids": [], "topk_logprobs": [], "tail": [], "target_logprobs": []}
    for w in windows:
        b = sparse_topk_forward(teacher.model, torch.as_tensor(w)[None], k=k)
        out["input_ids"].append(w)
        out["topk_ids"].append(b.ids[0].numpy())
        out["topk_logprobs"].append(b.logprobs[0].numpy())
        out["tail"].append(b.tail[0].numpy())
        out["target_logprobs"].append(b.target_logprob[0].numpy())
    samples = SparseSamples.from_dense_topk([f"w{i}" for i in range(len(windows))], **out)
    return samples, teacher


def naive(samples: SparseSamples, *, value_dtype, id_dtype, compressor=None) -> dict:
    """Raw arrays as bytes (optionally zstd), and back."""

    def encode():
        arrays = [
            samples.entry_logprobs.astype(value_dtype),
            samples.entry_ids.astype(id_dtype),
            samples.tail.astype(value_dtype),
            samples.target_logprobs.astype(value_dtype),
        ]
        blobs = [a.tobytes() for a in arrays]
        return [compressor.encode(b) for b in blobs] if compressor else blobs

    def decode(blobs):
        raw = [compressor.decode(b) for b in blobs] if compressor else blobs
        dtypes = (value_dtype, id_dtype, value_dtype, value_dtype)
        return [
            np.frombuffer(b, dtype=d).astype(np.float32 if d == value_dtype else np.int64) for b, d in zip(raw, dtypes)
        ]

    t_enc, blobs = timed(encode)
    t_dec, _ = timed(lambda: decode(blobs))
    return {"bytes": sum(len(b) for b in blobs), "encode_s": t_enc, "decode_s": t_dec}


def ours(samples: SparseSamples, *, vocab: int, params: CodecParams) -> dict:
    """The codec plus the Blosc settings the store uses, chunked as the store chunks."""
    order = codec.frequency_id_order(samples.entry_ids, vocab_size=vocab).astype(np.int64)
    inverse = codec.invert_permutation(order)

    def compress(a: np.ndarray) -> list[bytes]:
        blosc = numcodecs.Blosc("zstd", BLOSC_LEVEL, numcodecs.Blosc.SHUFFLE if a.itemsize > 1 else 0)
        step = max(1, CHUNK_BYTES // a.itemsize)
        return [blosc.encode(np.ascontiguousarray(a[i : i + step])) for i in range(0, len(a), step)]

    def encode():
        enc = codec.encode(samples, params=params, code_of_id=order, vocab_size=vocab)
        return {name: (a.dtype, compress(a)) for name, a in enc.arrays().items()}

    def decode(blobs):
        blosc = numcodecs.Blosc()
        arrays = {
            name: np.concatenate([np.frombuffer(blosc.decode(c), dtype=dt) for c in chunks])
            for name, (dt, chunks) in blobs.items()
        }
        return codec.decode(
            codec.EncodedSamples(**arrays), params=params, id_of_code=inverse, n_tokens=samples.n_tokens
        )

    t_enc, blobs = timed(encode)
    t_dec, _ = timed(lambda: decode(blobs))
    size = sum(len(c) for _, chunks in blobs.values() for c in chunks)
    return {"bytes": size, "encode_s": t_enc, "decode_s": t_dec}


def through_store(samples: SparseSamples, teacher, *, k: int, params: CodecParams) -> dict:
    store = Store.open(f"memory://codec-bench-{time.time_ns()}", create=True)
    meta = TeacherMeta(
        name="default",
        vocab_size=teacher.vocab_size,
        content_hash=teacher.content_hash,
        tokenizer_hash=teacher.tokenizer_hash,
        sparsity=Sparsity(k=k, grid=params),
    )
    start = time.perf_counter()
    with store.writer() as w:
        w.add_teacher(meta, code_of_id=codec.frequency_id_order(samples.entry_ids, vocab_size=teacher.vocab_size))
        w.write(samples, teacher="default")
        w.commit("benchmark")
    t_write = time.perf_counter() - start
    view = store.read()
    t_read, _ = timed(lambda: [view.decode_row(i) for i in range(view.index.num_rows)], repeat=1)
    return {"bytes": view.info()["stored_bytes"], "encode_s": t_write, "decode_s": t_read}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"also write the table here (default {RESULTS})")
    smoke.add_teacher_option(parser)
    args = smoke.parse_args(parser, sizes=SMOKE)
    with tempfile.TemporaryDirectory() as tmp:
        teacher = smoke.smoke_teacher(args, Path(tmp))
        samples, loaded = teacher_output(teacher, tokens=args.tokens, k=args.k, window=args.window)
    report(args, samples, loaded)


def report(args, samples: SparseSamples, teacher) -> None:
    """Every layout's bytes and speeds as a table, printed and written to `--out`."""
    n = int(samples.n_tokens.sum())
    params = CodecParams()
    rows = {
        "fp32+int64 (MaxText-style)": naive(samples, value_dtype=np.float32, id_dtype=np.int64),
        "fp16+int32": naive(samples, value_dtype=np.float16, id_dtype=np.int32),
        "fp16+int32+zstd3": naive(samples, value_dtype=np.float16, id_dtype=np.int32, compressor=numcodecs.Zstd(3)),
        "logitstore codec": ours(samples, vocab=teacher.vocab_size, params=params),
        "logitstore codec, uniform 0.1-nat grid": ours(
            samples, vocab=teacher.vocab_size, params=CodecParams(fine_step=0.1, coarse_step=0.1, coarse_below=0.0)
        ),
        "logitstore store (write+commit / read)": through_store(samples, teacher, k=args.k, params=params),
    }
    base = rows["fp32+int64 (MaxText-style)"]["bytes"]
    lines = [
        f"{teacher.spec.name}, {n:,} tokens of the sample corpus, top-{args.k}; one core for encode/decode.",
        f"Codec error bound: {params.error_bound_fine} nats for log-probabilities >= {params.coarse_below}, "
        f"{params.error_bound} below.",
        "",
        "| layout | bytes/token | size vs fp32+int64 | encode tokens/s | decode tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['bytes'] / n:.1f} | {r['bytes'] / base:.3f} | {n / r['encode_s']:,.0f} | {n / r['decode_s']:,.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            table + "\n\nCommand: `python benchmarks/codec.py " + f"--tokens {args.tokens} --k {args.k}`\n"
        )


if __name__ == "__main__":
    main()
