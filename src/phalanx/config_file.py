"""A run described in a TOML file: ``phalanx train --config run.toml`` (and ``phalanx compare --config``).

The file holds the command's own flags, by name (``batch_size`` or ``batch-size``), with TOML's values; tables
only group them (``[optimisation]``, ``[diloco]``), so a key means the same wherever it stands. Every value
goes through the converter its flag's text goes through (``lr = 0.05`` is read as ``--lr 0.05``), so the file
and the command line cannot disagree, and a flag typed on the command line overrides the file's value.

A run writes what it resolved (the recipe's values filled in) as ``config.toml`` beside its checkpoints, in
the same form: ``--config`` of a saved run repeats it. Reading uses Python's own ``tomllib``; the writer is
the few lines TOML's scalars, strings and arrays need.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

from .errors import PhalanxError
from .files import replace_private

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover (Python 3.10: the same parser, published as tomli)
    import tomli as tomllib

#: the name a run's resolved configuration is saved under, in its checkpoint directory
SAVED_NAME = "config.toml"


def add_flag(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` on a command whose flags a file may hold."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="a TOML file of this command's flags, by name (lr = 0.05), grouped in tables as you "
                             "like; a saved run's config.toml repeats it; a flag typed with it overrides its "
                             "value (default: none)")


def read(path: str | Path) -> dict[str, tuple[Any, str]]:
    """The file's keys, normalised to ``snake_case``, each with its value and where it stands (for messages)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except FileNotFoundError:
        raise PhalanxError(f"--config {path} does not exist; pass a TOML file (a saved run's is "
                           f"<checkpoint dir>/{SAVED_NAME})") from None
    except IsADirectoryError:
        raise PhalanxError(f"--config {path} is a directory; pass its {SAVED_NAME} or another TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise PhalanxError(f"--config {path} is not valid TOML ({e}); fix that line") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PhalanxError(f"--config {path} cannot be read ({e})") from None
    values: dict[str, tuple[Any, str]] = {}
    for key, value in document.items():
        if isinstance(value, dict):
            for inner, item in value.items():
                if isinstance(item, dict):
                    raise PhalanxError(f"--config {path}: [{key}.{inner}] nests a table in a table; tables only "
                                       f"group flags, one level deep")
                _add(values, inner, item, f"[{key}] {inner}", path)
        else:
            _add(values, key, value, key, path)
    return values


def _add(values: dict[str, tuple[Any, str]], key: str, value: Any, where: str, path: Path) -> None:
    name = key.replace("-", "_")
    if name in values:
        raise PhalanxError(f"--config {path} sets {name} twice ({values[name][1]} and {where}); keep one")
    values[name] = (value, where)


def apply(path: str | Path, parser: argparse.ArgumentParser, args: argparse.Namespace,
          skip: Iterable[str] = ("config",)) -> list[str]:
    """Set on ``args`` every value of the file whose flag the user did not type; return the names set.

    A key that is no flag of ``parser`` is refused naming the nearest ones, as a mistyped flag is."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in skip}
    for known in list(actions.values()):  # a flag renamed from its field (--timeout for timeout_s) by either name
        for option in known.option_strings:
            actions.setdefault(option.lstrip("-").replace("-", "_"), known)
    applied = []
    for name, (value, where) in read(path).items():
        action = actions.get(name)
        if action is None:
            raise PhalanxError(f"--config {path}: {where} is not an option of phalanx {parser.prog.split()[-1]}"
                               f"{_nearest(name, actions)}; see --help for every flag")
        if getattr(args, action.dest, None) is not None:
            continue  # typed on the command line: the flag wins
        setattr(args, action.dest, _converted(action, value, f"--config {path}: {where}"))
        applied.append(action.dest)
    return applied


def _nearest(name: str, names: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(names), n=2)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def _converted(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` as the flag's text would be read: a boolean flag takes true or false, every other flag the
    text TOML's value spells (an array as the comma-separated list a flag takes)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise PhalanxError(f"{where} = {value!r}: this flag is on or off, so write true or false")
        return value
    if isinstance(value, bool):
        raise PhalanxError(f"{where} = {str(value).lower()}: this flag takes a value, not true or false")
    text = ",".join(_text(v) for v in value) if isinstance(value, list) else _text(value)
    convert = action.type if callable(action.type) else str
    try:
        return convert(text)
    except (argparse.ArgumentTypeError, ValueError, PhalanxError) as e:
        raise PhalanxError(f"{where} = {value!r}: {e}") from None


def _text(value: Any) -> str:
    if isinstance(value, (dict, list)):
        raise PhalanxError(f"a value inside an array must be a number or a string, not {value!r}")
    return repr(value) if isinstance(value, float) else str(value)


def render(tables: Mapping[str, Mapping[str, Any]], comment: str = "") -> str:
    """TOML text for ``{table: {key: value}}``: None values left out, tuples and lists as arrays."""
    lines = [f"# {line}" for line in comment.splitlines()]
    for table, entries in tables.items():
        kept = {k: v for k, v in entries.items() if v is not None}
        if kept:
            lines += ["", f"[{table}]", *(f"{key} = {_toml(value)}" for key, value in kept.items())]
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a TOML basic string


def write(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once (a reader never sees half a file), readable by its owner alone."""
    replace_private(path, text)
