"""The `logitstore` command line: thin typed functions that parse, call the library, and print.

Exit codes (docs/exit-codes.md, `logitstore.errors`): 0 success, 1 damaged data (`verify` found damage,
or a read hit it), 2 a user error or a storage outage (one line on stderr, no traceback), 130
interrupted (Ctrl-C, or the output's reader went away).
Each command imports the machinery it needs inside its function: this module imports in 0.08 s, and
would take 4.3 s more with the build's and the trainer's modules at the top (torch, transformers;
2-core CPU, 2026-11-25), at every `--help`, `info` and `show`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from typing import Annotated, Any, Literal, Optional

import typer
from typer.models import CommandInfo

from logitstore.errors import INTERRUPTED, LogitstoreError

app = typer.Typer(
    name="logitstore",
    help="Offline distillation: a versioned store of sparse teacher next-token distributions.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

StoreArg = Annotated[str, typer.Argument(help="Store location: a path, file://, s3://bucket/prefix or memory://name.")]
VersionOpt = Annotated[Optional[str], typer.Option("--version", help="Version id, tag or branch (default: main).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]

# Fixed choices, shown in --help and checked by the parser. The registries they mirror (losses.KINDS,
# codec.GRIDS, ...) import torch or numba, which would slow every command's start; tests/test_cli.py checks
# that the two agree.
Loss = Literal["forward_kl", "topk_renorm", "reverse_kl", "jsd"]
ValueGrid = Literal["default", "fine", "coarse"]
Engine = Literal["torch", "vllm"]
OnError = Literal["raise", "skip"]
OnDuplicate = Literal["error", "replace", "skip"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
TrainOn = Literal["completion", "prompt+completion"]  # logitstore.chat.TRAIN_ON (a test keeps them equal)


LIVE_PANEL = "Live mode (instead of --store)"


def _live_flag(help_text: str) -> Any:
    """The option of a `train --live-teacher` flag that means what build's flag of the same name means;
    None when not given (`LiveConfig.from_flags` knows what was given). `Any` as typer types it: it stands in
    for the parameter's default."""
    return typer.Option(rich_help_panel=LIVE_PANEL, help=f"Live mode: {help_text}")


LiveData = Annotated[Optional[str], _live_flag("the data, as build --data (default: the shipped corpus).")]
LiveTextColumn = Annotated[Optional[str], _live_flag("as build --text-column (default text).")]
LiveIdColumn = Annotated[Optional[str], _live_flag("as build --id-column.")]
LiveMaxLength = Annotated[Optional[int], _live_flag("as build --max-length (default 1024).")]
LiveTopK = Annotated[Optional[int], _live_flag("as build --top-k.")]
LiveTopP = Annotated[Optional[float], _live_flag("as build --top-p.")]
LiveSample = Annotated[Optional[int], _live_flag("as build --sample.")]
LiveTemperature = Annotated[Optional[float], _live_flag("as build --temperature (default 1.0).")]


def _no_placeholder_for_flags(display_type_rich):
    """typer 0.29 shows a type after every option, flags too (`--json <bool>` reads as if it took a
    value, and `--json true` then fails): a flag shows none."""

    @functools.wraps(display_type_rich)
    def display(self, ctx):
        return None if self.is_flag else display_type_rich(self, ctx)

    return display


# A monkeypatch of typer's method, on purpose (mypy's method-assign flags exactly that).
typer.core.TyperOption.display_type_rich = _no_placeholder_for_flags(  # type: ignore[method-assign]
    typer.core.TyperOption.display_type_rich
)

# The order commands are listed in --help: the order of use.
COMMAND_ORDER = ("build", "train", "eval", "info", "ls", "show", "diff", "log", "tag", "verify")


def user_errors(fn):
    """Print a LogitstoreError as one line and exit with its code (2; 1 for damaged data); anything
    else is a bug and keeps its traceback. A reader of the output that went away (`| head`) ends the
    command as interrupted (typer itself would exit 1, the code for damaged data)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LogitstoreError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(e.exit_code) from None
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail again
            raise typer.Exit(INTERRUPTED) from None

    return wrapper


def _open(store: str, *, create: bool = False):
    from logitstore.store import Store

    return Store.open(store, create=create)


def _print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


@app.command()
@user_errors
def info(store: StoreArg, version: VersionOpt = None, json_out: JsonOpt = False) -> None:
    """Samples, tokens, stored bytes, bytes per token and teachers of a version."""
    summary = _open(store).read(version).info()
    if json_out:
        _print_json(summary)
        return
    bpt = summary["bytes_per_token"]
    typer.echo(f"version      {summary['version']}")
    typer.echo(f"samples      {summary['samples']:,}")
    typer.echo(f"tokens       {summary['tokens']:,}")
    typer.echo(f"stored       {summary['stored_bytes']:,} bytes ({'-' if bpt is None else f'{bpt:.1f}'} bytes/token)")
    typer.echo(f"index        {summary['index_path'] or '-'}")
    for t in summary["teachers"]:
        params = ", ".join(f"{k}={v}" for k, v in t["sparsity"].items() if k != "mode" and v is not None)
        typer.echo(
            f"teacher      {t['name']}: vocab {t['vocab_size']:,}, {t['sparsity_mode']} ({params}), "
            f"{t['samples']:,} samples, codec error bound {t['codec']['error_bound_fine']} / {t['codec']['error_bound']} nats"
            + (f", {t['engine']} engine in {t['dtype']}" if t["engine"] else "")
        )
        for st in t["student_tokenizers"]:
            mass = "-" if st["mapped_mass"] is None else f"{st['mapped_mass']:.1%}"
            typer.echo(
                f"  student    {st['name']}: vocab {st['vocab_size']:,}, {st['mapped_ids']:,} teacher ids map exactly, "
                f"carrying {mass} of the teacher's probability mass"
            )


@app.command()
@user_errors
def show(
    store: StoreArg,
    sample_id: Annotated[str, typer.Argument(help="The sample's id.")],
    teacher: Annotated[Optional[str], typer.Option(help="Teacher name, when the store holds several.")] = None,
    student_tokenizer: Annotated[
        Optional[str], typer.Option(help="Add this student tokenizer's ids and the alignment.")
    ] = None,
    version: VersionOpt = None,
    top: Annotated[int, typer.Option(help="Entries to print per position (text output only).")] = 5,
    positions: Annotated[
        Optional[str], typer.Option(help="Only positions A:B (from A, before B; e.g. 0:20, 100:, :50).")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """A sample's tokens and, per position, its entries (highest probability first), tail and target."""
    from logitstore.inspect import parse_positions, position_slice, sample_as_json

    start, stop = parse_positions(positions) if positions is not None else (None, None)
    view = _open(store).read(version)
    obj = sample_as_json(view, sample_id, teacher=teacher, student_tokenizer=student_tokenizer)
    first = min(start or 0, len(obj["positions"]))
    if positions is not None and json_out:  # only those positions, and the tokens they read and predict
        obj = position_slice(obj, start=start, stop=stop)
    elif positions is not None:  # text: the tokens stay whole, `first` says where the positions start
        obj["positions"] = obj["positions"][start:stop]
        if "entry_tokens" in obj:
            obj["entry_tokens"] = obj["entry_tokens"][start:stop]
    if json_out:
        _print_json(obj)
        return
    if student_tokenizer is not None:
        tokens = obj.get("tokens") or [str(t) for t in obj["input_ids"]]
        typer.echo(
            f"sample {obj['sample_id']}: {len(obj['input_ids'])} teacher tokens, {len(obj['student_ids'])} "
            f"{student_tokenizer} tokens, {len(obj['alignment'])} aligned groups"
        )
        for t0, t1, s0, s1 in obj["alignment"]:
            typer.echo(f"  {tokens[t0:t1]!r:>40} = {obj['student_tokens'][s0:s1]!r}")
        return
    tokens = obj.get("tokens") or [str(t) for t in obj["input_ids"]]
    typer.echo(f"sample {obj['sample_id']}: {len(obj['input_ids'])} tokens (teacher {obj['teacher']})")
    for k, pos in enumerate(obj["positions"]):
        t = first + k
        names = obj.get("entry_tokens", [None] * len(obj["positions"]))[k] or [str(i) for i in pos["ids"]]
        entries = "  ".join(f"{n!r}:{math.exp(lp):.3f}" for n, lp in list(zip(names, pos["logprobs"]))[:top])
        typer.echo(
            f"{t:5d} {tokens[t]!r:>14} -> {tokens[t + 1]!r:<14} target p={math.exp(pos['target_logprob']):.3f} "
            f"tail={pos['tail']:.3f} | {entries}"
        )


@app.command(name="ls")
@user_errors
def ls(
    store: StoreArg,
    version: VersionOpt = None,
    limit: Annotated[Optional[int], typer.Option(min=0, help="List only the first N samples.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """The stored samples: id, tokens and teacher, in the order they were written."""
    from logitstore.inspect import list_samples

    view = _open(store).read(version)
    rows = list_samples(view, limit=limit)
    if json_out:
        _print_json(rows)
        return
    width = max([len("sample_id"), *(len(r["sample_id"]) for r in rows)])
    typer.echo(f"{'sample_id':<{width}}  {'tokens':>7}  teacher")
    for r in rows:
        typer.echo(f"{r['sample_id']:<{width}}  {r['tokens']:>7,}  {r['teacher']}")
    shown = f"{len(rows):,} of {view.index.num_rows:,}" if len(rows) < view.index.num_rows else f"{len(rows):,}"
    typer.echo(f"{shown} samples", err=True)


@app.command()
@user_errors
def log(store: StoreArg, version: VersionOpt = None, json_out: JsonOpt = False) -> None:
    """Versions, newest first, with their tags."""
    versions = _open(store).log(version)
    if json_out:
        _print_json([v.__dict__ for v in versions])
        return
    for v in versions:
        tags = f" [{', '.join(v.tags)}]" if v.tags else ""
        size = f"{v.samples:>8,} samples {v.tokens:>11,} tokens" if v.samples is not None else " " * 36
        typer.echo(f"{v.id}  {v.written_at:%Y-%m-%d %H:%M:%S}  {size}  {v.message}{tags}")


@app.command()
@user_errors
def tag(
    store: StoreArg,
    name: Annotated[str, typer.Argument(help="Tag name.")],
    version: VersionOpt = None,
    delete: Annotated[
        bool, typer.Option("--delete", help="Remove the tag (the version stays; the name is not reusable).")
    ] = False,
) -> None:
    """Name a version (default: the tip of main). Tags never move; a name cannot be a branch's too."""
    if delete:
        if version is not None:
            raise LogitstoreError("--delete takes the tag name only, not --version")
        typer.echo(f"deleted tag {name} (was {_open(store).delete_tag(name)})")
        return
    snapshot = _open(store).tag(name, version=version)
    typer.echo(f"tagged {snapshot} as {name}")


@app.command()
@user_errors
def diff(
    store: StoreArg,
    a: Annotated[str, typer.Argument(help="The older version, tag or branch.")],
    b: Annotated[str, typer.Argument(help="The newer version, tag or branch.")],
    json_out: JsonOpt = False,
) -> None:
    """Samples added, removed and changed between two versions."""
    from logitstore.index import diff_indexes

    s = _open(store)
    changes = diff_indexes(s.read_index(s.resolve(a)), s.read_index(s.resolve(b)))
    if json_out:
        _print_json(changes)
        return
    for kind, mark in (("added", "+"), ("removed", "-"), ("changed", "~")):
        for item in changes[kind]:
            typer.echo(f"{mark} {item['teacher']}/{item['sample_id']}")
    typer.echo(f"{len(changes['added'])} added, {len(changes['removed'])} removed, {len(changes['changed'])} changed")


@app.command()
@user_errors
def verify(store: StoreArg, version: VersionOpt = None, json_out: JsonOpt = False) -> None:
    """Read every chunk of a version; exit 1 and list the damaged samples if any."""
    from logitstore.verify import verify as run_verify

    report = run_verify(_open(store).read(version))
    if json_out:
        _print_json(
            {
                "version": report.version,
                "ok": report.ok,
                "samples": report.samples,
                "damaged": report.damaged,
                "arrays": report.arrays,
                "damaged_arrays": report.damaged_arrays,
                "unreferenced_parts": report.unreferenced,
            }
        )
        return _verify_exit(report)
    if report.unreferenced:  # not damage: what older versions read, or a concurrent build's leftovers
        typer.echo(
            f"note: {len(report.unreferenced)} part(s), {sum(report.unreferenced.values()):,} bytes, hold no "
            "sample of this version (replaced or removed documents' windows, which older versions still read)",
            err=True,
        )
    if report.ok:
        typer.echo(
            f"ok: version {report.version}, {report.samples} samples in {report.parts} parts and "
            f"{report.arrays} teacher arrays are whole"
        )
    else:
        for what, problem in sorted(report.damaged_arrays.items()) + sorted(report.damaged.items()):
            typer.echo(f"damaged: {what}: {problem}", err=True)
        typer.echo(
            f"{len(report.damaged)} of {report.samples} samples and {len(report.damaged_arrays)} of "
            f"{report.arrays} teacher arrays damaged in version {report.version}",
            err=True,
        )
    _verify_exit(report)


def _verify_exit(report) -> None:
    if not report.ok:
        raise typer.Exit(1)


@app.command()
@user_errors
def build(
    data: Annotated[
        Optional[str],
        typer.Option(
            rich_help_panel="Data",
            help="JSONL, Parquet, Arrow, CSV, a folder of those, a saved datasets folder, or a datasets name (default: the shipped sample corpus).",
        ),
    ] = None,
    split: Annotated[
        Optional[str],
        typer.Option(rich_help_panel="Data", help="With a datasets name or folder: the split to read (default train)."),
    ] = None,
    data_config: Annotated[
        Optional[str], typer.Option(rich_help_panel="Data", help="With a datasets name: its configuration (subset).")
    ] = None,
    text_column: Annotated[str, typer.Option(rich_help_panel="Data", help="Column holding the text.")] = "text",
    id_column: Annotated[
        Optional[str],
        typer.Option(
            rich_help_panel="Data",
            help='Column holding document ids (default: the input\'s "id" column where it has one, else a hash of the text; "" for hashes always).',
        ),
    ] = None,
    ids_column: Annotated[
        Optional[str],
        typer.Option(rich_help_panel="Data", help="Column of pre-tokenized teacher token ids (instead of text)."),
    ] = None,
    chat_column: Annotated[
        Optional[str],
        typer.Option(
            rich_help_panel="Data",
            help="Column of conversations (lists of {role, content}), rendered with the teacher's chat template; the assistant's tokens are the completion (docs/build.md 'Chat data').",
        ),
    ] = None,
    train_on: Annotated[
        TrainOn,
        typer.Option(
            rich_help_panel="Data",
            help="Chat data: store teacher entries for the completion only (saves bytes and teacher work) or for prompt+completion.",
        ),
    ] = "completion",
    max_length: Annotated[
        int,
        typer.Option(
            rich_help_panel="Data",
            help="Window length in teacher tokens; longer documents become windows overlapping by one token.",
        ),
    ] = 1024,
    limit: Annotated[
        Optional[int],
        typer.Option(rich_help_panel="Data", help="Read only the input's first N documents: a quick trial."),
    ] = None,
    teacher: Annotated[
        Optional[list[str]],
        typer.Option(
            rich_help_panel="Teacher",
            help="Hugging Face model directory, .gguf file, Hub id (org/name[@rev], local cache first), or built-in name (default: smollm2-135m-instruct). Repeat for several teachers.",
        ),
    ] = None,
    student_tokenizer: Annotated[
        Optional[list[str]],
        typer.Option(
            rich_help_panel="Teacher",
            help="\\[NAME=]TOK: also align every sample to this student tokenizer (a tokenizer or model folder, or a tokenizer.json). Repeatable.",
        ),
    ] = None,
    engine: Annotated[
        Engine,
        typer.Option(
            rich_help_panel="Teacher",
            help="torch, or vllm (GPU, pip install 'logitstore\\[vllm]'; top-k and top-p at temperature 1).",
        ),
    ] = "torch",
    tensor_parallel: Annotated[
        int,
        typer.Option(
            rich_help_panel="Teacher",
            help="GPUs per teacher engine (--engine vllm): tensor parallelism, for teachers that do not fit one GPU.",
        ),
    ] = 1,
    teacher_name: Annotated[
        Optional[str],
        typer.Option(
            rich_help_panel="Teacher",
            help="Store the teacher under this name (default: its folder's or file's name), e.g. to keep another engine's or dtype's entries apart.",
        ),
    ] = None,
    device: Annotated[str, typer.Option(rich_help_panel="Teacher", help="auto, cpu or cuda\\[:N].")] = "auto",
    dtype: Annotated[Dtype, typer.Option(rich_help_panel="Teacher", help="auto: bf16 on GPU, fp32 on CPU.")] = "auto",
    batch_tokens: Annotated[
        int, typer.Option(rich_help_panel="Teacher", help="Padded tokens per teacher batch.")
    ] = 8192,
    workers: Annotated[
        int,
        typer.Option(rich_help_panel="Teacher", help="Teacher worker processes (or Ray actors with --ray-address)."),
    ] = 1,
    ray_address: Annotated[
        Optional[str],
        typer.Option(rich_help_panel="Teacher", help="Ray cluster address, 'auto', or 'local' to start one here."),
    ] = None,
    top_k: Annotated[
        Optional[int],
        typer.Option(
            rich_help_panel="Sparsity", help="Store the top K entries per position (the cap, with --top-p: default 64)."
        ),
    ] = None,
    top_p: Annotated[
        Optional[float],
        typer.Option(
            rich_help_panel="Sparsity",
            help="Keep the smallest set of top entries reaching this probability, capped at --top-k.",
        ),
    ] = None,
    sample: Annotated[
        Optional[int],
        typer.Option(
            rich_help_panel="Sparsity",
            help="Store N draws per position as distinct ids with counts (unbiased). Default without any of --top-k/--top-p/--sample: --sample 16, or --top-k 64 with --student-tokenizer or an engine that cannot draw (vllm).",
        ),
    ] = None,
    temperature: Annotated[
        float,
        typer.Option(
            rich_help_panel="Sparsity",
            help="Temperature for selecting/sampling entries; stored log-probabilities stay at 1.",
        ),
    ] = 1.0,
    value_grid: Annotated[
        ValueGrid,
        typer.Option(
            rich_help_panel="Sparsity",
            help="Log-probability grid: default (0.025-nat bound above -5 nats), fine (0.001, finer than fp16) or coarse (0.05); see 'Choosing a budget'.",
        ),
    ] = "default",
    seed: Annotated[int, typer.Option(rich_help_panel="Sparsity", help="Seed for --sample draws.")] = 0,
    store: Annotated[
        str, typer.Option(rich_help_panel="Store", help="Store location; created if missing.")
    ] = "logitstore-store",
    branch: Annotated[
        str, typer.Option(rich_help_panel="Store", help="Branch to commit to (created from main if missing).")
    ] = "main",
    message: Annotated[
        Optional[str], typer.Option(rich_help_panel="Store", help="Commit message of the new version.")
    ] = None,
    on_duplicate: Annotated[
        OnDuplicate,
        typer.Option(
            rich_help_panel="Store",
            help="A document stored before under its id with other text: error, replace (recompute all its windows) or skip (keep the stored ones).",
        ),
    ] = "error",
    commit_every: Annotated[
        float, typer.Option(rich_help_panel="Store", help="Seconds between checkpoint commits.")
    ] = 300.0,
    unit_tokens: Annotated[
        int, typer.Option(rich_help_panel="Store", help="Tokens per unit of work (one part, the grain of resuming).")
    ] = 16384,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print machine-readable JSON.", rich_help_panel="Output")
    ] = False,
) -> None:
    """Run a teacher over a dataset and commit its sparse next-token distributions as a new version."""
    from logitstore.pipelines.inputs import check_input, dataset_source

    # The input before anything heavy (torch, a teacher, a store): a wrong path or column shows in ~1 s.
    source = dataset_source(data, split=split, config=data_config)
    check_input(source, text_column=text_column, id_column=id_column, ids_column=ids_column, chat_column=chat_column)
    from logitstore.location import Location

    Location.parse(store)  # so is a --store that cannot be one (a file; a bad scheme), before torch loads
    from logitstore.pipelines.build import BuildConfig, run_builds, summary_json
    from logitstore.pipelines.engines import engine_class
    from logitstore.sparsity import default_sparsity, sparsity_from_flags

    default = default_sparsity(student_tokenizers=bool(student_tokenizer), engine_samples=engine_class(engine).samples)
    sparsity = sparsity_from_flags(
        top_k=top_k, top_p=top_p, sample=sample, temperature=temperature, default=default, grid=value_grid
    )
    cfg = BuildConfig(
        store=store,
        data=source,
        student_tokenizers=tuple(student_tokenizer or ()),
        text_column=text_column,
        id_column=id_column,
        ids_column=ids_column,
        max_length=max_length,
        sparsity=sparsity,
        batch_tokens=batch_tokens,
        device=device,
        dtype=dtype,
        workers=workers,
        ray_address=ray_address,
        message=message,
        branch=branch,
        commit_every=commit_every,
        unit_tokens=unit_tokens,
        seed=seed,
        engine=engine,
        tensor_parallel=tensor_parallel,
        teacher_name=teacher_name,
        on_duplicate=on_duplicate,
        limit=limit,
        chat_column=chat_column,
        train_on=train_on,
    )
    summary = run_builds(cfg, list(teacher) if teacher else [None])
    if json_out:
        typer.echo(summary_json(summary))
    else:
        typer.echo(
            (f"version {summary.version}" if summary.version else "nothing stored (no store or branch made)")
            + f": {summary.samples:,} samples, {summary.tokens:,} tokens in "
            f"{summary.seconds:.1f} s ({summary.tokens_per_second:,.0f} tokens/s), "
            f"{summary.bytes_per_token or 0:.1f} bytes/token; skipped {summary.skipped}, "
            f"duplicates {summary.duplicates}, already stored {summary.already_stored}"
            + (f", changed {summary.changed} ({on_duplicate})" if summary.changed else "")
            + (f", no assistant tokens {summary.no_completion}" if summary.no_completion else "")
            + (f", tool calls the template drops {summary.tool_calls}" if summary.tool_calls else "")
        )


@app.command()
@user_errors
def train(
    out: Annotated[
        str,
        typer.Option(
            rich_help_panel="Output",
            help="Run folder: checkpoints, metrics.jsonl, final/. A new or empty folder, or one a run marked (logitstore-run.json).",
        ),
    ],
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            rich_help_panel="Output",
            help="Continue from the newest complete checkpoint in --out, on the store snapshot the run pinned (a finished run: nothing to do).",
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            rich_help_panel="Output",
            help="Replace the run in --out: removes only what a run writes, and only in a folder a run marked.",
        ),
    ] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print machine-readable JSON.", rich_help_panel="Output")
    ] = False,
    store: Annotated[
        Optional[str],
        typer.Option(rich_help_panel="Data", help="Store to train from (required, unless --live-teacher)."),
    ] = None,
    version: Annotated[
        Optional[str],
        typer.Option("--version", help="Version id, tag or branch (default: main).", rich_help_panel="Data"),
    ] = None,
    teacher: Annotated[
        Optional[str], typer.Option(rich_help_panel="Data", help="Teacher name, when the store holds several.")
    ] = None,
    teacher_weight: Annotated[
        Optional[list[str]],
        typer.Option(
            rich_help_panel="Data",
            help="NAME=WEIGHT: learn from several teachers at once (repeatable; the first one's samples are the run's).",
        ),
    ] = None,
    student_tokenizer: Annotated[
        Optional[str],
        typer.Option(
            rich_help_panel="Data",
            help="A built-in student uses this student tokenizer of the store (see build --student-tokenizer).",
        ),
    ] = None,
    seq_len: Annotated[int, typer.Option(rich_help_panel="Data", help="Tokens per packed row.")] = 256,
    micro_batch: Annotated[int, typer.Option(rich_help_panel="Data", help="Rows per process per micro-step.")] = 4,
    memory_budget: Annotated[
        Optional[str],
        typer.Option(
            rich_help_panel="Data",
            help="Stored data each process's stream holds in memory (e.g. 512MB; default 4GiB); a store larger than this is read in windows of parts, shuffled within each (docs/train.md 'Streaming').",
        ),
    ] = None,
    on_error: Annotated[
        OnError, typer.Option(rich_help_panel="Data", help="A damaged sample: raise (stop) or skip (and count).")
    ] = "raise",
    eval_fraction: Annotated[
        float, typer.Option(rich_help_panel="Data", help="Share of samples held out, by sample id hash.")
    ] = 0.05,
    train_on: Annotated[
        TrainOn,
        typer.Option(
            rich_help_panel="Data",
            help="Chat data: supervise the completion (the assistant's tokens) or prompt+completion; plain text stores supervise every token either way.",
        ),
    ] = "completion",
    student: Annotated[
        str,
        typer.Option(
            rich_help_panel="Student",
            help="Hugging Face causal-LM directory, Hub id (org/name[@rev]), or a built-in config (llama-tiny, llama-small, smollm2-135m).",
        ),
    ] = "llama-tiny",
    nproc: Annotated[
        int, typer.Option(rich_help_panel="Student", help="Processes to launch (gloo on CPU, NCCL on CUDA).")
    ] = 1,
    offload_optimizer: Annotated[
        bool,
        typer.Option(
            "--offload-optimizer",
            rich_help_panel="Student",
            help="FSDP2 CPU offload of parameters, gradients and optimizer state.",
        ),
    ] = False,
    activation_checkpointing: Annotated[
        bool,
        typer.Option(
            "--activation-checkpointing",
            rich_help_panel="Student",
            help="Recompute each block's activations in backward: about one more forward per step, far less memory.",
        ),
    ] = False,
    compile: Annotated[
        bool,
        typer.Option(
            "--compile",
            rich_help_panel="Student",
            help="torch.compile each block's feed-forward (compiles first; the attention is fused already).",
        ),
    ] = False,
    defer_grad_sync: Annotated[
        bool,
        typer.Option(
            "--defer-grad-sync",
            rich_help_panel="Optimisation",
            help="With --grad-accum > 1, reduce gradients once per step, not per micro-batch (holds them unsharded meanwhile).",
        ),
    ] = False,
    steps: Annotated[
        int,
        typer.Option(
            rich_help_panel="Optimisation", help="Total optimizer steps of the run (a resumed run continues to it)."
        ),
    ] = 100,
    tokens: Annotated[
        Optional[int],
        typer.Option(rich_help_panel="Optimisation", help="Train on this many tokens instead of --steps."),
    ] = None,
    grad_accum: Annotated[
        int, typer.Option(rich_help_panel="Optimisation", help="Micro-steps per optimizer step.")
    ] = 1,
    global_batch_tokens: Annotated[
        Optional[int],
        typer.Option(
            rich_help_panel="Optimisation", help="Tokens per optimizer step over all processes; sets --grad-accum."
        ),
    ] = None,
    lr: Annotated[float, typer.Option(rich_help_panel="Optimisation", help="Peak learning rate.")] = 3e-3,
    warmup_steps: Annotated[
        int, typer.Option(rich_help_panel="Optimisation", help="Linear warmup steps before the cosine decay.")
    ] = 10,
    min_lr_ratio: Annotated[
        float, typer.Option(rich_help_panel="Optimisation", help="Final learning rate as a fraction of --lr.")
    ] = 0.1,
    weight_decay: Annotated[float, typer.Option(rich_help_panel="Optimisation", help="AdamW weight decay.")] = 0.0,
    grad_clip: Annotated[
        float, typer.Option(rich_help_panel="Optimisation", help="Clip the gradient norm (0: off).")
    ] = 1.0,
    seed: Annotated[int, typer.Option(rich_help_panel="Optimisation", help="Seed for weights and data order.")] = 0,
    loss: Annotated[
        Loss, typer.Option(rich_help_panel="Loss", help="forward_kl (tail bucket), topk_renorm, reverse_kl or jsd.")
    ] = "forward_kl",
    kd_temperature: Annotated[float, typer.Option(rich_help_panel="Loss", help="Distillation temperature.")] = 1.0,
    alpha: Annotated[
        float, typer.Option(rich_help_panel="Loss", help="Weight of cross-entropy on the actual next token.")
    ] = 0.0,
    jsd_beta: Annotated[float, typer.Option(rich_help_panel="Loss", help="Mixing weight of --loss jsd.")] = 0.5,
    uld_weight: Annotated[
        float,
        typer.Option(
            rich_help_panel="Loss",
            help="Cross-tokenizer teachers: weight of the sorted-probability (ULD) term for unmapped tokens.",
        ),
    ] = 1.0,
    checkpoint_every: Annotated[
        int,
        typer.Option(
            rich_help_panel="Checkpoints and evaluation", help="Checkpoint every N steps (0: only at the end)."
        ),
    ] = 0,
    eval_every: Annotated[
        int,
        typer.Option(
            rich_help_panel="Checkpoints and evaluation",
            help="Evaluate on the held-out split every N steps (0: never).",
        ),
    ] = 0,
    report_to: Annotated[
        Optional[list[str]],
        typer.Option(
            rich_help_panel="Output",
            help="Also send the metrics to: tensorboard (OUT/tensorboard; pip install 'logitstore\\[tensorboard]'). Repeatable.",
        ),
    ] = None,
    live_teacher: Annotated[
        Optional[str],
        typer.Option(
            rich_help_panel=LIVE_PANEL,
            help="Live mode instead of --store: run this teacher (what build --teacher takes, or 'default') beside the trainer, handing over by shared memory.",
        ),
    ] = None,
    data: LiveData = None,
    text_column: LiveTextColumn = None,
    id_column: LiveIdColumn = None,
    max_length: LiveMaxLength = None,
    top_k: LiveTopK = None,
    top_p: LiveTopP = None,
    sample: LiveSample = None,
    temperature: LiveTemperature = None,
) -> None:
    """Train a student from a store version with FSDP2; no teacher runs."""
    from logitstore.trainer.config import LiveConfig, TrainConfig, parse_teacher_weights

    # Every error a flag alone can cause comes here, before torch and the training stack load (~10 s of
    # CPU on 2 cores); `trainer/config.py` loads neither.
    weights = parse_teacher_weights(teacher_weight) if teacher_weight else None
    live = LiveConfig.from_flags(
        live_teacher,
        data=data,
        text_column=text_column,
        id_column=id_column,
        max_length=max_length,
        top_k=top_k,
        top_p=top_p,
        sample=sample,
        temperature=temperature,
    )
    cfg = TrainConfig.from_flags(
        live=live,
        store=store,
        out=out,
        student=student,
        version=version,
        teacher=teacher,
        teacher_weights=weights,
        student_tokenizer=student_tokenizer,
        uld_weight=uld_weight,
        nproc=nproc,
        steps=steps,
        seq_len=seq_len,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        lr=lr,
        warmup_steps=warmup_steps,
        min_lr_ratio=min_lr_ratio,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        seed=seed,
        loss=loss,
        kd_temperature=kd_temperature,
        alpha=alpha,
        jsd_beta=jsd_beta,
        eval_every=eval_every,
        eval_fraction=eval_fraction,
        checkpoint_every=checkpoint_every,
        resume=resume,
        force=force,
        offload_optimizer=offload_optimizer,
        on_error=on_error,
        activation_checkpointing=activation_checkpointing,
        compile=compile,
        defer_grad_sync=defer_grad_sync,
        report_to=tuple(report_to or ()),
        global_batch_tokens=global_batch_tokens,
        tokens=tokens,
        train_on=train_on,
        **({"memory_budget": memory_budget} if memory_budget is not None else {}),
    )
    from logitstore.trainer.train import launch

    final = launch(cfg)
    if json_out:
        _print_json(final)
        return
    held_out = f", held-out KL {final['eval_kl']:.4f}" if "eval_kl" in final else ""
    typer.echo(
        f"done: step {final.get('step', '-')}{held_out}; the student is in {cfg.output.out}/final, "
        f"the curves in {cfg.output.out}/training.png"
    )


@app.command(name="eval")
@user_errors
def eval_(
    store: Annotated[str, typer.Option(help="Store holding the teacher distributions.")],
    student: Annotated[str, typer.Option(help="Trained student directory (e.g. OUT/final).")],
    version: VersionOpt = None,
    teacher: Annotated[Optional[str], typer.Option(help="Teacher name, when the store holds several.")] = None,
    seq_len: Annotated[int, typer.Option(help="Tokens per packed row.")] = 256,
    eval_fraction: Annotated[
        float,
        typer.Option(help="Held-out share, as in training (1: every sample, for a store built from held-out text)."),
    ] = 0.05,
    train_on: Annotated[
        TrainOn, typer.Option(help="Chat data: measure the completion's tokens only, or prompt+completion.")
    ] = "completion",
    json_out: JsonOpt = False,
) -> None:
    """The student's mean KL to the stored teacher (`kl`) and cross-entropy (`ce`) on held-out samples."""
    from logitstore.trainer.config import TrainConfig

    cfg = TrainConfig.for_eval(  # the flags' errors before torch loads, as train's
        store=store,
        student=student,
        version=version,
        teacher=teacher,
        seq_len=seq_len,
        eval_fraction=eval_fraction,
        train_on=train_on,
    )
    from logitstore.trainer.train import run_eval

    result = run_eval(cfg)
    if json_out:
        _print_json(result)
    else:
        typer.echo(
            f"held-out KL to the teacher {result['kl']:.4f} nats/token, CE {result['ce']:.4f} "
            f"(version {version or 'main'} = {result['version']})"  # the name the user gave, and its snapshot
        )


@app.callback(invoke_without_command=True)
def _program(
    show_version: Annotated[
        bool, typer.Option("--version", is_eager=True, help="Print the version of logitstore and exit.")
    ] = False,
) -> None:
    """Offline distillation: a versioned store of sparse teacher next-token distributions."""
    if show_version:
        from importlib.metadata import version as installed

        typer.echo(f"logitstore {installed('logitstore')}")
        raise typer.Exit(0)


def _listed_at(command: CommandInfo) -> int:
    """Where `command` is listed in --help: its name's place (or its function's) in `COMMAND_ORDER`."""
    assert command.callback is not None, "every command here is a decorated function"
    return COMMAND_ORDER.index(command.name or command.callback.__name__)


app.registered_commands.sort(key=_listed_at)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
