"""``python3 -m phalanx.options_doc``: docs/flags.md, every command's flags as ``--help`` shows them.

The reference is rendered from the parser the command itself builds (:func:`phalanx.cli.build_parser`),
so a flag's help and default are written once, in its dataclass field, and the page cannot disagree
with ``--help``; ``tests/test_docs.py`` fails when the committed page differs from what this prints.
Run ``python3 -m phalanx.options_doc > docs/flags.md`` after changing an option.
"""

from __future__ import annotations

import argparse
import sys

HEADER = """\
# Flags reference

Every flag of every `phalanx` command, with its help and default, generated from the options
dataclasses that `--help` shows (`python3 -m phalanx.options_doc > docs/flags.md`; a test fails when
this page and the code differ). What the main flags are for, with examples: [train.md](train.md).
"""


def _flag(action: argparse.Action) -> str:
    """``--resume [RESUME]``-like text: every spelling of the flag, and its value when it takes one."""
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        return ", ".join(f"`{name}`" for name in action.option_strings)
    metavar = action.metavar or action.dest.upper()
    value = f"[{metavar}]" if action.nargs == "?" else metavar
    return ", ".join(f"`{name} {value}`" for name in action.option_strings)


def _cell(text: str) -> str:
    # argparse's help is %-formatted: "%%" prints as "%"; a "|" would end the table's cell
    return " ".join(text.replace("%%", "%").split()).replace("|", "\\|")


def _groups(parser: argparse.ArgumentParser):
    """Each titled group of a command's flags, with the flags in it (--help itself left out)."""
    for group in parser._action_groups:  # argparse keeps no public list of the groups --help prints
        actions = [a for a in group._group_actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if actions:
            yield group.title, actions


def _command(name: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## `phalanx {name}`", "", _cell(parser.description or ""), ""]
    for title, actions in _groups(parser):
        lines += [f"### {title}", "", "| flag | help |", "|---|---|"]
        lines += [f"| {_flag(a)} | {_cell(a.help or '')} |" for a in actions]
        lines.append("")
    return lines


def render() -> str:
    from .cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = [HEADER]
    for name, command in subparsers.choices.items():
        lines += _command(name, command)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
