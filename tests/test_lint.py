"""ruff over the whole tree (its rules in pyproject.toml): part of the README's test command, so CI runs it."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    out = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, f"ruff check (the README's setup installs it):\n{out.stdout[-4000:]}{out.stderr}"
