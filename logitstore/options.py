"""Options declared once, beside the config field they set.

A field of a config dataclass made with `option(...)` is also a command-line flag and a config-file key:
its help text, help panel and choices sit in the field's metadata. `group(...)` marks a field whose value
is made from several flags (a nested config, or e.g. the sparsity from --top-k/--top-p/--sample), and
`option_of(...)` a field that is another config's flag (live mode's build flags). From these declarations:

    declared(cls)            the flags of a config type, flat, in field order (`Declared`)
    from_values(cls, values) the config made from flat values by flag name (a config file, parsed flags)
    to_values(cfg)           the inverse: what a config file holds to make `cfg` again
    coerce(d, value)         a config file's value as the flag's type (a one-line error naming the key)
    read_file(path, flags)   a YAML or TOML config file's values; `dump(values)` writes one

The CLI (`cli/flags.py`) turns `declared(...)` into typer options, so a flag's name, default, help and
choices exist in one place, and `--config FILE` and `--print-config` use the same names. Nothing here
imports typer, torch or numpy (PyYAML: 10-30 ms): a config module that declares options stays cheap to import, which is
what lets the CLI build its flags, and refuse a bad one, before any heavy import.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import tomllib
import typing
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from logitstore.errors import LogitstoreError, quoted

KEY = "logitstore.option"  # the field metadata key
FIELD_DEFAULT: Any = object()  # `Flag.cli_default` when the flag's default is the field's


class OptionError(LogitstoreError):
    """A config file's key or value that no flag takes; the message names it."""


@dataclass(frozen=True)
class Flag:
    """How a field is set from the command line and from config files."""

    help: str
    panel: str | None = None  # the --help panel it is listed in (None: "Options")
    name: str | None = None  # the flag's name when it is not the field's (LossConfig.kind is --loss)
    choices: Callable[[], Iterable[str]] | None = None  # a registry's names, read when the CLI is built
    value_type: Any = None  # the flag's value type, when not the field's (a dict field given as NAME=VALUE list)
    cli_default: Any = FIELD_DEFAULT  # the flag's value when not given, when not the field's default
    required: bool = False  # the command refuses to run without it (from a flag or a config file)
    parse: Callable[[Any], Any] | None = None  # flag value -> field value (default: lists become tuples)
    show: Callable[[Any], Any] | None = None  # field value -> flag value (the inverse, for `to_values`)


@dataclass(frozen=True)
class Group:
    """A field made from several flags: those `of` declares. `parse` makes the field's value from their
    values (default: `from_values(of, ...)`), `show` the inverse (default: `to_values`). `adjust` rewrites
    each flag as this field offers it (another help text or panel); `exclude` leaves flags out."""

    of: type
    parse: Callable[[dict[str, Any]], Any] | None = None
    show: Callable[[Any], dict[str, Any]] | None = None
    adjust: Callable[[Declared], Declared] | None = None
    exclude: tuple[str, ...] = ()


def option(default: Any = MISSING, *, default_factory: Any = MISSING, repr: bool = True, **flag: Any) -> Any:
    """A dataclass field that is a flag: `option(256, help="Tokens per packed row.", panel="Data")`.
    Keywords other than the defaults and `repr` (False: a secret, left out of the config's repr) are
    `Flag`'s. Typed `Any`, as `dataclasses.field` is for checkers."""
    return field(default=default, default_factory=default_factory, repr=repr, metadata={KEY: Flag(**flag)})


def group(of: type, *, default: Any = MISSING, default_factory: Any = MISSING, **how: Any) -> Any:
    """A dataclass field made from the flags of `of` (see `Group`)."""
    return field(default=default, default_factory=default_factory, metadata={KEY: Group(of, **how)})


def option_of(of: type, name: str, *, adjust: Callable[[Declared], Declared]) -> Any:
    """A dataclass field that is field `name` of config type `of`, declared there once: the same default
    and flag, which `adjust` rewrites as this type offers it (another help text or panel, as
    `Group.adjust`; the default it gives is the flag's value when not given)."""
    (f,) = [f for f in dataclasses.fields(of) if f.name == name]
    flag = f.metadata.get(KEY)
    assert isinstance(flag, Flag), f"{of.__name__}.{name} is not a flag"
    offered = adjust(_declared(of, f, flag))
    flag = dataclasses.replace(offered.flag, cli_default=offered.default)
    return field(default=f.default, default_factory=f.default_factory, repr=f.repr, metadata={KEY: flag})


@dataclass(frozen=True)
class Declared:
    """One flag of a config type, as a command offers it."""

    name: str  # as a Python name: the key in values and config files (`seq_len`); the flag is `--seq-len`
    flag: Flag
    value_type: Any  # the type of its value (evaluated: `int`, `str | None`, `tuple[str, ...]`)
    default: Any  # its value when not given

    @property
    def dashed(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The registry's names, or the values of a `Literal`-typed flag."""
        if self.flag.choices is not None:
            return tuple(self.flag.choices())
        literal = [t for t in (self.value_type, *typing.get_args(self.value_type)) if typing.get_origin(t) is Literal]
        return typing.get_args(literal[0]) if literal else None


def declared(cls: type) -> list[Declared]:
    """The flags of config type `cls` (and of its groups, in place), in field order."""
    out: list[Declared] = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(KEY)
        if isinstance(meta, Flag):
            out.append(_declared(cls, f, meta))
        elif isinstance(meta, Group):
            flags = [d for d in declared(meta.of) if d.name not in meta.exclude]
            out.extend(map(meta.adjust, flags) if meta.adjust else flags)
    out = [_nullable(d) for d in out]
    names = [d.name for d in out]
    assert len(names) == len(set(names)), f"{cls.__name__} declares a flag twice: {names}"
    return out


def _nullable(d: Declared) -> Declared:
    """A flag whose value when not given is None takes None (live mode's flags: "not given"), whatever
    its field holds."""
    if d.default is None and type(None) not in typing.get_args(d.value_type):
        return dataclasses.replace(d, value_type=d.value_type | None)
    return d


def _declared(cls: type, f: dataclasses.Field, flag: Flag) -> Declared:
    if flag.cli_default is not FIELD_DEFAULT:
        default = flag.cli_default
    elif f.default is not MISSING:
        default = f.default
    else:
        assert f.default_factory is not MISSING, f"{cls.__name__}.{f.name}: a flag needs a default"
        default = f.default_factory()
    value_type = flag.value_type if flag.value_type is not None else _field_type(cls, f)
    return Declared(name=flag.name or f.name, flag=flag, value_type=value_type, default=default)


def _field_type(cls: type, f: dataclasses.Field) -> Any:
    """The field's annotation, evaluated in its module (annotations are strings there)."""
    if not isinstance(f.type, str):
        return f.type
    return eval(f.type, vars(sys.modules[cls.__module__]))  # noqa: S307 - the module's own annotation


def from_values(cls: type, values: dict[str, Any]) -> Any:
    """The config `cls(...)` whose flags take `values` (by flag name; flags left out keep their defaults)."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(KEY)
        if isinstance(meta, Flag):
            name = meta.name or f.name
            if name in values:
                kwargs[f.name] = meta.parse(values[name]) if meta.parse else _as_field(values[name])
        elif isinstance(meta, Group):
            mine = {d.name: values[d.name] for d in declared(meta.of) if d.name in values}
            if meta.parse is not None:
                kwargs[f.name] = meta.parse(mine)
            elif mine:
                kwargs[f.name] = from_values(meta.of, mine)
    return cls(**kwargs)


def to_values(cfg: Any) -> dict[str, Any]:
    """The values by flag name that make `cfg` again (`from_values(type(cfg), to_values(cfg))`)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        meta = f.metadata.get(KEY)
        value = getattr(cfg, f.name)
        if isinstance(meta, Flag):
            out[meta.name or f.name] = meta.show(value) if meta.show else _as_flag(value)
        elif isinstance(meta, Group):
            shown = meta.show(value) if meta.show else to_values(value)
            out.update({k: v for k, v in shown.items() if k not in meta.exclude})
    return out


def _as_field(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _as_flag(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# -- config-file values -------------------------------------------------------------------------------


def coerce(d: Declared, value: Any, *, where: str) -> Any:
    """A config file's `value` for flag `d`, as the flag's type: YAML and TOML give numbers, booleans,
    strings and lists, and a number may arrive as a string (YAML reads 3e-3 as one). `where` names the
    file in the error."""
    try:
        return _coerce(d.value_type, value, d.choices)
    except (TypeError, ValueError) as e:
        raise OptionError(f"{where}: {d.name}: {e}") from None


def _coerce(value_type: Any, value: Any, choices: tuple[str, ...] | None) -> Any:
    args = typing.get_args(value_type)
    if type(None) in args:  # X | None
        if value is None:
            return None
        (value_type,) = [a for a in args if a is not type(None)]
        args = typing.get_args(value_type)
    origin = typing.get_origin(value_type)
    if origin in (list, tuple):
        items = value if isinstance(value, list) else [value]
        return [_coerce(args[0], item, choices) for item in items]
    if choices is not None and value not in choices:
        raise ValueError(f"{quoted(value)} is not one of {', '.join(choices)}")
    return _scalar(value_type, value)


def _scalar(value_type: Any, value: Any) -> Any:
    if value_type is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {quoted(value)}")
        return value
    if isinstance(value, bool) or isinstance(value, (list, dict)) or value is None:
        raise ValueError(f"expected {getattr(value_type, '__name__', value_type)}, got {quoted(value)}")
    if value_type is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"expected an integer, got {quoted(value)}")
        return in_range(int(value) if not isinstance(value, str) else int(value.replace("_", "")))
    if value_type is float:
        return float(value)
    if value_type is str or typing.get_origin(value_type) is typing.Literal:  # a choice: `choices` checked it
        return str(value)
    raise TypeError(f"a flag of type {value_type} cannot come from a config file")


def refuse_failed(checks: Iterable[tuple[bool, str]], error: type[Exception]) -> None:
    """Raise `error(message)` for the first `(ok, message)` check that failed: how every config type's
    `__post_init__` turns its checks into one line naming the flag."""
    for ok, message in checks:
        if not ok:
            raise error(message)


def in_range(value: int) -> int:
    """`value` if a 64-bit integer holds it (what numpy, Arrow and the C library take as a count or an
    index): every integer option, on the command line or in a file, is one."""
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{value} is out of range (at most {2**63 - 1})")
    return value


# -- config files ---------------------------------------------------------------------------------------


def parse_weights(
    values: list[str] | tuple[str, ...] | None, *, flag: str, what: str, placeholder: str
) -> dict[str, float] | None:
    """`["A=0.7", "B=0.3"]` -> {"A": 0.7, "B": 0.3}; order kept. `flag`, `what` and `placeholder` name them in errors."""
    if not values:
        return None
    out: dict[str, float] = {}
    for value in values:
        name, sep, weight = value.partition("=")
        try:
            w = float(weight)
        except ValueError:
            w = math.nan
        if not sep or not name or not math.isfinite(w) or w <= 0:
            raise OptionError(f"{flag} {value!r}: expected {placeholder}=WEIGHT with a weight > 0")
        if name in out:
            raise OptionError(f"{flag}: {what} {name!r} given twice")
        out[name] = w
    return out


def show_weights(weights: dict[str, float] | None) -> list[str]:
    """A `parse_weights` value as its flags' values."""
    return [f"{name}={weight}" for name, weight in (weights or {}).items()]


def read_file(
    path: str | Path, flags: Sequence[Declared], *, command: str, command_line_only: Iterable[str] = ()
) -> dict[str, Any]:
    """The values a config file sets, by flag name: YAML (.yaml, .yml, .json) or TOML (.toml), one mapping
    whose keys are flag names (`seq_len` or `seq-len`), each once. A key no flag of `logitstore {command}`
    has, one of its `command_line_only` options (`--json`, `--config`: what the command does, not what
    it computes), a key given twice or a value of the wrong type is one line naming it (`OptionError`)."""
    path = Path(path)
    where = f"--config {path}"
    data = _parse(path, where=where)
    by_name = {d.name: d for d in flags}
    out = {}
    keys: dict[str, Any] = {}  # the key each flag was given as: `seq_len` and `seq-len` are one key
    for key, value in data.items():
        name = str(key).replace("-", "_")
        dashed = "--" + name.replace("_", "-")
        if name in keys:
            raise OptionError(f"{where}: key {quoted(key)} is given twice (also as {quoted(keys[name])})")
        keys[name] = key
        if name in command_line_only:
            raise OptionError(
                f"{where}: {quoted(key)} is not allowed in a config file ({dashed} is a command-line flag)"
            )
        if name not in by_name:
            near = difflib.get_close_matches(name, by_name, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise OptionError(f"{where}: unknown key {quoted(key)}: `logitstore {command}` has no {dashed}{hint}")
        out[name] = coerce(by_name[name], value, where=where)
    return out


class _DuplicateKey(Exception):
    def __init__(self, key: Any, lines: tuple[int, int]):
        self.key, self.lines = key, lines


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may repeat keys: the mapping's own win
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, Hashable) and key in seen:
                raise _DuplicateKey(key, (seen[key], line))
            if isinstance(key, Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _parse(path: Path, *, where: str) -> dict:
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json", ".toml"):
        raise OptionError(f"{where}: a config file is .yaml, .yml, .json or .toml")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise OptionError(f"{where}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise OptionError(f"{where}: not UTF-8 text (byte {e.start})") from None
    try:
        data = tomllib.loads(text) if suffix == ".toml" else yaml.load(text, Loader=_Loader)  # noqa: S506 - safe
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        first = " ".join(str(e).split())  # one line
        raise OptionError(f"{where}: not valid {'TOML' if suffix == '.toml' else 'YAML'}: {first}") from None
    except _DuplicateKey as e:
        raise OptionError(
            f"{where}: key {quoted(e.key)} is given twice (lines {e.lines[0]} and {e.lines[1]})"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OptionError(f"{where}: expected a mapping of flag names to values, got {type(data).__name__}")
    return data


def dump(values: dict[str, Any], *, command: str) -> str:
    """`values` as a YAML config file for `logitstore {command} --config`."""
    header = f"# logitstore {command}: `logitstore {command} --config THIS_FILE` runs it (flags override it)\n"
    return header + yaml.safe_dump(values, sort_keys=False, allow_unicode=True)
