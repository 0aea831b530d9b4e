"""The README and the docs: the flags reference is what the code generates, and every relative link resolves.

Nothing here runs phalanx's workers: the pages are read as files, and ``docs/flags.md`` is compared with
what ``python3 -m phalanx.options_doc`` prints now, so a flag added or changed without regenerating the
page fails here (the fix: ``python3 -m phalanx.options_doc > docs/flags.md``).
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx import options_doc

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")])
#: [text](target): the target up to a space or the closing parenthesis (a title after a space is ignored)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def _outside_code(text: str) -> str:
    """The page without its fenced blocks and inline code, where brackets are code, not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _relative_links(page: Path):
    for target in LINK.findall(_outside_code(page.read_text())):
        if not re.match(r"^[a-z]+:", target):  # http:, https:, mailto: are not checked here
            yield target


def test_the_committed_flags_reference_is_what_the_options_generate():
    committed = (ROOT / "docs" / "flags.md").read_text()
    assert committed == options_doc.render(), "docs/flags.md is stale: python3 -m phalanx.options_doc > docs/flags.md"


def test_the_flags_reference_names_every_flag_of_every_command():
    from phalanx.cli import build_parser

    page = (ROOT / "docs" / "flags.md").read_text()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    for name, command in commands.items():
        assert f"## `phalanx {name}`" in page
        for action in command._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in page, f"{flag} of phalanx {name} is missing from docs/flags.md"


@pytest.mark.slow
def test_the_generator_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "phalanx.options_doc"], capture_output=True, text=True, check=True)
    assert out.stdout == options_doc.render()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links that lead nowhere: {broken}"


def test_the_readme_is_a_front_door_with_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "the README is a five-minute read: move detail to docs/"
    ci = (ROOT / ".ci" / "run").read_text()
    for command in ("python3 -m pip install", "python3 -m pytest"):
        line = next(line for line in ci.splitlines() if line.startswith(command))
        # CI's line adds quiet flags to the pip command; the README's command is the same with them dropped
        shown = line.replace(" --quiet --disable-pip-version-check", "")
        assert shown in readme, f"the README no longer shows CI's command {shown!r}"


#: a test cited by a page: `test_x.py::test_name`, or a later `::test_other` on the same line (a bare `test_x` may
#: be a field such as test_accuracy, so a citation names its file)
CITATION = re.compile(r"(?:tests/)?(test_\w+\.py)(?::\d+)?|::(test_\w+)")


@functools.cache
def _tests_by_file() -> dict[str, set[str]]:
    """Each test file's functions and classes, read without importing it (once for every page)."""
    names = {}
    for path in (ROOT / "tests").glob("test_*.py"):
        tree = ast.parse(path.read_text())
        names[path.name] = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return names


def _citations(page: Path):
    """(line number, file, name or None) for every test a page cites; a `::name` belongs to the file before it."""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        cited_file = None
        for match in CITATION.finditer(line):
            file, name = match.groups()
            if file:
                cited_file = file
                yield number, file, None
            else:
                yield number, cited_file, name


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_test_a_page_cites_exists(page):
    tests = _tests_by_file()
    missing = []
    for number, file, name in _citations(page):
        found = file in tests and (name is None or name in tests[file])
        if not found:
            missing.append(f"line {number}: {file or ''}{'::' + name if name else ''}")
    assert not missing, f"{page.relative_to(ROOT)} cites tests that do not exist: {missing}"
