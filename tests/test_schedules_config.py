import math

import pytest

from phalanx.errors import PhalanxError
from phalanx.train import Schedule, TrainConfig, scaled_lr


def test_constant():
    s = Schedule("constant")
    assert [s(k) for k in (0, 10, 1000)] == [1.0, 1.0, 1.0]


def test_exponential_smooth_and_staircase():
    smooth = Schedule("exponential", decay_every=100, decay_factor=0.5)
    assert smooth(0) == 1.0
    assert smooth(50) == pytest.approx(0.5 ** 0.5)
    assert smooth(200) == pytest.approx(0.25)
    stairs = Schedule("exponential", decay_every=100, decay_factor=0.5, staircase=True)
    assert [stairs(k) for k in (0, 99, 100, 199, 200)] == [1.0, 1.0, 0.5, 0.5, 0.25]


def test_warmup_is_linear_then_flat():
    s = Schedule("constant", warmup_steps=4)
    assert [s(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_reaches_zero_at_total_after_warmup():
    s = Schedule("cosine", warmup_steps=10, total_steps=110)
    assert s(9) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.5)
    assert s(110) == pytest.approx(0.0, abs=1e-12)
    assert s(500) == pytest.approx(0.0, abs=1e-12)
    assert s(0) == pytest.approx(0.1 * 1.0)


def test_linear_scaling_rule():
    assert scaled_lr(0.1, 1024, 256) == pytest.approx(0.4)
    assert scaled_lr(0.1, 1024, None) == 0.1


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="step"), "unknown learning-rate schedule 'step'"),
    (dict(decay_every=0), "--lr-decay-every must be at least 1"),
    (dict(decay_factor=1.5), r"--lr-decay-factor must be in \(0, 1\]"),
    (dict(warmup_steps=-1), "--warmup-steps must be 0 or more"),
])
def test_schedule_validation(kwargs, message):
    with pytest.raises(PhalanxError, match=message):
        Schedule(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=0), "--steps must be a positive integer, got 0"),
    (dict(batch_size=-4), "--batch-size must be a positive integer, got -4"),
    (dict(batch_size=10, accumulate=3), r"--batch-size 10 does not split into --accumulate 3 .*3.33"),
    (dict(workers=0), "--workers must be at least 1"),
    (dict(lr=0), "--lr must be positive"),
    (dict(optimizer="lbfgs"), "unknown optimizer 'lbfgs'"),
    (dict(strategy="allreduce-magic"), "unknown strategy 'allreduce-magic'"),
    (dict(progress="fancy"), "unknown --progress 'fancy'"),
    (dict(checkpoint_every=-1), "--checkpoint-every must be 0 or more"),
])
def test_config_validation_names_the_problem(kwargs, message):
    with pytest.raises(PhalanxError, match=message):
        TrainConfig(**kwargs)


def test_config_defaults_put_metrics_beside_checkpoints():
    cfg = TrainConfig(checkpoint_dir="out")
    assert cfg.metrics == "out/metrics.jsonl"
    assert cfg.strategy.name == "sync"
    assert not math.isnan(cfg.resolved().lr)
