"""Every built-in model trains with its own recipe: no flag besides --model (test tier 4 of docs/architecture.md).

``cnn`` with ``sync`` is the default run, tested in test_cli.py, and ``lstm`` with ``pipeline`` runs through the
command in test_pipeline_cli.py (``test_stacked_lstm_through_the_cli_reaches_090_...``); the other six pairs are here.
"""

import re

import pytest

from helpers import run_cli
from phalanx import TrainConfig, Trainer
from phalanx.task.models import RECIPES

PAIRS = [(m, s) for m in RECIPES for s in ("sync", "pipeline") if (m, s) not in (("cnn", "sync"), ("lstm", "pipeline"))]


@pytest.mark.slow
@pytest.mark.parametrize("model, strategy", PAIRS, ids=[f"{m}-{s}" for m, s in PAIRS])
def test_every_built_in_model_reaches_090_on_digits_with_its_recipe(model, strategy, tmp_path):
    if (model, strategy) == ("lstm", "sync"):  # through the command, as a user types it: the header names the recipe
        out = run_cli("train", "--model", "lstm", "--log-every", "1000", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "recipe: adam, lr 0.01, 300 steps (lstm default; any flag overrides)" in out.stdout.splitlines()
        accuracy = float(re.search(r"test accuracy (\d\.\d+)[^\n]* after 300 steps", out.stdout).group(1))
    else:
        config = TrainConfig(model=model, strategy=strategy, workers=2, devices="cpu", progress="none",
                             log_every=1000, checkpoint_dir=str(tmp_path / "c"))
        summary = Trainer(config).fit()
        assert summary["steps"] == RECIPES[model].steps
        accuracy = summary["test_accuracy"]
    assert accuracy >= 0.90, (model, strategy, accuracy)
