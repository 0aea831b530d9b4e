"""Metrics (issue 19, item 4): exact over ranks (sums and counts, never an average of averages), with a
direction; regression with float targets; targets to stop at (``loss<=0.3``), and bad ones in one line."""

import json
import math

import pytest
import torch
from torch import nn

from helpers import gather, run_workers
from phalanx import TrainConfig, Trainer
from phalanx.data import eval_batches
from phalanx.data.user import Examples
from phalanx.errors import PhalanxError
from phalanx.task.metrics import (ACCURACY, LOSS, MAE, MSE, PERPLEXITY, Target, Totals, add_up, check_target, mse_loss,
                             parse_target)
from phalanx.strategies import Sync
from phalanx.strategies.base import runtime_for

TEST_SIZE = 101  # odd, in batches of 8: the ranks' parts and their last batches differ in size


def median_error(outputs, targets):
    """A user's metric: its batch's sum of absolute errors above 0.5, and how many targets it looked at."""
    return ((outputs.reshape(targets.shape) - targets).abs() > 0.5).sum(), targets.numel()


def hits(outputs, targets):
    return (outputs.argmax(1) == targets).sum(), len(targets)


hits.higher_is_better = True


def regression_set(n: int = 400, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0]) + 0.1 * torch.randn(n, generator=g)
    return x, y


# --------------------------------------------------------------------------- exact over ranks


def _evaluate_on_ranks(ctx, classify: bool):
    torch.manual_seed(0)
    model = nn.Linear(5, 3 if classify else 1)
    x, y = regression_set(TEST_SIZE, seed=1)
    y = (y > 0).long() + (y > 2).long() if classify else y
    loss = nn.functional.cross_entropy if classify else mse_loss
    metrics = (ACCURACY, LOSS, PERPLEXITY) if classify else (LOSS, MSE, MAE)
    totals = Totals(metrics, loss)
    runtime = runtime_for(Sync(), ctx, model, lambda p: torch.optim.SGD(p, lr=0.1), loss)
    mine = eval_batches(Examples(x, y), 8, ctx.rank, ctx.world_size)
    values = totals.values(runtime.evaluate(mine, totals))
    whole = totals.values(add_up(model, [(x, y)], torch.device("cpu"), totals).tolist())  # one batch, one process
    return gather(ctx, {"ranks": values, "whole": whole})


@pytest.mark.slow
@pytest.mark.parametrize("classify", [True, False], ids=["classifier", "regression"])
def test_a_metric_over_two_ranks_equals_the_single_process_metric_on_the_whole_test_set(classify):
    out = run_workers(_evaluate_on_ranks, 2, classify)
    assert out[0]["ranks"] == out[1]["ranks"]  # every rank holds the same, summed values
    ranks, whole = out[0]["ranks"], out[0]["whole"]
    assert list(ranks) == list(whole)
    for name in whole:
        assert ranks[name] == pytest.approx(whole[name], rel=1e-6, abs=1e-7), name
    if classify:
        assert ranks["accuracy"] * TEST_SIZE == pytest.approx(round(ranks["accuracy"] * TEST_SIZE))  # a count
        assert ranks["perplexity"] == pytest.approx(math.exp(ranks["loss"]))


def test_parts_add_up_to_the_whole_where_averaging_averages_would_not():
    x, y = regression_set(10)
    model = nn.Linear(5, 1)
    totals = Totals((LOSS, MSE), mse_loss)
    parts = [(x[:9], y[:9]), (x[9:], y[9:])]  # a part of 9 and a part of 1
    added = totals.values(sum(add_up(model, [p], torch.device("cpu"), totals) for p in parts).tolist())
    whole = totals.values(add_up(model, [(x, y)], torch.device("cpu"), totals).tolist())
    averaged = sum(totals.values(add_up(model, [p], torch.device("cpu"), totals).tolist())["mse"] for p in parts) / 2
    assert added["mse"] == pytest.approx(whole["mse"], rel=1e-6) and added["loss"] == pytest.approx(whole["loss"])
    assert averaged != pytest.approx(whole["mse"], rel=1e-3)


# --------------------------------------------------------------------------- targets


@pytest.mark.parametrize("text, expected", [
    ("0.95", Target("accuracy", True, 0.95)), (0.9, Target("accuracy", True, 0.9)),
    ("accuracy>=0.95", Target("accuracy", True, 0.95)), ("loss<=0.30", Target("loss", False, 0.3)),
    (" perplexity <= 5 ", Target("perplexity", False, 5.0)), ("hits>=1e-1", Target("hits", True, 0.1)),
])
def test_targets_parse_and_a_bare_number_is_an_accuracy(text, expected):
    assert parse_target(text) == expected
    assert str(parse_target(str(expected))) == str(expected)


@pytest.mark.parametrize("text, message", [
    ("loss<0.3", "--stop-at loss<0.3: write METRIC>=VALUE or METRIC<=VALUE, e.g. accuracy>=0.95"),
    ("accuracy>=95", "--stop-at accuracy>=95: an accuracy is in (0, 1], e.g. accuracy>=0.95"),
    ("1.5", "--stop-at 1.5: an accuracy is in (0, 1]"),
    ("fast", "--stop-at fast: write METRIC>=VALUE or METRIC<=VALUE"),
])
def test_a_target_that_does_not_parse_is_one_line_naming_the_form(text, message):
    with pytest.raises(PhalanxError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_target(text)


def test_a_target_must_name_a_reported_metric_and_go_its_better_way():
    with pytest.raises(PhalanxError, match=r"loss>=0.3: a lower loss is better, so its target is reached going "
                                           r"down: write loss<=0.3$"):
        check_target(parse_target("loss>=0.3"), (ACCURACY, LOSS))
    with pytest.raises(PhalanxError, match=r"no metric is named f1 \(this run reports accuracy, loss\); .* add "
                                           r"--metric MODULE:f1"):
        check_target(parse_target("f1>=0.8"), (ACCURACY, LOSS))


# --------------------------------------------------------------------------- regression, end to end


def _config(tmp_path, **kw):
    base = dict(workers=2, devices="cpu", steps=100, batch_size=16, optimizer="adam", lr=0.1, log_every=20,
                eval_every=20, checkpoint_dir=str(tmp_path / "ck"), progress="none")
    return TrainConfig(**{**base, **kw})


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 1)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.slow
def test_float_targets_train_a_regression_with_mse_and_report_loss_and_mse_not_accuracy(tmp_path):
    x, y = regression_set()
    baseline = float(((y[300:] - y[:300].mean()) ** 2).mean())
    summary = Trainer(_config(tmp_path), model=Linear(), train_data=(x[:300].double(), y[:300].double()),
                      test_data=(x[300:], y[300:])).fit()
    metrics = summary["test_metrics"]
    assert list(metrics) == ["loss", "mse"] and summary["test_accuracy"] is None
    assert metrics["loss"] == pytest.approx(metrics["mse"], rel=1e-6)
    assert metrics["mse"] < 0.1 * baseline


@pytest.mark.slow
def test_a_loss_target_stops_the_run_and_a_user_metric_is_reported(tmp_path):
    x, y = regression_set()
    summary = Trainer(_config(tmp_path, steps=400, stop_at="loss<=0.5"), model=Linear(),
                      train_data=(x[:300], y[:300]), test_data=(x[300:], y[300:]),
                      metrics=["mae", median_error]).fit()
    assert summary["stopped_at_target"] and summary["target"] == "loss<=0.5" and summary["steps"] < 400
    assert list(summary["test_metrics"]) == ["mae", "median_error", "loss"]
    assert summary["test_metrics"]["loss"] <= 0.5
    evaluated = [r["step"] for r in map(json.loads, open(summary["metrics"])) if r.get("event") == "eval"]
    assert evaluated.count(summary["steps"]) == 1  # the evaluation that reached it is the final one, not repeated


@pytest.mark.slow
def test_a_user_metric_with_a_direction_is_a_target_and_a_wrong_way_is_refused(tmp_path):
    x, y = regression_set()
    y = (y > 0).long()
    data = dict(model=nn.Linear(5, 2), train_data=(x[:300], y[:300]), test_data=(x[300:], y[300:]))
    summary = Trainer(_config(tmp_path, stop_at="hits>=0.8"), metrics=[hits], **data).fit()
    assert summary["stopped_at_target"] and list(summary["test_metrics"]) == ["hits", "loss"]
    assert summary["test_metrics"]["hits"] >= 0.8
    with pytest.raises(PhalanxError, match=r"hits<=0.8: a higher hits is better"):
        Trainer(_config(tmp_path, stop_at="hits<=0.8"), metrics=[hits], **data)
    with pytest.raises(PhalanxError, match=r"--metric accuracy: the targets are floats"):
        Trainer(_config(tmp_path, metric="accuracy"), model=Linear(), train_data=regression_set())
    with pytest.raises(PhalanxError, match=r"--stop-at-accuracy needs evaluations during training"):
        TrainConfig(stop_at_accuracy=0.9)
    with pytest.raises(PhalanxError, match=r"both set a target: give one"):
        TrainConfig(stop_at="loss<=1", stop_at_accuracy=0.9, eval_every=5)
