"""A job under real faults: hangs named, preemption saved, dead workers replaced (real signals, real processes)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import only_run, phalanx_cmd, run_and_signal, run_in_process, spawned_children
from phalanx import TrainConfig, Trainer
from phalanx.errors import JobHung
from phalanx.checkpoint import latest_checkpoint, load_checkpoint
from phalanx.launcher.hang_report import RankState, describe_hang
from phalanx.launcher.watch import Progress

LONG = ["--steps", "4000", "--log-every", "20", "--checkpoint-every", "1000"]


def _same_parameters(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=k)


# ---- hangs ----

@pytest.mark.slow
def test_a_stopped_sync_worker_is_named_with_its_step_and_the_others_with_their_collective(tmp_path):
    code, out, err = run_and_signal(["train", *LONG, "--hang-timeout", "5"], tmp_path, "step 40,", signal.SIGSTOP,
                                    rank=1)
    assert code == 1, err
    first = err.splitlines()[0]
    found = re.match(r"error: the job made no progress for 5 s \(--hang-timeout\): worker 1 is stuck in step (\d+), in "
                     r"the training step, not in a collective \(no progress for \d+ s; process stopped or frozen: no "
                     r"heartbeat for \d+ s\); worker 0 waits in gloo:all_reduce \(collective \d+\) of step (\d+)$",
                     first)
    assert found, err
    assert found.group(1) == found.group(2) and int(found.group(1)) >= 40  # one step, named from both sides
    assert "Traceback" not in err and not spawned_children(os.getpid())


@pytest.mark.slow
@pytest.mark.parametrize("strategy, steps", [(["ps"], 100), (["backup", "--backup-workers", "0"], 300)],
                         ids=["ps", "backup0"])
def test_a_stopped_ps_worker_is_dropped_and_the_others_finish_the_run(strategy, steps, tmp_path):
    # ps: the mlp's 60 steps after the signal take well under the 3 s that make the worker lost, so it is lost
    # while the server drains, after the last step. backup:0: every round waits for the stopped worker's
    # gradient. Both hung until the hang timeout ended the job: the server waited for a message after the loss,
    # and the others, stopped or waiting for their replies, sent none.
    code, out, err = run_and_signal(["train", "--strategy", *strategy, "--workers", "3", "--model", "mlp",
                                     "--steps", str(steps), "--log-every", "20", "--hang-timeout", "6",
                                     "--checkpoint-dir", "ck"],
                                    tmp_path, "step 40,", signal.SIGSTOP, rank=2)
    assert code == 0, err
    lost = re.search(r"^worker (\d) lost at step (\d+) \(no message for \d+ s: stopped, frozen or stuck\); "
                     r"continuing with 2 workers$", out, re.M)
    assert lost, out
    assert int(lost.group(2)) >= 40 and f"step {steps}," in out
    assert latest_checkpoint(tmp_path / "ck").name == f"step-{steps:08d}.pt"
    assert err == "" and not spawned_children(os.getpid())  # the frozen worker is killed, not left behind


class SleepsOnRank1(nn.Module):
    """The default digits CNN, except that rank 1's 30th forward pass never returns (a stuck data loader, a
    deadlocked user callback...)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.calls = 0

    def forward(self, x):
        self.calls += self.training  # training passes only (phalanx checks the model once in eval mode first)
        if self.training and dist.is_initialized() and dist.get_rank() == 1 and self.calls == 30:
            time.sleep(3600)
        return self.net(x)


@pytest.mark.slow
def test_a_rank_busy_inside_a_step_is_named_with_its_stack(tmp_path):
    from phalanx.data import load_digits

    data = load_digits()
    config = TrainConfig(workers=2, devices="cpu", steps=200, batch_size=16, progress="none", hang_timeout_s=4,
                         checkpoint_dir=str(tmp_path / "c"))
    with pytest.raises(JobHung) as info:
        Trainer(config, model=SleepsOnRank1(), train_data=(data.train.x, data.train.y)).fit()
    report = str(info.value)
    assert re.search(r"worker 1 is stuck in step 30, in the training step, not in a collective \(no progress for \d+ "
                     r"s; alive and busy\); worker 0 waits in gloo:all_reduce \(collective \d+\) of step 30",
                     report), report
    assert "worker 1's stack, innermost last:" in report and re.search(r"test_faults.py\", line \d+ in forward", report)


def test_the_hang_report_is_pure_logic_over_what_the_ranks_published():
    now = 1000.0
    states = {0: RankState(37, "the training step", now - 64, now - 0.2), 1: RankState(35, "the training step",
                                                                                      now - 70, now - 70),
              2: RankState(37, "the training step", now - 64, now - 0.1)}
    waiting = {"collectives": {"0": {"name": "gloo:all_reduce", "seq": 74, "waiting": True}}}
    report = describe_hang(states, {0: waiting, 2: waiting}, 3, 60, lambda r: f"rank {r}", lockstep=True, now=now)
    assert report == ("rank 1 is stuck in step 37, in the training step, not in a collective (no progress for 70 s; "
                      "process stopped or frozen: no heartbeat for 70 s); rank 0 and rank 2 wait in gloo:all_reduce "
                      "(collective 74) of step 37")
    # A pipeline's stages wait for a frozen one in point-to-point receives, which gloo's flight recorder does not
    # show: the frozen stage is the one named stuck (all three were, each "not in a collective"), in the step the
    # others are in (its last beat, a quarter second old, was 20 fast steps behind).
    states[1] = RankState(20, "the training step", now - 70, now - 70)
    states[2] = RankState(38, "the training step", now - 64, now - 0.1)
    busy = {"collectives": {"0": {"name": "gloo:all_reduce", "seq": 3, "waiting": False}}}
    report = describe_hang(states, {0: busy, 2: busy}, 3, 60, lambda r: f"stage {r}", lockstep=True, now=now)
    held = "alive, outside any collective torch records (such as a point-to-point receive or send)"
    assert report == ("stage 1 is stuck in step 37, in the training step, not in a collective (no progress for 70 s; "
                      f"process stopped or frozen: no heartbeat for 70 s); stage 0 waits in step 37, in the training "
                      f"step, {held}; stage 2 waits in step 38, in the training step, {held}")



def test_a_rank_says_at_once_that_it_started_and_that_its_first_step_began():
    # Between beats (a quarter second) a fast local-sgd rank made 40 steps: frozen there, it had never reported,
    # and the parent, taking it for one still starting, waited the 120 s start-up allowance instead of the hang
    # timeout, then said it "never reported (it did not start)". (Beats an hour apart here: only the two at once.)
    store = dist.HashStore()
    progress = Progress(rank=1, interval_s=3600).publish(store)
    try:
        assert _published_step(store) == 0
        progress.at(1, "the training step")
        assert _published_step(store, step=1) == 1
    finally:
        progress.close()


def _published_step(store, step=0, patience_s=60):
    deadline = time.monotonic() + patience_s  # (a hang guard, not a time limit: the beat comes at once or never)
    while time.monotonic() < deadline:
        if store.check(["progress/1"]):
            published = json.loads(store.get("progress/1"))["step"]
            if published == step:
                return published
        time.sleep(0.01)
    return None

# ---- preemption ----

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    out = run_in_process("train", "--steps", "60", "--checkpoint-every", "1000", cwd=root)
    assert out.returncode == 0, out.stderr
    return load_checkpoint(only_run(root) / "step-00000060.pt")


@pytest.mark.slow
def test_sigterm_stops_every_worker_at_one_step_and_its_checkpoint_resumes_to_the_same_result(uninterrupted, tmp_path):
    code, out, err = run_and_signal(["train", "--steps", "60", "--checkpoint-every", "1000", "--log-every", "10"],
                                    tmp_path, "step 20,", signal.SIGTERM)
    assert code == 143, err
    stopped = re.fullmatch(r"stopped at step (\d+) by SIGTERM; checkpoint (runs/sync-1/step-\d+\.pt); continue with: "
                           r"phalanx train --steps 60 --checkpoint-every 1000 --log-every 10 --resume\n", err)
    assert stopped, err
    step = int(stopped.group(1))
    assert 20 < step < 60 and load_checkpoint(tmp_path / stopped.group(2))["step"] == step
    assert "Traceback" not in err + out and not spawned_children(os.getpid())
    resumed = run_in_process("train", "--steps", "60", "--checkpoint-every", "1000", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    _same_parameters(uninterrupted["model"], load_checkpoint(only_run(tmp_path) / "step-00000060.pt")["model"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ps", "pipeline"])
def test_sigint_stops_other_strategies_at_a_step_with_exit_130(strategy, tmp_path):
    code, out, err = run_and_signal(["train", "--strategy", strategy, *LONG], tmp_path, "step 40,", signal.SIGINT)
    assert code == 130, err
    # (a pipeline's: a sharded directory)
    stopped = rf"stopped at step (\d+) by SIGINT; checkpoint runs/{strategy}-1/step-\d+\.(pt|dcp); continue with"
    assert re.match(stopped, err), err
    assert load_checkpoint(latest_checkpoint(only_run(tmp_path)))["meta"]["strategy"] == strategy
    assert "Traceback" not in err and "terminate called" not in err


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_leaves_nothing_torn(tmp_path):
    proc = subprocess.Popen(phalanx_cmd() + ["train", *LONG, "--checkpoint-every", "20"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    for line in proc.stdout:
        if line.startswith("step 40,"):
            os.kill(proc.pid, signal.SIGTERM)
            os.kill(proc.pid, signal.SIGINT)  # (two of one kind would merge into one pending signal)
            break
    out, err = proc.communicate(timeout=600)
    second = re.search(r"stopped at once by a second (SIGINT|SIGTERM)", err)  # the kernel picks the order
    assert second and proc.returncode == 128 + getattr(signal, second.group(1)), err
    assert "Traceback" not in err
    # Killed at once, perhaps mid-save: a half-written temporary may be left (the next run clears it), but
    # every finished checkpoint is whole and verifies.
    assert load_checkpoint(latest_checkpoint(only_run(tmp_path)))["step"] >= 20


# ---- self-healing ----

@pytest.mark.slow
def test_a_killed_sync_worker_is_replaced_and_the_run_ends_as_if_nothing_happened(uninterrupted, tmp_path):
    # No periodic checkpoint before the death: the survivor saves the step it finished, and the restart resumes there.
    code, out, err = run_and_signal(["train", "--steps", "60", "--checkpoint-every", "1000", "--log-every", "10",
                                     "--max-restarts", "2"], tmp_path, "step 30,", signal.SIGKILL, rank=1)
    assert code == 0, err
    died = re.search(r"worker 1 died at step (\d+) \(SIGKILL\); restart 1 of 2 from checkpoint step (\d+) \(the "
                     r"survivors' save\)", err)
    assert died, err
    # The step it died in is read from a heartbeat newer than its death; the survivors lost at most that one.
    assert 30 <= int(died.group(1)) <= int(died.group(2)) + 1, err
    saved = re.search(r"^worker 1 lost; worker 0 saved step (\d+), the last step the survivors finished: "
                      r"(runs/sync-1/step-\d+\.pt)$", out, re.M)
    assert saved and saved.group(1) == died.group(2), out
    rescued = load_checkpoint(tmp_path / saved.group(2))  # (verified: the same digest as any checkpoint)
    assert rescued["survivors"] == {"ranks": [0], "lost": [1]} and rescued["rng"][1] is None
    _same_parameters(uninterrupted["model"], load_checkpoint(only_run(tmp_path) / "step-00000060.pt")["model"])


@pytest.mark.slow
def test_under_torchrun_max_restarts_phalanx_resumes_from_its_newest_checkpoint(uninterrupted, tmp_path):
    # (two restarts allowed: on a loaded machine torch's gloo rendezvous of a restarted group can itself fail once)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "2", "--monitor-interval", "0.5", "-m", "phalanx", "train", "--steps", "60", "--checkpoint-every", "20",
           "--log-every", "10"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in proc.stdout:
        if line.startswith("step 30,"):  # torchrun's agent runs in its own process: the workers are its children
            os.kill(spawned_children(proc.pid, "phalanx")[-1], signal.SIGKILL)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    # Killed at step 30 or a step later: the survivor saved the step it finished (not the periodic one at 20).
    resumed = re.search(r"resuming at step (\d+)", out)
    assert resumed and int(resumed.group(1)) >= 29 and "worker 0 saved step" in out, out
    _same_parameters(uninterrupted["model"], load_checkpoint(tmp_path / "checkpoints" / "step-00000060.pt")["model"])
