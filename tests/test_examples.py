"""Every example runs, with its small default, and says what it promises."""

import re

import pytest

from helpers import REPO, python_script


def _w(stdout: str) -> list[float]:
    return [float(v) for v in re.search(r"w = \[(.*)\]", stdout).group(1).split(", ")]


@pytest.mark.slow
def test_quadratic_fit_on_two_towers_finds_the_curve_and_matches_one_tower(tmp_path):
    two = python_script(REPO / "examples" / "quadratic_fit.py", cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    assert "towers: cpu, cpu" in two.stdout
    w = _w(two.stdout)
    assert abs(w[0] - 5) < 0.05 and abs(w[1]) < 0.05 and abs(w[2] - 3) < 0.05, w  # y = 5x² + 3, every coefficient
    one = python_script(REPO / "examples" / "quadratic_fit.py", "--towers", "1", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert max(abs(a - b) for a, b in zip(w, _w(one.stdout))) < 0.01  # the split changes nothing


@pytest.mark.slow
def test_cifar10_towers_trains_and_logs_throughput(tmp_path):
    out = python_script(REPO / "examples" / "cifar10_towers.py", "--steps", "10", "--log-every", "5", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "towers on cpu, cpu" in out.stdout
    assert re.search(r"step 10, loss = \d+\.\d\d \(\d+\.\d examples/sec; \d+\.\d{3} sec/batch\)", out.stdout)
    assert "test accuracy" in out.stdout


@pytest.mark.slow
def test_cifar10_towers_names_missing_files(tmp_path):
    out = python_script(REPO / "examples" / "cifar10_towers.py", "--data-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2
    assert "CIFAR-10 files missing" in out.stderr and "data_batch_1.bin" in out.stderr
