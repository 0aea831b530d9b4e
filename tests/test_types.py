"""mypy over src/phalanx (its settings in pyproject.toml): part of the README's test command, so CI runs it.

Cold (a fresh clone, no .mypy_cache) it takes about 12 s of CPU, most of it reading torch's own annotations (what
pyproject.toml leaves out of them, and why); warm, under 1 s.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"mypy (the README's setup installs it):\n{out.stdout[-6000:]}{out.stderr}"
