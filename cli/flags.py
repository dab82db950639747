"""The commands' flags, made from the config types' declarations (`logitstore.options`), and the
layers a command's configuration is resolved from.

How: typer reads a command's options from its function's signature, so `takes(flags)` gives the command
function one: its own parameters plus an `Annotated[T, typer.Option(...)]` parameter per declared flag
(an `inspect.Signature` set as `__signature__`). typer then parses, checks, lists and documents them as if
they were written out, and the function gets them back as one `Given`. Why this way: the flags stay flat
(`--seq-len`) with their help panels, on the parser the CLI already uses. Generators of whole
CLIs from dataclasses (tyro in torchtitan, jsonargparse in litgpt) would replace the parser and name
nested options with dots (`--optim.lr`), which would change every flag.

Layers, later ones winning: each flag's default; a run folder's kept configuration (`train --resume`);
`--config FILE`; the flags given on the command line (`resolve`). `user_errors` wraps every command: a
user's error is one line on stderr with its exit code, never a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import typer
import typer.core

from logitstore.errors import INTERRUPTED, LogitstoreError, capped
from logitstore.options import Declared, OptionError, in_range, read_file

ConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--config",
        help="A YAML or TOML file of options, keyed by flag name (seq_len: 512); flags given as well override it.",
    ),
]
PrintConfigOpt = Annotated[
    bool,
    typer.Option(
        "--print-config",
        help="Print the resolved configuration (defaults, --config, flags) as YAML that --config takes, and exit.",
    ),
]


def json_option(panel: str | None = None) -> Any:
    """`--json`, listed in `panel` of --help (None: "Options")."""
    return typer.Option("--json", help="Print machine-readable JSON.", rich_help_panel=panel)


JsonOpt = Annotated[bool, json_option()]


def _no_value_shown(params: list) -> None:
    """typer 0.29 shows a value placeholder after every option, flags too (`--json <bool>` reads as if it
    took a value, and `--json true` then fails): an on/off flag of ours shows none. Set on our commands'
    options (`Command`, `Program`), not on typer's class."""
    for param in params:
        if getattr(param, "is_flag", False):
            param.display_type_rich = lambda ctx: None


# click's exceptions as the installed typer raises them: click's own, or from typer 0.29 the copy it vendors
# (`typer._click`), which names only BadParameter publicly. click before 8.2 shows a bare command's help
# without raising NoArgsIsHelpError.
T = TypeVar("T")
_CLICK_ERRORS = sys.modules[typer.BadParameter.__module__]
_USAGE_ERROR: type[Exception] = _CLICK_ERRORS.UsageError
_NO_ARGS_IS_HELP: tuple[type[Exception], ...] = tuple(
    e for e in [getattr(_CLICK_ERRORS, "NoArgsIsHelpError", None)] if e is not None
)


def _parsed(parse: Callable[[], T], ctx: Any) -> T:
    """`parse()`, whose usage error (a value of the wrong type, an unknown or missing option or command) is
    one line on stderr and exit 2, as every refusal of ours: typer would draw it in a box under the usage.
    A bare `logitstore` still shows its help (click raises that as a usage error too)."""
    try:
        return parse()
    except _NO_ARGS_IS_HELP:
        raise
    except _USAGE_ERROR as e:
        message = " ".join(e.format_message().split())  # type: ignore[attr-defined]
        typer.echo(f"error: {capped(message)} (see {ctx.command_path} --help)", err=True)
        raise typer.Exit(2) from None


class Command(typer.core.TyperCommand):
    """A command of ours: its on/off flags show no value placeholder in --help; a usage error is one line."""

    def get_params(self, ctx: Any) -> list:
        params = super().get_params(ctx)  # with --help, which click adds here
        _no_value_shown(params)
        return params

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return _parsed(lambda: super(Command, self).parse_args(ctx, args), ctx)


class Program(typer.core.TyperGroup):
    """The top-level command, `Command`'s help for its own flags (`--version`) and its one-line usage errors."""

    def get_params(self, ctx: Any) -> list:
        params = super().get_params(ctx)  # with --help, which click adds here
        _no_value_shown(params)
        return params

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return _parsed(lambda: super(Program, self).parse_args(ctx, args), ctx)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        return _parsed(lambda: super(Program, self).resolve_command(ctx, args), ctx)


@dataclass(frozen=True)
class Given:
    """A command's declared flags as typer parsed them: every value (the default where not given) and
    the names given on the command line; and the names of the command's own options, which a config
    file cannot set (`--config`, `--json`)."""

    values: dict[str, Any]
    named: frozenset[str]
    command_line_only: frozenset[str] = frozenset()

    def on_command_line(self) -> dict[str, Any]:
        return {name: value for name, value in self.values.items() if name in self.named}


def takes(flags: Sequence[Declared], *, panels: Sequence[str] = ()) -> Callable:
    """Give a command function `fn(..., given: Given)` the declared `flags` as typer options, listed by
    `panels` (in that order; others after, in their order)."""

    def decorate(fn: Callable) -> Callable:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())
        assert own and own[-1].name == "given", f"{fn.__name__} takes `given` last"
        params = [_parameter(d) for d in flags] + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[:-1]]
        params.sort(key=lambda p: _rank(_panel(p), panels))
        context = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        command_line_only = frozenset(_flag_name(p) for p in own[:-1])

        @functools.wraps(fn)
        def command(ctx: typer.Context, **kwargs: Any) -> Any:
            values = {d.name: kwargs.pop(d.name) for d in flags}
            named = frozenset(name for name in values if _on_command_line(ctx, name))
            return fn(**kwargs, given=Given(values, named, command_line_only))

        command.__signature__ = inspect.Signature([context, *params])  # type: ignore[attr-defined]
        return command

    return decorate


def resolve(
    flags: Sequence[Declared],
    given: Given,
    *,
    config: str | None,
    command: str,
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every flag's value: its default, then `base`, then the `--config` file, then the command line.
    A required flag still unset is one line naming it."""
    values = {d.name: d.default for d in flags}
    values.update(base or {})
    if config is not None:
        values.update(read_file(config, flags, command=command, command_line_only=given.command_line_only))
    values.update(given.on_command_line())
    missing = [d.dashed for d in flags if d.flag.required and values[d.name] is None]
    if missing:
        raise OptionError(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (a flag, or a key of --config)"
        )
    return values


def pick(flags: Sequence[Declared], changes: dict[str, dict[str, Any]]) -> list[Declared]:
    """The flags named in `changes`, in its order, each with its `Flag` fields changed (a required flag
    has no default)."""
    by_name = {d.name: d for d in flags}
    out = []
    for name, change in changes.items():
        d = by_name[name]
        flag = dataclasses.replace(d.flag, **change)
        out.append(dataclasses.replace(d, flag=flag, default=None if flag.required else d.default))
    return out


def _parameter(d: Declared) -> inspect.Parameter:
    value_type = d.value_type
    args = typing.get_args(value_type)
    optional = type(None) in args or d.default is None
    if type(None) in args:
        (value_type,) = [a for a in args if a is not type(None)]
    many = typing.get_origin(value_type) in (list, tuple)
    item = typing.get_args(value_type)[0] if many else value_type
    choices = d.choices
    if choices is not None:
        item = Literal.__getitem__(choices)  # typer lists and checks these
    cli_type: Any = list[item] if many else item  # type: ignore[valid-type]
    decls: tuple[str, ...] = ()
    if item is bool:
        assert d.default is False, f"{d.dashed}: an on/off flag is off by default"
        decls = (d.dashed,)  # one name, no --no-...
    option = typer.Option(*decls, help=d.flag.help, rich_help_panel=d.flag.panel)
    default = (list(d.default) or None) if many and d.default is not None else d.default
    annotation = Annotated[cli_type | None if optional or many else cli_type, option]  # type: ignore[valid-type]
    return inspect.Parameter(d.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _flag_name(param: inspect.Parameter) -> str:
    """A command's own option as a config file would name it: `json` for `json_out` (`--json`)."""
    info = next((a for a in typing.get_args(param.annotation)[1:] if hasattr(a, "param_decls")), None)
    decls = [] if info is None else [info.default, *info.param_decls]  # typer: the first name is `default`
    dashed = next((d for d in decls if isinstance(d, str) and d.startswith("--")), None)
    return param.name if dashed is None else dashed[2:].replace("-", "_")


def _panel(param: inspect.Parameter) -> str | None:
    info = next((a for a in typing.get_args(param.annotation)[1:] if hasattr(a, "rich_help_panel")), None)
    return None if info is None else info.rich_help_panel


def _rank(panel: str | None, panels: Sequence[str]) -> int:
    if panel is None:
        return -1  # "Options" (with --help, --config) first
    return panels.index(panel) if panel in panels else len(panels)


def _on_command_line(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def user_errors(fn):
    """Print a LogitstoreError as one line (`capped`: whatever it quotes) and exit with its code (2; 1 for
    damaged data); anything else is a bug and keeps its traceback. An integer flag is checked first
    (`in_range`; typer takes any). A reader of the output that went away (`| head`) ends the command as
    interrupted (typer itself would exit 1, the code for damaged data)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            _check_integers(kwargs)
            return fn(*args, **kwargs)
        except LogitstoreError as e:
            typer.echo(f"error: {capped(str(e))}", err=True)
            raise typer.Exit(e.exit_code) from None
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail again
            raise typer.Exit(INTERRUPTED) from None

    return wrapper


def _check_integers(flags: dict) -> None:
    for name, value in flags.items():
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                in_range(value)
            except ValueError as e:
                raise OptionError(f"--{name.replace('_', '-')} {e}") from None
