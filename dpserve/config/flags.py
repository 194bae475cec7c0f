"""How a config's options are spelled on a command line, and what derives from that.

A config (``WorkerConfig``, ``RouterConfig``) is a frozen dataclass; each field that
is a flag carries a ``Flag`` (its help, parser and name) beside its default. From
that one spelling come a command's argparse (``add_flags``), the config a parsed
command line gives (``from_args``), the flags another process passes on
(``to_flags``: ``serve`` to its replicas, the operator to its pods) and the
defaults that settings elsewhere mirror (``default_of``). Stdlib only.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def model_source(text: str) -> Path | str:
    """A model: a local folder (a Path), or a URI ``dpserve.sources.uri.parse`` takes,
    checked now and kept as text (a Path would fold the ``//`` of ``hf://``) until it
    is fetched."""
    from dpserve.sources.uri import BadUri, LocalSource, parse

    try:
        source = parse(text)
    except BadUri as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return source.path if isinstance(source, LocalSource) else text


@dataclass(frozen=True)
class Flag:
    """How a config field is spelled on its command's command line."""

    help: str
    parse: Callable[[str], Any] = str
    name: str | None = None  # default: --field-name
    choices: tuple[str, ...] | None = None
    # ``dpserve serve`` takes it too (a worker's: shared by every replica of the set,
    # a gang option); False: only the process's own command has it.
    serve: bool = True
    many: bool = False  # repeatable: the field is a tuple, one flag per item
    switch: bool = False  # a boolean: the bare flag turns it on


def flag(help: str, parse: Callable[[str], Any] = str, **kw: Any) -> dict[str, Flag]:
    """A field's metadata: ``field(default=..., metadata=flag("help", parser))``."""
    return {"flag": Flag(help, parse, **kw)}


Field = dataclasses.Field[Any]


def flag_fields(config: type[Any], serve_only: bool = False) -> Iterator[tuple[Field, Flag]]:
    """The fields that are flags, in declaration order (the order of --help and of flags)."""
    for f in dataclasses.fields(config):
        spelled = f.metadata.get("flag")
        if spelled is not None and (spelled.serve or not serve_only):
            yield f, spelled


def flag_name(f: Field, spelled: Flag) -> str:
    return spelled.name or "--" + f.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, config: type[Any], serve_only: bool) -> None:
    """One argument per flag field: its parser, help and default (required without one)."""
    for f, spelled in flag_fields(config, serve_only):
        name = flag_name(f, spelled)
        if spelled.switch:
            parser.add_argument(name, dest=f.name, action="store_true", help=spelled.help)
            continue
        kw: dict[str, Any] = {"dest": f.name, "type": spelled.parse, "help": spelled.help}
        if spelled.choices is not None:
            kw["choices"] = spelled.choices
        else:
            kw["metavar"] = name.removeprefix("--").replace("-", "_").upper()
        if spelled.many:
            kw["action"] = _Append
        if f.default is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = f.default
        parser.add_argument(name, **kw)


class _Append(argparse.Action):
    """``action="append"`` onto a tuple default (argparse's own needs a list)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, (*getattr(namespace, self.dest, ()), values))


def add_flag(parser: argparse.ArgumentParser, config: type[Any], name: str) -> None:
    """One flag field of ``config`` on another command (``dpserve fetch`` takes the
    worker's ``--model-cache``), spelled as its own command spells it."""
    scratch = argparse.ArgumentParser(add_help=False)
    add_flags(scratch, config, serve_only=False)
    (action,) = [a for a in scratch._actions if a.dest == name]
    kw = {"dest": name, "type": action.type, "help": action.help, "default": action.default}
    parser.add_argument(*action.option_strings, metavar=action.metavar, **kw)


def from_args(config: type[Any], args: argparse.Namespace, serve_only: bool) -> dict[str, Any]:
    """The flag fields' values of a parsed command line (``add_flags``), by field name."""
    return {f.name: getattr(args, f.name) for f, _ in flag_fields(config, serve_only)}


def to_flags(config: type[Any], command: str, options: Mapping[str, object]) -> list[str]:
    """``command``'s flags for some options, keyed by field name of ``config``.

    Flags come in field order; an option that is None is left out (the command's
    default applies), and so is a switch that is off. A name that is no flag is an
    error.
    """
    unknown = set(options) - {f.name for f, _ in flag_fields(config)}
    if unknown:
        raise ValueError(f"not {command} flags: {sorted(unknown)}")
    out: list[str] = []
    for f, spelled in flag_fields(config):
        value = options.get(f.name)
        if value is None:
            continue
        if spelled.switch:  # on: the bare flag; off: nothing
            out += [flag_name(f, spelled)] if value else []
            continue
        items = value if spelled.many and isinstance(value, tuple | list) else [value]
        for item in items:  # a repeatable flag: once per item (none for an empty tuple)
            out += [flag_name(f, spelled), str(item)]
    return out


def default_of(config: type[Any], name: str) -> Any:
    """A config field's default, for settings elsewhere that mirror it."""
    f = config.__dataclass_fields__[name]
    if f.default is dataclasses.MISSING:
        raise ValueError(f"{config.__name__}.{name} has no default")
    return f.default
