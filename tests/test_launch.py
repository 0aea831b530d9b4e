"""The launcher: real spawned gloo workers on loopback."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

from helpers import gather, run_workers
from phalanx.errors import PhalanxError, WorkerFailed


def _sum_of_ranks(ctx):
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return {"world": ctx.world_size, "sum": t.item(), "ranks": gather(ctx, ctx.rank),
            "threads": torch.get_num_threads(), "backend": ctx.backend, "bar_registers": _a_bar_registers()}


def _a_bar_registers() -> list:
    """What drawing a tqdm bar (as inductor does while it compiles) registers with the resource tracker: a worker
    ends with os._exit, which unlinks nothing, so whatever is registered is reported leaked at the job's end."""
    from multiprocessing import resource_tracker

    from tqdm import tqdm

    registered, real = [], resource_tracker.register
    resource_tracker.register = lambda name, kind: registered.append(kind) or real(name, kind)
    try:
        tqdm(total=1, disable=True).close()
    finally:
        resource_tracker.register = real
    return registered


@pytest.mark.slow
def test_two_workers_form_a_gloo_group():
    out = run_workers(_sum_of_ranks, 2)
    assert out["world"] == 2 and out["sum"] == 3.0 and out["ranks"] == [0, 1]
    assert out["backend"] == "gloo"
    assert out["bar_registers"] == []  # ("2 leaked semaphore objects" at the end of every --compile run)


def test_world_size_one_has_no_process_group():
    def single(ctx):
        return ctx.distributed, dist.is_initialized()

    assert run_workers(single, 1) == (False, False)


def _raise_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("tower exploded")
    t = torch.zeros(1)
    dist.all_reduce(t)  # rank 0 waits here for a peer that is gone
    return "unreachable"


@pytest.mark.slow
def test_a_worker_that_raises_brings_the_job_down_naming_the_rank():
    with pytest.raises(WorkerFailed) as info:  # not a hang: the helper's collective timeout is 60 s
        run_workers(_raise_on_rank_1, 2)
    assert info.value.rank == 1
    assert "ValueError: tower exploded" in info.value.detail
    assert "Traceback" in info.value.detail


def _kill_rank_1(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.zeros(1)
    dist.all_reduce(t)


def test_a_killed_worker_is_named():
    with pytest.raises(WorkerFailed, match="worker 1 failed: process .* was killed by SIGKILL"):
        run_workers(_kill_rank_1, 2)


def _user_error_on_rank_1(ctx):
    if ctx.rank == 1:
        raise PhalanxError("checkpoint does not fit; use the same --model")
    dist.barrier()


@pytest.mark.slow
def test_bad_input_found_in_a_worker_stays_a_one_line_error():
    with pytest.raises(PhalanxError, match="^checkpoint does not fit; use the same --model$") as info:
        run_workers(_user_error_on_rank_1, 2)
    assert not isinstance(info.value, WorkerFailed)


def test_torchrun_environment_is_joined(monkeypatch):
    """Under torchrun the process is the worker: RANK/WORLD_SIZE/MASTER_* from the environment."""
    import socket

    from phalanx.launcher import launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # world size 1 under torchrun still runs without a process group
    assert launch(lambda ctx: (ctx.rank, ctx.world_size, ctx.backend), [torch.device("cpu")]) == (0, 1, None)


@pytest.mark.parametrize("nodes, restarts, warned", [("2", "3", True), ("1", "3", False), ("2", "0", False)])
def test_restarts_on_several_nodes_under_torchs_shared_store_are_warned_of(nodes, restarts, warned, monkeypatch):
    """Where a restart would hang (several nodes, restarts allowed, torch's shared store), rank 0 says so and how
    to avoid it; the attempt's store is still the one torchrun's agent serves."""
    import warnings

    from phalanx.launcher.env import Joined
    from phalanx.launcher.joined import SHARED_STORE_RESTARTS, _attempt_store

    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for k, v in {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": nodes, "TORCHELASTIC_MAX_RESTARTS":
                 restarts, "TORCHELASTIC_RESTART_COUNT": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(server.port)}.items():
        monkeypatch.setenv(k, v)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        store = _attempt_store(Joined("torchrun", 0, 2, 0, 1, "env://"), timeout_s=30)
    assert [str(w.message) for w in said] == ([SHARED_STORE_RESTARTS] if warned else [])
    store.set("key", "value")
    assert server.get("phalanx/attempt_1/key") == b"value"


@pytest.mark.parametrize("error, said", [
    # gloo's words as torch 2.13 raised them when a peer was SIGKILLed (DDP's reducer; a hook's callback)
    (RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                  "[127.0.0.1]:13211: Connection reset by peer. This is typically caused by a remote worker hanging "
                  "or bugs in the application."), "Connection reset by peer"),
    (RuntimeError("Got the following error when running the callback: RuntimeError: [/__w/pytorch/pytorch/third_party/"
                  "gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:50090. This is typically "
                  "caused by a remote worker crashing."), "Connection closed by peer"),
    (RuntimeError("DataLoader worker (pid 4242) exited unexpectedly: [Errno 32] Broken pipe"), None),  # not a peer
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"), None),
    (ValueError("gloo: Connection reset by peer"), None),  # not what torch raises
])
def test_a_lost_peer_is_told_from_other_errors_by_the_backends_words(error, said):
    from phalanx.launcher.joined import lost_peer

    assert lost_peer(error) == said
