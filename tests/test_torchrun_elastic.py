"""torchrun elastic on loopback: two agents (two "nodes"), one lost mid-run; the survivor's restarted
worker resumes phalanx's newest checkpoint on the smaller world and completes (real agents, real SIGKILL)."""

import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import spawned_children
from phalanx.checkpoint import latest_checkpoint, load_checkpoint

STEPS = 600


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(cwd, port, host, log):
    """One torchrun agent of an elastic job on loopback (one worker), in a session of its own (a "node")."""
    # read_timeout: the rendezvous store's (60 s by default), which a loaded machine can exceed while
    # a joining agent starts; the job would then end inside torchrun, not inside phalanx.
    conf = f"is_host={int(host)},last_call_timeout=1,join_timeout=120,read_timeout=300"
    cmd = [sys.executable, "-m", "phalanx.torchrun", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", conf, "--max-restarts",
           "3", "--monitor-interval", "0.5", "-m", "phalanx", "train", "--model", "mlp", "--steps", str(STEPS),
           "--checkpoint-every", "50", "--log-every", "25", "--progress", "lines"]
    return subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _wait_for(predicate, survivor, log, timeout=600):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline and survivor.poll() is None, log()[-3000:]
        time.sleep(0.1)


@pytest.mark.slow
def test_torchrun_elastic_shrinks_when_a_node_dies_and_completes_on_the_survivor(tmp_path):
    port = _free_port()
    logs = [open(tmp_path / f"agent{i}.log", "w+") for i in range(2)]
    text = lambda i: (tmp_path / f"agent{i}.log").read_text()  # noqa: E731
    survivor = _agent(tmp_path, port, True, logs[0])
    lost = _agent(tmp_path, port, False, logs[1])
    try:
        # Between checkpoints (at 100 and 150): the survivor loses its peer inside DDP's all-reduce, as a real
        # node's death mostly finds it, not in a checkpoint's gather.
        _wait_for(lambda: re.search(r"^step 125,", text(0) + text(1), re.M), survivor, lambda: text(0))
        # The node dies: its agent and its worker at once (torchrun starts each worker in a session of its own).
        for pid in [lost.pid] + spawned_children(lost.pid, "phalanx"):
            os.kill(pid, signal.SIGKILL)
        lost.wait()
        # The survivor's agent restarts its worker on the smaller world; phalanx resumes from its newest checkpoint.
        _wait_for(lambda: re.search(r"world size 1, .*resuming at step \d+", text(0)), survivor, lambda: text(0))
        assert survivor.wait(timeout=300) == 0, text(0)[-3000:]
    finally:
        for proc in (survivor, lost):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))["step"] == STEPS
    # The survivor's worker fails out of its collective at once (gloo sees the connection close long before the
    # agent's keep-alive misses the node) and says so in one line; torch logs the lost node's broken connections
    # itself, but what must not happen is an abort.
    assert re.search(r"^(rank 1: )?error: worker [01] lost a peer in .*\(step \d+\): "
                     r".*restarts from the newest checkpoint$",
                     text(0), re.M), text(0)[-3000:]
    assert "terminate called" not in text(0), text(0)[-3000:]


def _store(port):
    """The rendezvous store in a process of its own, as docs/multi-node.md's elastic section runs it."""
    import socket
    import time

    code = (f"import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', {port}, is_master=True, "
            "wait_for_workers=False); time.sleep(10**9)")
    store = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while True:  # (importing torch takes seconds here)
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return store
        assert store.poll() is None and time.monotonic() < deadline, "the store did not start"
        time.sleep(0.2)


#: The digits mlp at a pace the test can follow: alone after the second node was started, its steps crawl until
#: that node has joined (a step of 50 ms, however long the joining takes); on two nodes, 20 ms a step.
PACED = """
import os
import time

import torch.distributed as dist
from torch import nn


class Net(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        if dist.is_initialized() and dist.get_world_size() == 2:
            open("grown", "w").close()
            time.sleep(0.02)
        elif os.path.exists("go") and not os.path.exists("grown"):
            time.sleep(0.05)
        return super().forward(x)
"""


def _agent_of_job(cwd, port, log, after=None, model="mlp"):
    """One agent as docs/multi-node.md's elastic section starts it: the store hosted apart (``is_host=0``), and a job id
    that every agent shares (``--rdzv-id``: a restarted attempt continues the run whichever agent claimed its
    checkpoint directory; with torchrun's default id, ``none``, a run is its claiming agent's). ``after``: a file
    whose appearance the agent waits for (its process, and so its place in the rendezvous's order, exists from now)."""
    conf = "is_host=0,last_call_timeout=1,join_timeout=120,read_timeout=300"
    cmd = [sys.executable, "-m", "phalanx.torchrun", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
           "--rdzv-conf", conf, "--max-restarts", "3", "--monitor-interval", "0.5", "-m", "phalanx", "train",
           "--model", model, "--steps", str(STEPS), "--checkpoint-every", "50", "--log-every", "50", "--progress",
           "lines"]
    if after is not None:
        cmd = ["sh", "-c", f'until [ -e {after} ]; do sleep 0.1; done; exec "$@"', "sh", *cmd]
    return subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.slow
def test_an_elastic_job_grows_by_a_node_that_joins_late_then_survives_the_agent_that_would_host_the_store(tmp_path):
    # Growing: one agent trains alone, as rank 0 of the rendezvous, until the other joins; the joiner, older by
    # its process id, is rank 0 of the next round. Under torch's shared store the first agent kept its own round's
    # store address and its worker waited on a store no other rank used (5 minutes, then again at each restart):
    # phalanx.torchrun gives each round a store of its own.
    # Shrinking: an agent that hosts the store takes it along when it dies (the other exits 1 within seconds,
    # RendezvousConnectionError), so docs/multi-node.md hosts the store apart; then any agent may die.
    port = _free_port()
    store = _store(port)
    logs = [open(tmp_path / f"agent{i}.log", "w+") for i in range(2)]
    text = lambda i: (tmp_path / f"agent{i}.log").read_text()  # noqa: E731
    (tmp_path / "paced.py").write_text(PACED)
    late = _agent_of_job(tmp_path, port, logs[0], after="go", model="paced:Net")
    survivor = _agent_of_job(tmp_path, port, logs[1], model="paced:Net")
    try:
        _wait_for(lambda: re.search(r"^step 100,", text(1), re.M), survivor, lambda: text(1))
        (tmp_path / "go").touch()
        _wait_for(lambda: re.search(r"world size 2, .*resuming at step \d+", text(0) + text(1)), survivor,
                  lambda: text(0) + text(1))
        _wait_for(lambda: re.search(r"^step 250,", text(0) + text(1), re.M), survivor, lambda: text(0) + text(1))
        # The late agent dies: rank 0 of the grown job, whose worker claimed nothing (the run is the job's).
        for pid in [late.pid] + spawned_children(late.pid, "phalanx"):
            os.kill(pid, signal.SIGKILL)
        late.wait()
        _wait_for(lambda: re.search(r"world size 1, .*resuming at step \d+", text(1)), survivor,
                  lambda: text(1))
        assert survivor.wait(timeout=300) == 0, text(1)[-3000:]
    finally:
        for proc in (late, survivor, store):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))["step"] == STEPS
