"""A worker that dies costs at most the step in flight: the survivors agree who they are through the job's store
and save what they hold (real SIGKILL, real gloo groups, real checkpoints). sync's own case, the final model equal
to an uninterrupted run's, is in test_faults.py beside the other restarts."""

import re
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import gather, only_run, run_and_signal, run_workers
from phalanx import TrainConfig, Trainer
from phalanx.errors import WorkerFailed
from phalanx.launcher.survivors import survivors
from phalanx.launcher.watch import launcher_view, say_gone
from phalanx.strategies.replicas import average_over
from phalanx.checkpoint import load_checkpoint

NOTES = {"local-sgd": "its own replica; the lost worker's local steps since the last averaging are lost with it",
         "diloco": "an outer round of its own pseudo-gradient; the lost worker's local steps since its last round are "
                   "lost with it"}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["local-sgd", "diloco"])
def test_a_killed_replica_costs_its_own_local_steps_and_the_survivor_resumes_where_it_was(strategy, tmp_path):
    code, out, err = run_and_signal(["train", "--strategy", strategy, "--steps", "60", "--checkpoint-every", "100",
                                     "--log-every", "10", "--max-restarts", "1"], tmp_path, "step 30,",
                                    signal.SIGKILL, rank=1)
    assert code == 0, err
    died = re.search(r"worker 1 died at step (\d+) \(SIGKILL\); restart 1 of 1 from checkpoint step (\d+) \(the "
                     r"survivors' save\)", err)
    assert died and int(died.group(2)) >= int(died.group(1)) - 1 >= 29, err
    saved = re.search(rf"^worker 1 lost; worker 0 saved step (\d+), the last step the survivors finished "
                      rf"\({re.escape(NOTES[strategy])}\): (runs/{strategy}-1/step-\d+\.pt)$", out, re.M)
    assert saved and saved.group(1) == died.group(2), out
    assert f"resuming at step {died.group(2)}" in out and "test accuracy" in out
    rescued = load_checkpoint(tmp_path / saved.group(2))
    assert rescued["survivors"] == {"ranks": [0], "lost": [1]} and rescued["meta"]["strategy"] == strategy
    if strategy == "diloco":  # every rank starts a round from the global model the survivor's round gave
        assert rescued["diloco"]["workers"] == [] and rescued["diloco"]["unsynced"] == []
    assert load_checkpoint(only_run(tmp_path))["step"] == 60


def _survive_one_of_three(ctx):
    """Ranks 0 and 1 of a job of three whose rank 2 was seen to die: who survived, and their mean over a group of
    their own."""
    if ctx.rank == 0:
        say_gone(launcher_view(ctx.store), 2)
    dist.barrier()  # (rank 2 is recorded gone before either looks: the set is complete without a deadline)
    torch.manual_seed(ctx.rank)
    found = survivors(ctx.store, ctx.rank, 3, step=7 + ctx.rank, settle_s=600)
    values = [torch.tensor([float(ctx.rank), 2.0 * ctx.rank]), torch.tensor([10 + ctx.rank])]
    average_over(values, found.group())
    rng = found.rng()
    late = survivors(ctx.store, 2, 3, step=9, settle_s=0)  # recorded after the seal: not one of them
    return gather(ctx, (found.ranks, found.writer, found.lost, [v.tolist() for v in values],
                        [r is None for r in rng], torch.equal(rng[ctx.rank], torch.get_rng_state()), late))


def test_the_survivors_seal_one_set_and_average_over_a_group_of_their_own():
    for ranks, writer, lost, values, missing, own_rng, late in run_workers(_survive_one_of_three, 2):
        assert (ranks, writer, lost) == ((0, 1), 0, (2,))
        assert values == [[0.5, 1.0], [10]]  # floating: the mean; integer: the first survivor's
        assert missing == [False, False, True] and own_rng and late is None


class RaisesOnRank1(nn.Module):
    """A small MLP whose rank 1 raises in its 20th training forward: a bug, which every worker may share."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.calls = 0

    def forward(self, x):
        self.calls += self.training
        if self.training and dist.is_initialized() and dist.get_rank() == 1 and self.calls == 20:
            raise ValueError("tower exploded")
        return self.net(x)


@pytest.mark.slow
def test_a_worker_that_raises_is_named_with_its_traceback_not_its_survivors_lost_peer(tmp_path):
    from phalanx.data import load_digits

    data = load_digits()
    config = TrainConfig(workers=2, devices="cpu", steps=60, batch_size=16, progress="none",
                         checkpoint_dir=str(tmp_path / "c"))
    with pytest.raises(WorkerFailed) as info:
        Trainer(config, model=RaisesOnRank1(), train_data=(data.train.x, data.train.y)).fit()
    assert info.value.rank == 1 and "ValueError: tower exploded" in info.value.detail
