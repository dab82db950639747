"""The `logitstore` command line: thin typed functions that parse, call the library, and print.

Exit codes: 0 success, 1 `verify` found damage, 2 a user error (one line on stderr, no traceback).
Heavy imports (torch, transformers) happen inside the commands that need them, so `info` and `show`
start fast.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from typing import Annotated, Optional

import typer

from logitstore.errors import LogitstoreError

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


def user_errors(fn):
    """Print a LogitstoreError as one line and exit 2; anything else is a bug and keeps its traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LogitstoreError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None

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
        typer.echo(f"teacher      {t['name']}: vocab {t['vocab_size']:,}, {t['sparsity_mode']} ({params}), "
                   f"{t['samples']:,} samples, codec error bound {t['codec']['error_bound_fine']} / {t['codec']['error_bound']} nats")


@app.command()
@user_errors
def show(
    store: StoreArg,
    sample_id: Annotated[str, typer.Argument(help="The sample's id.")],
    teacher: Annotated[Optional[str], typer.Option(help="Teacher name, when the store holds several.")] = None,
    version: VersionOpt = None,
    top: Annotated[int, typer.Option(help="Entries to print per position (text output only).")] = 5,
    json_out: JsonOpt = False,
) -> None:
    """A sample's tokens and, per position, its entries (highest probability first), tail and target."""
    from logitstore.inspect import sample_as_json

    view = _open(store).read(version)
    obj = sample_as_json(view, sample_id, teacher=teacher)
    if json_out:
        _print_json(obj)
        return
    tokens = obj.get("tokens") or [str(t) for t in obj["input_ids"]]
    typer.echo(f"sample {obj['sample_id']}: {len(obj['input_ids'])} tokens (teacher {obj['teacher']})")
    for t, pos in enumerate(obj["positions"]):
        names = obj.get("entry_tokens", [None] * len(obj["positions"]))[t] or [str(i) for i in pos["ids"]]
        entries = "  ".join(f"{n!r}:{math.exp(lp):.3f}" for n, lp in list(zip(names, pos["logprobs"]))[:top])
        typer.echo(f"{t:5d} {tokens[t]!r:>14} -> {tokens[t + 1]!r:<14} target p={math.exp(pos['target_logprob']):.3f} "
                   f"tail={pos['tail']:.3f} | {entries}")


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
def tag(store: StoreArg, name: Annotated[str, typer.Argument(help="Tag name.")], version: VersionOpt = None) -> None:
    """Name a version (default: the tip of main). Tags never move."""
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
        _print_json({"version": report.version, "ok": report.ok, "samples": report.samples, "damaged": report.damaged})
    elif report.ok:
        typer.echo(f"ok: version {report.version}, {report.samples} samples in {report.parts} parts are whole")
    else:
        for sample, problem in sorted(report.damaged.items()):
            typer.echo(f"damaged: {sample}: {problem}", err=True)
        typer.echo(f"{len(report.damaged)} of {report.samples} samples damaged in version {report.version}", err=True)
    if not report.ok:
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
