"""The `logitstore` command line: thin typed functions that parse, call the library, and print
(`cli/text.py` holds what they print when not asked for `--json`).

Exit codes (docs/exit-codes.md, `logitstore.errors`): 0 success, 1 damaged data (`verify` found damage,
or a read hit it), 2 a user error or a storage outage (one line on stderr, no traceback), 130
interrupted (Ctrl-C, or the output's reader went away).
Each command imports the machinery it needs inside its function: at the top, the build's and the
trainer's modules (torch, transformers) would cost seconds at every `--help`, `info` and `show`.

`build`, `train`, `eval` and `rounds` take their options from the configuration types
(`pipelines/config.py`, `trainer/config.py` through `cli/train_options.py`, `cli/rounds.py`): `cli/flags.py`
makes the typer options from the fields' declarations, and `resolve` layers defaults, a run folder's kept
configuration, `--config FILE` and the flags given.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

import typer
from typer.models import CommandInfo

from logitstore.cli import text
from logitstore.cli.flags import (
    Command,
    ConfigOpt,
    Given,
    JsonOpt,
    PrintConfigOpt,
    Program,
    json_option,
    resolve,
    takes,
    user_errors,
)
from logitstore.cli.rounds import Rounds, run_rounds
from logitstore.cli.train_options import EVAL_FLAGS, TRAIN_FLAGS, LiveOpt, train_config
from logitstore.errors import LogitstoreError
from logitstore.options import declared, dump, from_values, to_values
from logitstore.pipelines.config import PANELS as BUILD_PANELS
from logitstore.pipelines.config import BuildConfig, DataSource
from logitstore.trainer.config import PANELS, TrainConfig

app = typer.Typer(
    name="logitstore",
    help="Offline distillation: a versioned store of sparse teacher next-token distributions.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    cls=Program,
)

StoreArg = Annotated[str, typer.Argument(help="Store location: a path, file://, s3://bucket/prefix or memory://name.")]
VersionOpt = Annotated[Optional[str], typer.Option("--version", help="Version id, tag or branch (default: main).")]
TeacherOpt = Annotated[Optional[str], typer.Option(help="Teacher name, when the store holds several.")]
JsonOutputOpt = Annotated[bool, json_option("Output")]  # build's and train's, in their Output panel

# The order commands are listed in --help: the order of use.
COMMAND_ORDER = (
    "build",
    "train",
    "eval",
    "rounds",
    "info",
    "ls",
    "show",
    "export",
    "report",
    "diff",
    "log",
    "tag",
    "verify",
)


def _open(store: str, *, create: bool = False):
    from logitstore.store.store import Store

    return Store.open(store, create=create)


@app.command(cls=Command)
@user_errors
def info(store: StoreArg, version: VersionOpt = None, json_out: JsonOpt = False) -> None:
    """Samples, tokens, stored bytes, bytes per token and teachers of a version."""
    summary = _open(store).read(version).info()
    if json_out:
        text.print_json(summary)
        return
    text.print_info(summary)


@app.command(cls=Command)
@user_errors
def show(
    store: StoreArg,
    sample_id: Annotated[str, typer.Argument(help="The sample's id.")],
    teacher: TeacherOpt = None,
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
    from logitstore.store.show import parse_positions, position_slice, sample_as_json

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
        text.print_json(obj)
        return
    if student_tokenizer is not None:
        text.print_alignment(obj, student_tokenizer=student_tokenizer)
        return
    text.print_sample(obj, first=first, top=top)


@app.command(cls=Command)
@user_errors
def export(
    store: StoreArg,
    out: Annotated[
        str, typer.Argument(help="The file to write: .jsonl or .json (JSON lines), or .parquet (entries: .parquet).")
    ],
    what: Annotated[
        Literal["answers", "entries"],
        typer.Option(
            help="answers: generated answers as chat rows; entries: the teacher's entries, a row per position."
        ),
    ] = "answers",
    teacher: TeacherOpt = None,
    version: VersionOpt = None,
    samples: Annotated[Optional[str], typer.Option(help="Entries: only the sample ids in FILE, one a line.")] = None,
    limit: Annotated[Optional[int], typer.Option(min=0, help="Entries: only the first N samples.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Entries: replace OUT if it exists.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """The generated answers (build --generate) as chat rows for datasets.load_dataset: prompt_id, sample,
    messages (the prompt's turns, then the answer as the assistant's) and generation. With --what entries,
    the teacher's entries as Parquet, one row per position: sample, position, token, next_token, ids,
    logprobs, tail, target_logprob (and counts, for a sampled teacher)."""
    from pathlib import Path

    if what == "entries":
        from logitstore.store.entries import check_entries_path, selection_of, write_entries

        check_entries_path(Path(out), force=force)  # before the store is read
        selection = selection_of(teacher=teacher, samples=samples, limit=limit)
        view = _open(store).read(version)
        progress = text.ProgressLines("export")
        summary = write_entries(view, Path(out), selection=selection, force=force, progress=progress)
    else:
        from logitstore.store.answers import ExportError, check_export_path, write_answers

        if samples is not None or limit is not None:
            raise ExportError("--samples and --limit select entries; use them with --what entries")
        check_export_path(Path(out))  # before the store is read
        summary = write_answers(_open(store).read(version), Path(out), teacher=teacher)
    if json_out:
        text.print_json(summary)
    elif what == "entries":
        text.print_entries_export(summary)
    else:
        text.print_export(summary)


@app.command(cls=Command)
@user_errors
def report(
    store: Annotated[str, typer.Argument(help="Store location (as for info), or a training run's --out folder.")],
    version: VersionOpt = None,
    out: Annotated[
        Optional[str],
        typer.Option(
            help="The report: .html (one file, pictures inline) or .md (pictures in NAME_files/). Default for a "
            "store: report.html; for a run folder: its training.png, drawn in the folder."
        ),
    ] = None,
) -> None:
    """A one-page report with plots of a version (per teacher: entries, entropy, tail mass, values on the
    grid, bytes per part, top-1 agreement, odd samples); of a run folder, its training curves."""
    from pathlib import Path

    from logitstore.store.report import check_out
    from logitstore.trainer.plots import is_run_folder

    if is_run_folder(Path(store)):  # its curves, drawn now (also mid-run)
        from logitstore.store.report import write_page
        from logitstore.trainer.plots import plot_metrics, run_sections

        if version is not None:
            raise LogitstoreError(f"--version names a store version; {store} is a training run's folder")
        if out is None:
            typer.echo(f"wrote {plot_metrics(Path(store))}")
            return
        page = check_out(Path(out))
        typer.echo(f"wrote {write_page(run_sections(Path(store)), page)}")
        return
    from logitstore.store.report import write_report

    page = check_out(Path(out or "report.html"))  # before the store is read
    typer.echo(f"wrote {write_report(_open(store).read(version), page, store=store)}")


@app.command(name="ls", cls=Command)
@user_errors
def ls(
    store: StoreArg,
    version: VersionOpt = None,
    limit: Annotated[Optional[int], typer.Option(min=0, help="List only the first N samples.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """The stored samples: id, tokens and teacher, in the order they were written."""
    from logitstore.store.show import list_samples

    view = _open(store).read(version)
    rows = list_samples(view, limit=limit)
    if json_out:
        text.print_json(rows)
        return
    text.print_samples(rows, total=view.index.num_rows)


@app.command(cls=Command)
@user_errors
def log(store: StoreArg, version: VersionOpt = None, json_out: JsonOpt = False) -> None:
    """Versions, newest first, with their tags."""
    versions = _open(store).log(version)
    if json_out:
        text.print_json([v.__dict__ for v in versions])
        return
    text.print_log(versions)


@app.command(cls=Command)
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


@app.command(cls=Command)
@user_errors
def diff(
    store: StoreArg,
    a: Annotated[str, typer.Argument(help="The older version, tag or branch.")],
    b: Annotated[str, typer.Argument(help="The newer version, tag or branch.")],
    json_out: JsonOpt = False,
) -> None:
    """Samples added, removed and changed between two versions."""
    from logitstore.store.index import diff_indexes

    s = _open(store)
    changes = diff_indexes(s.read_index(s.resolve(a)), s.read_index(s.resolve(b)))
    if json_out:
        text.print_json(changes)
        return
    text.print_diff(changes)


@app.command(cls=Command)
@user_errors
def verify(store: StoreArg, version: VersionOpt = None, json_out: JsonOpt = False) -> None:
    """Read every chunk of a version; exit 1 and list the damaged samples if any."""
    from logitstore.store.verify import verify as run_verify

    report = run_verify(_open(store).read(version))
    if json_out:
        text.print_json(text.verify_json(report))
    else:
        text.print_verify(report)
    if not report.ok:
        raise typer.Exit(1)


BUILD_FLAGS = declared(BuildConfig)


@app.command(cls=Command)
@user_errors
@takes(BUILD_FLAGS, panels=BUILD_PANELS)
def build(
    config: ConfigOpt = None,
    print_config: PrintConfigOpt = False,
    json_out: JsonOutputOpt = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            rich_help_panel="Output",
            help="Write nothing: tokenize the input (a sample of a large one), run the teacher on a few batches, and print the expected tokens, samples, store size and time on this machine.",
        ),
    ] = False,
    *,
    given: Given,
) -> None:
    """Run a teacher over a dataset and commit its sparse next-token distributions as a new version."""
    from logitstore.pipelines.inputs import check_input

    values = resolve(BUILD_FLAGS, given, config=config, command="build")
    teachers = list(values.pop("teacher") or [None])  # one BuildConfig per teacher (`run_builds`)
    if print_config:  # the options, checked; the input is not read
        resolved = {**to_values(from_values(BuildConfig, values)), "teacher": [t for t in teachers if t]}
        typer.echo(dump(resolved, command="build"), nl=False)
        return
    # The input before anything heavy (torch, a teacher, a store): a wrong path or column shows in ~1 s.
    source = DataSource(values["data"], values["split"], values["data_config"]).source()
    columns = ("text_column", "id_column", "ids_column", "chat_column", "prompt_column")
    check_input(source, **{k: values[k] for k in columns})
    cfg = from_values(BuildConfig, values)
    if dry_run:
        text.print_dry_run(cfg, teachers, json_out=json_out)
        return
    from logitstore.pipelines.build import run_builds
    from logitstore.pipelines.summary import summary_json

    summary = run_builds(cfg, teachers)
    if json_out:
        typer.echo(summary_json(summary))
    else:
        text.print_build(summary, cfg)


@app.command(cls=Command)
@user_errors
@takes(TRAIN_FLAGS, panels=PANELS)
def train(
    config: ConfigOpt = None,
    print_config: PrintConfigOpt = False,
    json_out: JsonOutputOpt = False,
    live: LiveOpt = False,
    *,
    given: Given,
) -> None:
    """Train a student from a store version with FSDP2; no teacher runs."""
    cfg = train_config(given, config=config, live=live)  # checked before torch loads
    if print_config:
        typer.echo(dump(to_values(cfg), command="train"), nl=False)
        return
    from logitstore.trainer.stopping import ended_when_stopped
    from logitstore.trainer.train import launch

    with ended_when_stopped():
        final = launch(cfg)
    if json_out:
        text.print_json(final)
        return
    held_out = f", held-out KL {final['eval_kl']:.4f}" if "eval_kl" in final else ""
    typer.echo(
        f"done: step {final.get('step', '-')}{held_out}; the student is in {cfg.output.out}/final, "
        f"the curves in {cfg.output.out}/training.png"
    )


@app.command(name="eval", cls=Command)
@user_errors
@takes(EVAL_FLAGS)
def eval_(
    config: ConfigOpt = None,
    print_config: PrintConfigOpt = False,
    json_out: JsonOpt = False,
    *,
    given: Given,
) -> None:
    """The student's mean KL to the stored teacher (`kl`) and cross-entropy (`ce`) on held-out samples."""
    values = resolve(EVAL_FLAGS, given, config=config, command="eval")
    if print_config:
        typer.echo(dump(values, command="eval"), nl=False)
        return
    cfg = TrainConfig.for_eval(**values)  # the flags' errors before torch loads, as train's
    from logitstore.trainer.train import run_eval

    result = run_eval(cfg)
    if json_out:
        text.print_json(result)
    else:
        typer.echo(
            f"held-out KL to the teacher {result['kl']:.4f} nats/token, CE {result['ce']:.4f} "
            f"(version {values['version'] or 'main'} = {result['version']})"  # the name the user gave, and its snapshot
        )


ROUNDS_FLAGS = declared(Rounds)


@app.command(cls=Command)
@user_errors
@takes(ROUNDS_FLAGS)
def rounds(
    config: ConfigOpt = None,
    print_config: PrintConfigOpt = False,
    json_out: JsonOpt = False,
    *,
    given: Given,
) -> None:
    """On-policy distillation in rounds: the student of round R-1 answers the prompts, the teacher scores the answers, the student trains on them (docs/train.md 'On-policy rounds')."""
    values = resolve(ROUNDS_FLAGS, given, config=config, command="rounds")
    if print_config:
        typer.echo(dump(values, command="rounds"), nl=False)
        return
    options = from_values(Rounds, values)  # the flags' errors, before anything is built
    from logitstore.trainer.stopping import ended_when_stopped

    with ended_when_stopped():
        done = run_rounds(options, log=lambda line: typer.echo(line, err=True))
    if json_out:
        text.print_json(done)
        return
    for r in done:
        typer.echo(
            f"round {r['round']}: version {r['version']} (tag round-{r['round']}), step {r['train'].get('step')}"
        )


@app.callback(invoke_without_command=True)
def _program(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            help="Print the version of logitstore itself and exit (after a command, --version names a store version: an id, tag or branch).",
        ),
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
