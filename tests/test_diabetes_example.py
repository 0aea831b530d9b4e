"""examples/diabetes.py (issue 19, item 9): regression on scikit-learn's diabetes data through the CLI's
import paths, with sync and ps, learns: its test MSE falls clearly below predicting the training mean;
and compare runs to a loss target."""

import json
import re
import sys

import numpy as np
import pytest

from helpers import REPO, run_cli, run_in_process

EXAMPLES = REPO / "examples"
FLAGS = ["--model", "diabetes:Net", "--data", "diabetes:load", "--optimizer", "adam", "--lr", "0.01",
         "--batch-size", "16", "--workers", "2", "--devices", "cpu"]


def mean_baseline() -> float:
    """Predict the training targets' mean for every test patient: the MSE that learning must beat."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import diabetes
    finally:
        sys.path.remove(str(EXAMPLES))
    (_, y_train), (_, y_test) = diabetes.load()
    return float(np.mean((y_test - y_train.mean()) ** 2))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sync", "ps"])
def test_the_diabetes_regression_learns_well_below_the_mean_baseline(strategy, tmp_path):
    run = run_cli if strategy == "sync" else run_in_process  # (the command's process is sync's to show)
    out = run("train", *FLAGS, "--progress", "lines", "--strategy", strategy, "--steps", "150", "--log-every", "50",
              "--eval-every", "50", "--checkpoint-dir", str(tmp_path / "ck"), cwd=EXAMPLES)
    assert out.returncode == 0, out.stderr
    assert "inputs float64 cast to float32" in out.stdout and "targets float64 cast to float32" in out.stdout
    found = re.search(r"^test loss (\d+\.\d+), mse (\d+\.\d+) after 150 steps$", out.stdout, re.M)
    assert found, out.stdout
    assert "accuracy" not in out.stdout
    loss, mse = map(float, found.groups())
    baseline = mean_baseline()
    assert baseline == pytest.approx(1.0, abs=0.1)  # standardised targets
    assert mse == pytest.approx(loss, rel=1e-4) and mse < 0.75 * baseline, (mse, baseline)
    events = [json.loads(line) for line in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    summary = events[-1]
    assert summary["test_metrics"]["mse"] == pytest.approx(mse, abs=1e-4) and summary["test_accuracy"] is None


@pytest.mark.slow
def test_compare_runs_the_regression_to_a_loss_target(tmp_path):
    out = run_in_process("compare", *FLAGS, "--strategies", "sync", "--scenarios", "none", "--repeats", "1",
                         "--target", "loss<=0.8", "--max-steps", "150", "--eval-every", "10", "--out",
                         str(tmp_path / "cmp"), cwd=EXAMPLES)
    assert out.returncode == 0, out.stderr
    assert "each to test loss<=0.8 or 150 steps" in out.stdout
    report = json.loads((tmp_path / "cmp" / "report.json").read_text())
    run = report["runs"][0]
    assert run["reached"] and run["metric"] == "loss" and run["best"] <= 0.8
    assert "**sync** reached loss<=0.8 first" in report["answer"]
    assert (tmp_path / "cmp" / "loss-vs-time.png").exists()
