"""Options declared once: a dataclass field carries its help, and the CLI flag is made from it.

Every configurable thing in phalanx (the training run, each strategy) is a dataclass whose fields
are declared with :func:`option`: the type, the default and one line of help. :func:`add_flags`
turns such a class into argparse flags (the help shows the default), and :func:`given` reads back
only the flags the user typed, so the dataclass's own defaults and validation stay the one truth.
The CLI and the Python API therefore cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, Iterable, Optional

#: Metadata keys an option may carry.
_HELP, _PARSE, _FLAG, _SHOW, _CHOICES, _EXTRA = "help", "parse", "flag", "show", "choices", "argparse"


def option(default: Any = dataclasses.MISSING, help: str = "", *, parse: Optional[Callable[[str], Any]] = None,
           flag: Optional[str] = None, show: Optional[str] = None, choices: Optional[Iterable[str]] = None,
           argparse_extra: Optional[dict] = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with the help line its CLI flag shows.

    ``parse`` turns the flag's text into the field's value (default: the field's type);
    ``flag`` renames the flag (default ``--field-name``); ``show`` is how the help prints the
    default; ``choices`` are listed in the help (the dataclass still validates).
    """
    metadata = {_HELP: help, _PARSE: parse, _FLAG: flag, _SHOW: show,
                _CHOICES: tuple(choices) if choices else None, _EXTRA: argparse_extra or {}}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get(_FLAG) or "--" + field.name.replace("_", "-")


def declared(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` declared with :func:`option` (the ones that are flags)."""
    return [f for f in dataclasses.fields(cls) if _HELP in f.metadata]


def _base_type(annotation: Any) -> Any:
    """``Optional[int]`` -> int; other unions and generics -> str (they need a ``parse``)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 and args[0] in (int, float, str, bool) else str
    return annotation if annotation in (int, float, str, bool) else str


def _shown_default(field: dataclasses.Field) -> str:
    if field.metadata.get(_SHOW):
        return field.metadata[_SHOW]
    if field.default is dataclasses.MISSING:
        return "required"
    value = field.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return "x".join(map(str, value)) if all(isinstance(v, int) for v in value) else str(value)
    return str(value)


def help_text(field: dataclasses.Field, prefix: str = "") -> str:
    choices = field.metadata.get(_CHOICES)
    listed = f" ({' | '.join(choices)})" if choices else ""
    return f"{prefix}{field.metadata[_HELP]}{listed} (default: {_shown_default(field)})".replace("%", "%%")


def add_flags(group: Any, cls: type, names: Optional[Iterable[str]] = None, prefix: str = "") -> list[str]:
    """Add one flag per declared field of ``cls`` (or those in ``names``) to ``group``; return the names added.

    Every flag's argparse default is None, so :func:`given` can tell what the user typed; the help
    shows the dataclass's own default.
    """
    hints = typing.get_type_hints(cls)
    wanted = None if names is None else set(names)
    added = []
    for field in declared(cls):
        if wanted is not None and field.name not in wanted:
            continue
        kind = _base_type(hints[field.name])
        kwargs: dict[str, Any] = {"dest": field.name, "default": None,
                                  "help": help_text(field, prefix)}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _argparse_type(field.metadata.get(_PARSE) or kind, flag_name(field))
            kwargs["metavar"] = flag_name(field).lstrip("-").upper().replace("-", "_")
        kwargs.update(field.metadata.get(_EXTRA) or {})
        group.add_argument(flag_name(field), **{k: v for k, v in kwargs.items() if v is not None or k == "default"})
        added.append(field.name)
    return added


def _argparse_type(parse: Callable[[str], Any], flag: str) -> Callable[[str], Any]:
    """``parse`` for argparse: a PhalanxError becomes argparse's one-line usage error."""
    from .errors import PhalanxError

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except PhalanxError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        except ValueError:
            kind = {"int": "a whole number", "float": "a number"}.get(getattr(parse, "__name__", ""), "another value")
            raise argparse.ArgumentTypeError(f"{flag} takes {kind}, got {text!r}") from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def given(namespace: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The flags among ``names`` that the user actually typed (argparse default None means not typed)."""
    return {name: getattr(namespace, name) for name in names if getattr(namespace, name, None) is not None}


def field_flag(cls: type, name: str) -> str:
    """The flag of field ``name`` of ``cls`` (for error messages)."""
    for field in dataclasses.fields(cls):
        if field.name == name:
            return flag_name(field)
    return "--" + name.replace("_", "-")


def parsed_as_flag(cls: type, name: str, value: Any) -> Any:
    """A keyword given from Python as the flag's text (``link_bandwidth="25GB/s"``), parsed as the flag
    parses it; any other value (and a name ``cls`` has no field for) as given."""
    field = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    parse = field.metadata.get("parse") if field is not None else None
    return parse(value) if isinstance(value, str) and parse is not None else value
