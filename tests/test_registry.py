"""A strategy is its module and one registration: estimate and compare --simulate find it with no edit elsewhere.

A test's strategy, ``lockstep``, is sync by another name: sync's layout and runtime, a cost model of
its own (sync's formula under its own title) and the lockstep simulated rule, registered as a strategy's
module registers itself. Then train, estimate and compare --simulate take it by name, and what they
compute for it is what they compute for sync (the reference); once unregistered it is unknown again.
The capabilities the code around the strategies asks instead of naming one (fp16's scaler, the CPU
only, compare's reference) are checked on their own. In-process; nothing is measured.
"""

import dataclasses
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from helpers import run_main
from phalanx.costs import Compute, Link, ModelFacts, Network, cost_model
from phalanx.strategies.sync.costs import SyncCost, predict_sync
from phalanx.errors import PhalanxError
from phalanx.simulate import LOCKSTEP, simulated_rule
from phalanx.strategies import STRATEGIES, Job, Sync, register, strategy_class, unregister

MS = 1e-3
FAST = ["--step-time", "10ms", "--link-bandwidth", "1GB/s", "--link-latency", "10us"]
BUILT_IN = ["sync", "ps", "ssp", "backup", "hogwild", "local-sgd", "diloco", "pipeline", "fsdp"]


@dataclasses.dataclass(frozen=True)
class Lockstep(Sync):
    name: ClassVar[str] = "lockstep"
    summary: ClassVar[str] = "sync by another name (a test's strategy)"


class LockstepCost(SyncCost):
    title = "lockstep (sync's formula)"


@pytest.fixture(scope="module")
def lockstep():
    register(Lockstep, cost=LockstepCost(), simulated=LOCKSTEP)
    yield Lockstep
    unregister(Lockstep)


def test_one_registration_makes_a_strategy_by_name(lockstep):
    assert list(STRATEGIES) == BUILT_IN + ["lockstep"]  # the built-ins keep their order
    assert strategy_class("lockstep") is Lockstep
    assert isinstance(cost_model(Lockstep()), LockstepCost) and simulated_rule(Lockstep()) is LOCKSTEP
    with pytest.raises(ValueError, match="'sync' is taken by Sync"):
        register(type("Other", (Sync,), {"name": "sync"}))


def test_estimate_plans_and_predicts_it_with_its_own_cost_model(lockstep, tmp_path, monkeypatch):
    from phalanx.estimate import EstimateOptions
    from phalanx.estimate.setup import predict, prepare

    monkeypatch.chdir(tmp_path)
    assert EstimateOptions().strategies[-1] == "lockstep"  # --strategy all
    setup = prepare(EstimateOptions(workers=(1, 4), strategy="lockstep"), {"model": "mlp"}, {"compress": "bf16"})
    assert [(r.strategy, r.workers, r.options.compress) for r in setup.rows] == [("lockstep", 1, "bf16"),
                                                                                  ("lockstep", 4, "bf16")]
    c = Compute(forward=10 * MS, backward=20 * MS, optimizer=2 * MS, loop=1 * MS, slowest=33 * MS, cpu=33 * MS,
                processes=1, threads=1, cores=None, block_seconds=(1.0,), micro_seconds={}, pack=0.5 * MS,
                copy=0.5 * MS, unpack=0.5 * MS, apply=3 * MS)
    link = Link(5e-6, 1e-10, "test")
    net = Network(link, link, per_node=2)
    facts = ModelFacts(("0",), (1_000_000,), (40,), ((4_000_000, 0),), 32)
    got = predict(setup, setup.rows[1], c, net, facts=facts)
    assert got == dataclasses.replace(predict_sync(c, facts, net, 4, "bf16"), strategy="lockstep")


def test_compare_simulate_plays_it_as_it_plays_sync(lockstep, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["compare", "--simulate", "--workers", "2", "--strategies", "sync,lockstep", "--scenarios",
                          "none", "--repeats", "1", "--model", "mlp", "--batch-size", "8", "--max-steps", "6",
                          "--eval-every", "3", "--target", "0.99", *FAST], capsys)
    assert code == 0, out.err[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in out.out.splitlines() if line.startswith("  ")}
    assert rows["lockstep"] == rows["sync"]  # the same rule, the same clock: the same figures


def test_unregistered_it_is_unknown_again():
    from phalanx.estimate import EstimateOptions

    register(Lockstep, cost=LockstepCost(), simulated=LOCKSTEP)
    unregister(Lockstep)
    assert list(STRATEGIES) == BUILT_IN and cost_model(Lockstep) is None and simulated_rule(Lockstep) is None
    with pytest.raises(PhalanxError, match="unknown --strategy 'lockstep'"):
        EstimateOptions(strategy="lockstep")


def test_code_around_the_strategies_asks_their_capabilities(monkeypatch):
    from phalanx.compare.setup import default_strategies
    from phalanx.compare.report import baseline
    from phalanx.compare.tokens import parse_strategies
    from phalanx.strategies.layout import data_parallel
    from phalanx.train import TrainConfig
    from phalanx.train import trainer
    from phalanx.train.checks import check_precision

    # fp16's gradient scaler: the strategies that can take it are named, the one asked for is told the fix
    on_gpus = data_parallel(Job((torch.device("cuda", 0),) * 2, 8))
    fix = r"fp16 works with --strategy sync( or lockstep)? only .* use --precision bf16 with ps"
    with pytest.raises(PhalanxError, match=fix):
        check_precision(TrainConfig(precision="fp16", strategy="ps"), on_gpus)
    check_precision(TrainConfig(precision="fp16", strategy="sync"), on_gpus)
    # compare's defaults on GPUs leave out the strategies that run on the CPU only
    monkeypatch.setattr(trainer, "worker_devices", lambda train: [torch.device("cuda", 0)])
    assert default_strategies(TrainConfig()) == "sync,ps,ssp:2,local-sgd:8,backup:1"
    # compare's ratios: against the reference strategy where it runs, else the first listed
    assert baseline(SimpleNamespace(strategies=parse_strategies("ps,sync,ssp:2"))) == "sync"
    assert baseline(SimpleNamespace(strategies=parse_strategies("ps,ssp:2"))) == "ps"
