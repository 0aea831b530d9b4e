"""``phalanx estimate`` and ``compare --simulate`` take the task ``phalanx train`` takes (issue 31).

- the GPT example (pairs, a model returning (logits, loss), ``--training-step``, an optimizer factory taking the
  model, the user's LR scheduler, clipping) through the installed command: estimate and compare --simulate run
  and report (the estimate once crashed in ``model_facts`` on the tuple; the simulation refused the step);
- a Hugging Face ``GPT2LMHeadModel`` on dict batches with ``-100`` padding, and a two-input model with a step of
  the user's, through the API;
- equivalence (test tier 3 of docs/architecture.md, as test_simulate.py checks it for pairs): simulated sync on
  2 workers ends with the parameters of a real one-process run on the global batch, for dict batches through a
  model's own loss, and for a step of the user's with an optimizer factory taking the model, clipping and the
  user's scheduler;
- what cannot be: a factory taking the model under simulated local SGD, a pipeline of a dict batch, one line each.
Link and step time are given where they can be, so each run measures little (one process alone at most).
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import phalanx
from helpers import run_cli, run_in_process
from phalanx import Sync, TrainConfig, Trainer
from phalanx.costs import Link
from phalanx.errors import PhalanxError
from phalanx.simulate import simulated_rule
from phalanx.compare.simulated_problem import build_problem
from phalanx.simulate.world import World
from phalanx.task import user_task
from phalanx.checkpoint import load_checkpoint
from test_any_model import MODULE, KeywordNet, keyword_data, needs_transformers

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GPT = ["--model", "gpt:make", "--data", "gpt:load", "--training-step", "gpt:step", "--batch-size", "4"]
GIVEN_LINK = ["--link-bandwidth", "1GB/s", "--link-latency", "10us"]
LINK = Link(1e-5, 1e-9, "given")
QUICK = dict(per_node=1, link_bandwidth="1GB/s", link_latency="10us", measure_link=False, measure_steps=3,
             quiet=True)  # one process measured alone serves every row


# --------------------------------------------------------------------------- the GPT example, the command

@pytest.mark.slow
def test_estimate_of_the_gpt_example_with_its_step_optimizer_scheduler_and_clipping():
    out = run_in_process("estimate", *GPT, "--optimizer", "gpt:optimizer", "--lr-scheduler", "gpt:schedule",
                         "--clip-grad-norm", "1.0", "--strategy", "sync", "--workers", "1,8", "--per-node", "1",
                         *GIVEN_LINK, "--no-measure-link", "--measure-steps", "3", "--json", cwd=EXAMPLES)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    import sys

    sys.path.insert(0, str(EXAMPLES))
    try:
        import gpt

        model = gpt.make(105)
    finally:
        sys.path.remove(str(EXAMPLES))
    assert data["parameters"] == sum(p.numel() for p in model.parameters())  # the tied matrix once
    assert [(p["strategy"], p["workers"]) for p in data["predictions"]] == [("sync", 1), ("sync", 8)]
    assert all(p["step_s"] > 0 for p in data["predictions"])


def test_the_gpt_example_without_its_step_is_called_with_its_targets_and_a_pipeline_estimate_says_so():
    """nanoGPT's forward takes the targets second: the default step calls model(x, y) as its train.py does (it was
    refused here, its step required); a pipeline's estimate, timed through the blocks on model(x), says so in one
    line before any measurement."""
    out = run_in_process("estimate", "--model", "gpt:make", "--data", "gpt:load", "--strategy", "pipeline",
                         "--workers", "2", *GIVEN_LINK, "--no-measure-link", cwd=EXAMPLES)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: pipeline on 2 workers: phalanx estimate times pipeline on batches (inputs, targets) run through the "
        "model's blocks, and this model's forward takes the targets (it is called model(x, y)); phalanx train and "
        "compare run it, estimate does not predict it")
    assert "measuring" not in out.stderr


def test_a_pipeline_estimate_of_the_gpt_examples_step_is_trains_one_line_before_any_measurement():
    """Under ``--strategy all`` the pipeline's rows are 'not predicted' for the same reason (setup.refuses_task)."""
    out = run_in_process("estimate", *GPT, "--strategy", "pipeline", "--workers", "2", *GIVEN_LINK, "--no-measure-link",
                         cwd=EXAMPLES)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: pipeline on 2 workers: phalanx estimate times pipeline on batches (inputs, targets) run through the "
        "model's blocks, and this run's training step is your own; phalanx train and compare run it, estimate does "
        "not predict it")
    assert "measuring" not in out.stderr


def test_simulated_workers_on_their_own_parameters_are_computed_in_turn_where_vmap_would_loop(monkeypatch):
    """The GPT's attention has no batching rule: inside vmap torch loops over the workers, slower than computing
    them one after another, which every call after the first does, two workers at once on two threads (each
    its own copy of the model); the same gradients either way. A model whose every op batches (an MLP) stays
    vmapped; one whose forward updates buffers (BatchNorm) or draws random numbers (dropout) stays on one thread."""
    from phalanx.simulate.gradients import Gradients
    from phalanx.task.step import UserStep

    monkeypatch.syspath_prepend(str(EXAMPLES))
    import gpt

    (x, y), _ = gpt.load()
    for model, step, batch, vmapped in ((gpt.make(105), UserStep(gpt.step), (x, y), False),
                                        (torch.nn.Linear(64, 3), None, (torch.randn(12, 64), torch.randint(3, (12,))),
                                         True)):
        grads = Gradients(model, F.cross_entropy, step, threads=2)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        rows = torch.stack([flat + 0.01 * w for w in range(3)])  # each worker its own parameters
        shards = [(batch[0][2 * w:2 * w + 2], batch[1][2 * w:2 * w + 2]) for w in range(3)]
        first, _ = grads.each(rows, shards)  # vmap
        assert grads.vmappable is vmapped
        again, _ = grads.each(rows, shards)  # in turn where vmap looped
        alone = torch.stack([grads.mean(rows[w], [shards[w]])[0] for w in range(3)])
        torch.testing.assert_close(first, alone, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(again, alone, rtol=1e-4, atol=1e-6)
        assert len(grads.helpers or []) == (0 if vmapped else 2)  # in turn: a copy of the model for the 2nd thread
    for alone in (torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.1)):  # buffers it updates, random numbers it draws
        assert len(Gradients(torch.nn.Sequential(torch.nn.Linear(4, 4), alone), F.cross_entropy,
                             threads=2)._helpers()) == 1


@pytest.mark.slow
def test_simulated_sync_takes_a_users_mean_loss_on_the_whole_batch_and_a_sum_shard_by_shard(monkeypatch):
    """Simulated sync computes the W shards as one batch where the user's loss on it is their mean (the GPT's:
    a mean over equal counts of tokens); a step whose loss sums, or a batch with ignored targets, is computed
    shard by shard. Every way gives the mean of the shards' gradients, as DDP applies it."""
    from phalanx.data import batch as batches
    from phalanx.simulate.gradients import Gradients
    from phalanx.task.step import UserStep

    monkeypatch.syspath_prepend(str(EXAMPLES))
    import gpt

    (x, y), _ = gpt.load()
    model = gpt.make(105)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    whole = (x[:12], y[:12])
    shards = batches.split(whole, 3)
    padded = (x[:12], torch.where(torch.arange(y.shape[1]) < torch.arange(12)[:, None], -1, y[:12]))  # row i: i ignored
    summing = UserStep(lambda model, batch: gpt.step(model, batch)[0] * len(batch[0]))
    for step, batch, one_pass in ((UserStep(gpt.step), whole, True), (summing, whole, False),
                                  (UserStep(gpt.step), padded, None)):
        pieces = batches.split(batch, 3)
        expected = Gradients(model, F.cross_entropy, step).mean(flat, pieces)  # shard by shard
        grads = Gradients(model, F.cross_entropy, step)
        for _ in range(2):  # the first call compares, the second takes what it learnt
            g, loss = grads.mean(flat, pieces, batch)
            assert grads.whole_is_mean is one_pass
            torch.testing.assert_close(g, expected[0], rtol=1e-4, atol=1e-6)
            assert loss == pytest.approx(expected[1], rel=1e-5)
    assert len(shards) == 3 and grads.computed == 6


@pytest.mark.slow
def test_compare_simulate_of_the_gpt_example_runs_and_reports(tmp_path):
    out = run_in_process("compare", "--simulate", *GPT, "--optimizer", "gpt:optimizer", "--lr-scheduler",
                         "gpt:schedule", "--clip-grad-norm", "1.0", "--strategies", "sync,ps", "--workers", "2,8",
                         "--max-steps", "4", "--eval-every", "2", "--step-time", "10ms", *GIVEN_LINK, "--repeats", "1",
                         "--scenarios", "none", "--target", "perplexity<=8", "--out", str(tmp_path / "sim"),
                         cwd=EXAMPLES)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "=== 2 workers (simulated) ===" in out.stdout and "=== 8 workers (simulated) ===" in out.stdout
    report = json.loads((tmp_path / "sim" / "report.json").read_text())
    assert "performance drop" not in out.stderr  # vmap's note on attention's backward: torch's loop, same numbers
    text = json.dumps(report)
    assert "perplexity" in text


@pytest.mark.slow
def test_a_factory_taking_the_model_is_refused_for_stacked_copies_before_any_run():
    out = run_cli("compare", "--simulate", *GPT, "--optimizer", "gpt:optimizer", "--strategies", "sync,local-sgd",
                  "--workers", "2", "--max-steps", "2", "--step-time", "10ms", *GIVEN_LINK, "--scenarios", "none",
                  cwd=EXAMPLES)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: the optimizer factory gpt:optimizer takes the model, and simulated local-sgd steps the workers' "
        "copies stacked as one tensor per parameter (no module of one worker's to give it); give a params -> "
        "Optimizer factory, or compare local-sgd without --simulate")
    assert "phalanx compare --simulate:" not in out.stdout  # nothing ran


# --------------------------------------------------------------------------- the API: dict batches, a user's step

@pytest.fixture(scope="module")
def mine(tmp_path_factory):
    """test_any_model.py's module of models and data, importable by name (spawned probes import the step)."""
    import importlib
    import sys

    root = tmp_path_factory.mktemp("any_task")
    (root / "mine_task.py").write_text(MODULE)
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("mine_task")
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("mine_task", None)


@needs_transformers
@pytest.mark.slow
def test_a_gpt2_on_dict_batches_is_estimated_and_simulated(mine, capsys):
    train, test = mine.lm()
    torch.manual_seed(0)
    model = mine.gpt2()
    est = phalanx.estimate(model=model, train_data=train, test_data=test, workers=(1, 4), strategy="sync",
                           batch_size=8, **QUICK)
    assert est.to_dict()["parameters"] == sum(p.numel() for p in model.parameters())
    assert [p.workers for p in est.predictions] == [1, 4]
    sim = phalanx.compare(model=model, train_data=train, test_data=test, strategies="sync,ps", scenarios="none",
                          repeats=1, max_steps=3, eval_every=3, batch_size=8, simulate=True, simulate_workers=(2, 8),
                          step_time="10ms", link_bandwidth="1GB/s", link_latency="10us", target="perplexity<=2")
    assert {(r.strategy, n) for n, runs in sim.runs.items() for r in runs} == \
        {(s, n) for s in ("sync", "ps") for n in (2, 8)}
    assert all(not r.diverged for runs in sim.runs.values() for r in runs)
    assert "=== 8 workers (simulated) ===" in capsys.readouterr().out


@pytest.mark.slow
def test_a_two_input_model_with_a_users_step_is_estimated_and_simulated(mine, capsys):
    train, test = mine.two_inputs()
    est = phalanx.estimate(model=mine.TwoInputs(), train_data=train, test_data=test, training_step=mine.step,
                           target_key="y", workers=(1, 2), strategy="sync", batch_size=8, **QUICK)
    assert [p.workers for p in est.predictions] == [1, 2]
    sim = phalanx.compare(model=mine.TwoInputs(), train_data=train, test_data=test, training_step=mine.step,
                          target_key="y", strategies="sync,local-sgd", scenarios="none", repeats=1, max_steps=4,
                          eval_every=2, batch_size=8, simulate=True, simulate_workers=(2,), step_time="10ms",
                          link_bandwidth="1GB/s", link_latency="10us", target=0.5)
    assert {r.strategy for r in sim.runs[2]} == {"sync", "local-sgd"}
    assert all(r.best_accuracy is not None for r in sim.runs[2])  # the step's outputs scored against batch["y"]


# --------------------------------------------------------------------------- equivalence with a real run

def keyword_task_data():
    return keyword_data(128, seed=1, dtype=torch.float32), keyword_data(32, seed=2, dtype=torch.float32)


def two_input_step(model, batch):
    logits, aux = model(batch["image"], batch["feats"])
    return F.cross_entropy(logits, batch["y"]) + 0.3 * F.cross_entropy(aux, batch["y"]), logits


def by_groups(model):
    """An optimizer factory taking the model, as nanoGPT's configure_optimizers: decay on matrices only."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=0.01)


def halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _simulated_sync(config, objects, steps):
    problem = build_problem(config, (2,), None, 0.01, LINK, lambda line: None, task=user_task(config, **objects))
    world = World(problem, Sync(), 2, None, config.seed, steps, steps, None)
    simulated_rule(Sync()).run(Sync(), world)
    world.finish()
    return world


@pytest.mark.parametrize("case", ["keyword model, its own loss", "two inputs, a user's step, groups, clip, scheduler"])
def test_simulated_sync_of_a_dict_batch_task_ends_with_one_process_on_the_global_batch(case, mine, tmp_path):
    steps = 6
    if case.startswith("keyword"):
        train, test = keyword_task_data()
        torch.manual_seed(0)
        objects = dict(model=KeywordNet(), train_data=train, test_data=test)
        settings = dict(metric="loss")
    else:
        train, test = mine.two_inputs()
        torch.manual_seed(0)
        objects = dict(model=mine.TwoInputs(), train_data=train, test_data=test, training_step=two_input_step,
                       optimizer=by_groups, lr_scheduler=halving)
        settings = dict(target_key="y", clip_grad_norm=0.5)
    world = _simulated_sync(TrainConfig(devices="cpu", batch_size=8, seed=3, **settings), objects, steps)
    cfg = TrainConfig(devices="cpu", workers=1, batch_size=16, steps=steps, seed=3, progress="none",
                      checkpoint_dir=str(tmp_path), **settings)
    Trainer(cfg, **objects).fit()
    real = torch.cat([t.reshape(-1) for t in load_checkpoint(str(tmp_path))["model"].values()])
    start = torch.cat([p.detach().reshape(-1) for p in objects["model"].parameters()])
    assert not torch.allclose(real, start)  # it trained
    assert torch.allclose(world.final, real, atol=1e-5, rtol=0), (world.final - real).abs().max()
    assert world.outcome.values[-1]["loss"] > 0  # evaluated through the task's step


def test_simulated_local_sgd_refuses_a_factory_taking_the_model_in_one_line(mine):
    train, test = mine.two_inputs()
    with pytest.raises(PhalanxError, match="steps the workers' copies stacked as one tensor per parameter") as e:
        phalanx.compare(model=mine.TwoInputs(), train_data=train, test_data=test, training_step=mine.step,
                        optimizer=by_groups, target_key="y", strategies="local-sgd", scenarios="none",
                        max_steps=2, simulate=True, simulate_workers=(2,), step_time="10ms",
                        link_bandwidth="1GB/s", link_latency="10us")
    assert "\n" not in str(e.value)
