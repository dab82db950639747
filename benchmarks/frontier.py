"""The bytes-per-token frontier: how small a store can be and still teach as well as full logits.

Every variant trains the same fresh student (same seed, same batches, same token budget) and is judged
by the student's held-out forward KL to the teacher's *full* distribution, computed densely against the
teacher at evaluation time, and its held-out cross-entropy on the actual next tokens:

  dense (online)   reference: the teacher runs in the loop, loss = KL over the whole vocabulary
  top-64 fp16      baseline format (fp16 values, int32 ids): trained from a store whose value grid is
                   finer than fp16 (0.001-nat bound); bytes are the format's own, uncompressed
  top-k, top-p, sampled, grids
                   real stores; bytes/token are what the store holds after compression (`info`'s
                   bytes_per_token: every stored array, token ids included)

The teacher runs once over the data with two heads on one forward pass: top-64 (sorted, exact tail) and
64 draws from the full distribution. Every variant is cut from those with the build's own selection
(`sparsify.to_samples`): top-k keeps the first k entries (the rest joins the tail), top-p applies the
build's cut to the top-k, and "sampled N" keeps the first N of the i.i.d. draws, which are N i.i.d.
draws. A build with that sparsity computes the same values, so one teacher pass serves every variant (a
build per variant would cost ~2 minutes of CPU each). Stores are written by `StoreWriter` in parts of
~16k tokens, as the build writes them.

Data: the sample corpus, documents split into train and held-out by a hash of their id. Decode speed is
`codec.decode` of each variant's samples on one core, into the arrays the loss consumes. Everything runs
on the CPU (teacher, students, dense evaluation). Writes `results/frontier.md` (the table),
`results/frontier.png` (held-out KL against bytes/token, log x-axis) and `results/frontier.json` beside
this script, or under `--out`.

    python benchmarks/frontier.py              # default teacher, llama-tiny, 60 steps of 2 x 256 tokens, ~17 minutes on 2 CPU cores
    python benchmarks/frontier.py --smoke      # a tiny budget (--quick: the same); the slow tests run this
    python benchmarks/frontier.py --steps 2000 --student llama-small --docs 72
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import _smoke as smoke  # benchmarks/ is on sys.path when a script here runs
import numpy as np
import torch

from logitstore.data import SAMPLE_CORPUS
from logitstore.format import codec
from logitstore.format.grid import GRIDS, CodecParams
from logitstore.format.samples import concat
from logitstore.format.sparsity import Sparsity
from logitstore.live.config import LiveConfig
from logitstore.live.teacher import plan_live_samples
from logitstore.pipelines.engines.torch_engine import load_teacher_once, shared_teachers
from logitstore.pipelines.head import OutputHead
from logitstore.pipelines.sparsify import to_samples
from logitstore.pipelines.teacher import (
    SparseBatch,
    describe_teacher,
    empty_sparse,
    head_chunk,
    last_hidden_state,
    reshape_positions,
    resolve_teacher,
    sample_chunk,
)
from logitstore.store.store import Store
from logitstore.streaming.order import is_eval_sample
from logitstore.streaming.spec import StreamSpec
from logitstore.streaming.stream import store_stream
from logitstore.trainer.config import LossConfig, TrainConfig
from logitstore.trainer.losses import distill_loss
from logitstore.trainer.model import build_student
from logitstore.trainer.objective import sparse_targets, student_outputs
from logitstore.trainer.train import lr_at

SMOKE = {"steps": 3, "seq_len": 64, "micro_batch": 2, "docs": 6, "chars": 1200}
FP16_GRID = GRIDS["fine"]  # finer than fp16 below -1 nat
COARSE_GRID = GRIDS["coarse"]


@dataclass
class Variant:
    name: str
    sparsity: Sparsity
    grid: CodecParams = field(default_factory=CodecParams)
    nominal_bytes: float | None = None  # a baseline format's own bytes/token instead of the store's


def sparse_variants(smoke: bool) -> list[Variant]:
    """Every store variant; the dense online reference (fp32 logits, 4 x vocab bytes) runs beside them."""
    fp16 = Variant("top-64 fp16+int32", Sparsity(k=64), FP16_GRID, nominal_bytes=64 * (2 + 4) + 2 + 2)
    if smoke:
        return [fp16, Variant("top-16", Sparsity(k=16)), Variant("sampled 8", Sparsity(mode="sampled", n=8))]
    return [
        fp16,
        Variant("top-64", Sparsity(k=64)),
        Variant("top-32", Sparsity(k=32)),
        Variant("top-16", Sparsity(k=16)),
        Variant("top-8", Sparsity(k=8)),
        Variant("top-p 0.99 (cap 64)", Sparsity(mode="topp", p=0.99, k=64)),
        Variant("top-p 0.95 (cap 64)", Sparsity(mode="topp", p=0.95, k=64)),
        Variant("top-p 0.9 (cap 64)", Sparsity(mode="topp", p=0.9, k=64)),
        Variant("top-p 0.95 (cap 32), coarse grid", Sparsity(mode="topp", p=0.95, k=32), COARSE_GRID),
        Variant("top-16, coarse grid", Sparsity(k=16), COARSE_GRID),
        Variant("sampled 32", Sparsity(mode="sampled", n=32)),
        Variant("sampled 16", Sparsity(mode="sampled", n=16)),
        Variant("sampled 8", Sparsity(mode="sampled", n=8)),
    ]


# -- data and the teacher's one pass ------------------------------------------------------------------


def split_corpus(tmp: Path, *, docs: int, chars: int | None, held_out: float) -> tuple[Path, Path]:
    """The first `docs` documents, split by id hash into train and held-out JSONL files."""
    rows = [json.loads(line) for line in SAMPLE_CORPUS.read_text().splitlines()[:docs]]
    if chars:
        rows = [{**r, "text": r["text"][:chars]} for r in rows]
    held = [r for r in rows if is_eval_sample(r["id"], eval_fraction=held_out)] or rows[-1:]
    paths = []
    for name, part in (("train", [r for r in rows if r not in held]), ("held_out", held)):
        paths.append(tmp / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps({"id": r["id"], "text": r["text"]}) + "\n" for r in part))
    return paths[0], paths[1]


def windows(data: Path, *, seq_len: int):
    """The build's planning (reader, tokenizer, windows, ids), sorted by id."""
    return plan_live_samples(LiveConfig(data=str(data), id_column="id", max_length=seq_len))


@dataclass
class TeacherPass:
    """Per sample, the top-`width` entries and `width` draws of one forward pass."""

    top: list[SparseBatch]
    draws: list[SparseBatch]


def teacher_pass(model, plan, *, width: int, seed: int = 0) -> TeacherPass:
    generator = torch.Generator().manual_seed(seed)
    output_head = OutputHead.of_model(model)
    top, draws = [], []
    with torch.inference_mode():
        for tokens in plan.tokens:  # one sample per forward: no padding, as many calls as samples
            x = torch.as_tensor(tokens, dtype=torch.long)[None]
            hidden = last_hidden_state(model, x, None)[0, :-1]
            targets = x[0, 1:]
            for out, head in (
                (top, functools.partial(head_chunk, k=width, temperature=1.0)),
                (draws, functools.partial(sample_chunk, n=width, temperature=1.0, generator=generator)),
            ):
                batch = empty_sparse(len(targets), width, device=hidden.device)
                head(output_head, hidden, targets, out=batch, rows=slice(None))
                out.append(reshape_positions(batch, 1, len(targets)))
    return TeacherPass(top=top, draws=draws)


def first_entries(batch: SparseBatch, n: int, *, distinct_draws: bool) -> SparseBatch:
    """The first n columns: top-n of a sorted top-k, or the first n draws. The tail grows by the mass of
    what is dropped (for draws: the distinct ids of the dropped draws that the kept ones miss)."""
    ids, lp = batch.ids[..., :n], batch.logprobs[..., :n]
    rest_ids, rest_lp = batch.ids[..., n:], batch.logprobs[..., n:].double()
    if distinct_draws:
        seen_in_kept = (rest_ids[..., :, None] == ids[..., None, :]).any(-1)
        earlier = torch.triu(torch.ones(rest_ids.shape[-1], rest_ids.shape[-1], dtype=torch.bool), diagonal=1)
        repeat = ((rest_ids[..., :, None] == rest_ids[..., None, :]) & earlier.T).any(-1)  # seen earlier in the rest
        rest_lp = rest_lp.masked_fill(seen_in_kept | repeat, float("-inf"))
    tail = (batch.tail.double() + rest_lp.exp().sum(-1)).clamp(0, 1).float()
    return SparseBatch(ids=ids, logprobs=lp, target_logprob=batch.target_logprob, tail=tail)


def variant_samples(variant: Variant, teacher: TeacherPass, plan):
    sampled = variant.sparsity.mode == "sampled"
    n = variant.sparsity.n if sampled else variant.sparsity.k
    parts = []
    for sid, tokens, top, draws in zip(plan.sample_ids, plan.tokens, teacher.top, teacher.draws):
        batch = first_entries(draws if sampled else top, n, distinct_draws=sampled)
        parts.append(
            to_samples(
                batch, sample_ids=[sid], lengths=np.array([len(tokens)]), input_ids=[tokens], sparsity=variant.sparsity
            )
        )
    return concat(parts)


def write_store(uri: str, samples, *, variant: Variant, info, part_tokens: int = 16384) -> None:
    """As the build writes: the teacher's metadata with the id order of the first part, parts of
    ~`part_tokens` tokens, one commit."""
    bounds = np.searchsorted(np.cumsum(samples.n_tokens), np.arange(part_tokens, samples.n_tokens.sum(), part_tokens))
    groups = [g for g in np.split(np.arange(len(samples.n_tokens)), np.unique(bounds + 1)) if len(g)]
    parts = [concat([samples.select(int(i)) for i in g]) for g in groups]
    meta = info.store_meta(dataclasses.replace(variant.sparsity, grid=variant.grid))
    with Store.open(uri, create=True).writer(branch="main") as w:
        w.add_teacher(meta, code_of_id=codec.frequency_id_order(parts[0].entry_ids, vocab_size=info.vocab_size))
        for part in parts:
            w.write(part, teacher=meta.name)
        w.commit(f"frontier: {variant.name}")


# -- the teacher's dense side: reference training and evaluation ----------------------------------------


def dense_logprobs(teacher, batch) -> torch.Tensor:
    """The teacher's full log-distribution at a packed batch's supervised positions: [P, V]."""
    with torch.inference_mode():
        # The teacher as loaded for builds (eager/sdpa attention): packed rows need the block-causal mask.
        out = teacher(
            input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.block_causal_mask()
        )
        logits = out.logits.reshape(-1, out.logits.shape[-1])[batch.positions].float()
    return torch.log_softmax(logits, dim=-1)


def dense_kl(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) over the whole vocabulary."""
    q = torch.log_softmax(student_logits.float(), dim=-1)
    return (teacher_logprobs.exp() * (teacher_logprobs - q)).sum(-1).mean()


class HeldOut:
    """Held-out windows with the teacher's full distributions computed once; scores any student."""

    def __init__(self, teacher, windows: list[torch.Tensor]):
        self.windows = windows
        with torch.inference_mode():
            self.teacher_logprobs = [torch.log_softmax(teacher(w[None]).logits[0, :-1].float(), -1) for w in windows]

    @torch.no_grad()
    def score(self, student) -> dict:
        kl = ce = n = 0.0
        for w, p in zip(self.windows, self.teacher_logprobs):
            logits = student(w[None]).logits[0, :-1].float()
            kl += float(dense_kl(logits, p)) * len(p)
            ce += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            n += len(p)
        return {"held_out_kl": kl / n, "held_out_ce": ce / n}


# -- one variant ---------------------------------------------------------------------------------------


def bytes_by_array(view) -> dict[str, float]:
    """Stored (compressed) bytes per token of each array kind, summed over the version's parts."""
    tokens = int(view.index["n_tokens"].to_numpy().sum())
    totals: dict[str, int] = {}
    for teacher, part in set(zip(view.index["teacher"].to_pylist(), view.index["part"].to_pylist())):
        for name, array in view.part_group(teacher, part).arrays():
            totals[name] = totals.get(name, 0) + int(array.nbytes_stored())
    return {name: round(b / tokens, 2) for name, b in sorted(totals.items())}


def stored_samples(view):
    teacher = view.teacher_name(None)
    return concat([view.sample(sid, teacher=teacher) for sid in view.index["sample_id"].to_pylist()])


def decode_speed(view, samples) -> float:
    """Tokens/s of `codec.decode` on one core for this store's samples (best of 3)."""
    teacher = view.teacher_name(None)
    meta = view.teachers[teacher]
    id_of_code = view.id_of_code(teacher)
    code_of_id = codec.invert_permutation(id_of_code)
    enc = codec.encode(samples, params=meta.codec, code_of_id=code_of_id, vocab_size=meta.vocab_size)
    best = math.inf  # numpy and the numba kernels run on one thread here
    for _ in range(3):
        start = time.perf_counter()
        codec.decode(enc, params=meta.codec, id_of_code=id_of_code, n_tokens=samples.n_tokens)
        best = min(best, time.perf_counter() - start)
    return int(samples.n_tokens.sum()) / best


def train_student(stream_of, *, args, vocab: int, teacher=None) -> torch.nn.Module:
    """The fixed-budget run every variant gets: same init, batches, schedule. With `teacher`, the loss
    is the dense online KL; otherwise the store's sparse `forward_kl` (tail as a bucket)."""
    student, _ = build_student(args.student, vocab_size=vocab, seed=args.seed)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = TrainConfig.from_flags(
        store="frontier", out="-", steps=args.steps, lr=args.lr, warmup_steps=max(1, args.steps // 10)
    )
    stream = stream_of()
    batches = iter(stream)
    try:
        for step in range(args.steps):
            batch = next(batches)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, schedule)
            outputs = student_outputs(student, batch, "cpu")
            if teacher is not None:
                loss = dense_kl(outputs.logits(), dense_logprobs(teacher, batch))
            else:
                loss, _ = distill_loss(outputs.logits(), sparse_targets(batch, "cpu"), LossConfig())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
    finally:
        stream.close()
    return student.eval()


def report_progress(row: dict) -> None:
    print(
        f"{row['variant']:<36} {row['bytes_per_token']:>10.1f} B/token  held-out KL {row['held_out_kl']:.4f}  "
        f"({row['seconds']:.0f} s)",
        flush=True,
    )


# -- report ----------------------------------------------------------------------------------------------


def write_report(rows: list[dict], *, out: Path, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str) + "\n")
    ref = next(r for r in rows if r["variant"] == "dense (online)")
    base = next(r for r in rows if r["variant"].startswith("top-64 fp16"))
    lines = [
        f"Student `{args.student}` (seed {args.seed}), {args.steps} steps of {args.micro_batch} x {args.seq_len} tokens, "
        f"{args.docs} documents of the sample corpus, default teacher. KL and CE on held-out documents, "
        "KL against the teacher's full distribution.\n",
        "| variant | entries/position | bytes/token | held-out KL | vs top-64 fp16 | held-out CE | decode tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        size = f"{r['bytes_per_token']:,.1f}" + (" (format)" if r["nominal"] else "")
        speed = f"{r['decode_tokens_per_s'] / 1e6:.2f}M" if r.get("decode_tokens_per_s") else "-"
        entries = f"{r['entries_per_position']:.1f}" if r.get("entries_per_position") else "all"
        lines.append(
            f"| {r['variant']} | {entries} | {size} | {r['held_out_kl']:.4f} | "
            f"{r['held_out_kl'] - base['held_out_kl']:+.4f} | {r['held_out_ce']:.4f} | {speed} |"
        )
    lines.append(
        f"\nReference (dense, online): KL {ref['held_out_kl']:.4f}; the untrained student: "
        f"KL {rows[0]['untrained_kl']:.4f}."
    )
    (out / "frontier.md").write_text("\n".join(lines) + "\n")
    plot(rows, path=out / "frontier.png", title=f"{args.student}, {args.steps} steps, held-out KL to the full teacher")
    print("\n".join(lines))


def plot(rows: list[dict], *, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        marker = "s" if r["nominal"] else "o"
        ax.scatter(r["bytes_per_token"], r["held_out_kl"], marker=marker)
        ax.annotate(
            r["variant"],
            (r["bytes_per_token"], r["held_out_kl"]),
            fontsize=7,
            xytext=(4, 2),
            textcoords="offset points",
        )
    ref = next(r for r in rows if r["variant"] == "dense (online)")
    ax.axhline(ref["held_out_kl"], color="grey", linestyle="--", linewidth=0.8, label="dense online reference")
    ax.axvline(32, color="tab:red", linestyle=":", linewidth=0.8, label="32 bytes/token goal")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per token (stored after compression; squares: a format's own size)")
    ax.set_ylabel("held-out KL(teacher || student), nats")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--student", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--docs", type=int, default=20, help="documents of the sample corpus (72 in all)")
    parser.add_argument("--held-out", type=float, default=0.15, help="share of documents held out, by id hash")
    parser.add_argument("--seed", type=int, default=0, help="student init, batch order and the teacher's draws")
    parser.add_argument(
        "--variants",
        type=lambda text: text.split(";"),
        default=None,
        help="only these variants, ;-separated names as in the table (the dense reference and top-64 fp16 always run)",
    )
    parser.add_argument("--held-out-windows", type=int, default=12, help="held-out windows scored (densely)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--chars", type=int, default=None, help="cut each document to this many characters")
    # --smoke also runs four variants, not all (`sparse_variants`)
    return smoke.parse_args(parser, argv, sizes=SMOKE, aliases=("--quick",))


def main(argv=None) -> list[dict]:
    with shared_teachers():  # the dense reference and every variant's build use one load
        return _main(argv)


def _main(argv=None) -> list[dict]:
    args = parse_args(argv)
    teacher = load_teacher_once(resolve_teacher(None), "cpu", "auto")
    info, vocab = describe_teacher(None), teacher.vocab_size
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train_data, held_data = split_corpus(tmp, docs=args.docs, chars=args.chars, held_out=args.held_out)
        plan = windows(train_data, seq_len=args.seq_len)
        held_windows = [torch.as_tensor(t) for t in windows(held_data, seq_len=args.seq_len).tokens if len(t) > 1]
        held = HeldOut(teacher.model, held_windows[: args.held_out_windows])
        untrained = held.score(build_student(args.student, vocab_size=vocab, seed=args.seed)[0].eval())["held_out_kl"]
        started = time.perf_counter()
        passed = teacher_pass(teacher.model, plan, width=64, seed=args.seed)
        tokens = int(plan.n_tokens.sum())
        print(
            f"teacher pass: {len(plan.sample_ids)} samples, {tokens:,} tokens, {time.perf_counter() - started:.0f} s; "
            f"held out: {sum(map(len, held.windows)):,} tokens",
            flush=True,
        )
        stream_of = lambda view: (
            lambda: store_stream(
                view,
                StreamSpec(
                    seq_len=args.seq_len,
                    micro_batch=args.micro_batch,
                    rank=0,
                    world_size=1,
                    seed=args.seed,
                    eval_fraction=0.0,
                ),
            )
        )
        chosen = [
            v for v in sparse_variants(args.smoke) if not args.variants or v.name in args.variants or v.nominal_bytes
        ]
        for i, v in enumerate(chosen):
            started = time.perf_counter()
            uri = str(tmp / f"variant-{i}")
            write_store(uri, variant_samples(v, passed, plan), variant=v, info=info)
            view = Store.open(uri).read()
            bytes_per_token = view.info()["bytes_per_token"]
            student = train_student(stream_of(view), args=args, vocab=vocab)
            samples = stored_samples(view)
            rows.append(
                {
                    "variant": v.name,
                    "bytes_per_token": v.nominal_bytes or bytes_per_token,
                    "nominal": v.nominal_bytes is not None,
                    "store_bytes_per_token": bytes_per_token,
                    "entries_per_position": float(np.mean(samples.n_entries)),
                    "decode_tokens_per_s": decode_speed(view, samples),
                    "bytes_by_array": bytes_by_array(view),
                    **held.score(student),
                    "untrained_kl": untrained,
                    "seconds": time.perf_counter() - started,
                }
            )
            report_progress(rows[-1])
        # The reference: the teacher in the loop on the same batches (every store holds the same samples).
        started = time.perf_counter()
        student = train_student(stream_of(view), args=args, vocab=vocab, teacher=teacher.model)
        rows.insert(
            0,
            {
                "variant": "dense (online)",
                "bytes_per_token": 4.0 * vocab,
                "nominal": True,
                "entries_per_position": None,
                **held.score(student),
                "untrained_kl": untrained,
                "seconds": time.perf_counter() - started,
            },
        )
        report_progress(rows[0])
    write_report(rows, out=args.out, args=args)
    return rows


if __name__ == "__main__":
    main()
