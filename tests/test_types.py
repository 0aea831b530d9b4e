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


def test_a_users_type_checker_sees_compare_and_estimate_as_the_functions(tmp_path):
    """``phalanx.compare`` and ``phalanx.estimate`` are callable packages; ``phalanx/__init__.py`` names the functions
    for type checkers, so a user's checker knows the keywords and the result (without it: Any, nothing checked)."""
    script = tmp_path / "use.py"
    script.write_text("import phalanx\nreveal_type(phalanx.compare(model='cnn'))\n"
                      "reveal_type(phalanx.estimate(model='cnn'))\nphalanx.compare(repeats='three')\n")
    out = subprocess.run([sys.executable, "-m", "mypy", str(script)], cwd=ROOT, capture_output=True, text=True).stdout
    assert ('Revealed type is "phalanx.compare.outcome.Comparison | phalanx.compare.simulated.SimulatedComparison"'
            in out), out
    assert 'Revealed type is "phalanx.estimate.api.EstimateResult"' in out
    assert 'Argument "repeats" to "compare" has incompatible type "str"; expected "int | None"' in out, out
