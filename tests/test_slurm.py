"""Jobs started by Slurm: the environment rules as pure logic, then two real tasks set up as srun sets them.

The end-to-end test starts two ``phalanx train`` processes with the variables ``srun -N1 -n2``
gives its tasks (one node, two tasks) and checks that they form one job: rank 0 reports world
size 2, and the parameters equal those of the same run with phalanx spawning its own 2 workers.
"""

import os
import socket
import subprocess

import pytest
import torch

from helpers import only_run, phalanx_cmd, run_in_process
from phalanx.errors import PhalanxError
from phalanx.launcher.env import (SLURM_DEFAULT_PORT, expand_hostlist, expand_tasks_per_node, joined,
                                slurm_default_port)

SRUN_ONE_NODE = {"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[01-03,07],gpu5", "SLURM_JOB_ID": "123456",
                 "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2"}


# ---------------------------------------------------------------- the host list expander (pure)

@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("a1,b2", ["a1", "b2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("x[3],y[001-002].cluster", ["x3", "y001.cluster", "y002.cluster"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_compressed_host_lists_expand_in_order(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-03", "node]1[", "node[a-b]", "node[5-3]", ",", "n[1-2]]"])
def test_malformed_host_lists_are_one_line_errors(text):
    with pytest.raises(PhalanxError, match="host list"):
        expand_hostlist(text)


def test_tasks_per_node_lists_expand():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(PhalanxError, match="tasks per node"):
        expand_tasks_per_node("2x3")


# ---------------------------------------------------------------- which launcher started us (pure)

def test_no_launcher_variables_means_phalanx_spawns():
    assert joined({}) is None
    assert joined({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}) is None  # SLURM_LOCALID missing: not an srun task


def test_slurm_task_joins_at_the_first_host_of_the_node_list():
    job = joined({**SRUN_ONE_NODE, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"})
    assert (job.launcher, job.rank, job.world_size, job.local_rank, job.local_world_size) == ("slurm", 1, 2, 1, 2)
    assert job.init_method == f"tcp://node01:{SLURM_DEFAULT_PORT + 456}"


def test_master_addr_and_port_override_the_node_list_and_the_default_port():
    job = joined({**SRUN_ONE_NODE, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "MASTER_ADDR": "10.0.0.5",
                  "MASTER_PORT": "40000"})
    assert job.init_method == "tcp://10.0.0.5:40000"


def test_the_default_port_is_documented_base_plus_job_id():
    assert slurm_default_port(None) == SLURM_DEFAULT_PORT == 29500
    assert slurm_default_port("1999") == 29500 + 999


def test_the_step_task_count_wins_over_the_allocation():
    # srun -n 2 inside an allocation of 8 tasks: the step has 2 tasks
    job = joined({**SRUN_ONE_NODE, "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0",
                  "SLURM_LOCALID": "0"})
    assert job.world_size == 2


def test_cpus_per_task_are_the_workers_threads():
    env = {**SRUN_ONE_NODE, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert joined(env).threads is None
    assert joined({**env, "SLURM_CPUS_PER_TASK": "8"}).threads == 8


def test_local_world_size_is_this_nodes_entry():
    env = {**SRUN_ONE_NODE, "SLURM_NTASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_PROCID": "6",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "3"}
    assert joined(env).local_world_size == 1


@pytest.mark.parametrize("extra, local", [
    ({"SLURM_NTASKS_PER_NODE": "3"}, 3),  # --ntasks-per-node
    ({"SLURM_NNODES": "2"}, 4),  # 7 tasks over 2 nodes: at most 4 on this one
    ({}, 7),  # nothing says: every task on this node (the safe share: fewer threads, never oversubscribed)
])
def test_local_world_size_without_a_tasks_per_node_list(extra, local):
    env = {**SRUN_ONE_NODE, "SLURM_NTASKS": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", **extra}
    del env["SLURM_STEP_TASKS_PER_NODE"]
    assert joined(env).local_world_size == local


def test_torchrun_variables_win_over_slurm():
    env = {**SRUN_ONE_NODE, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "RANK": "3", "WORLD_SIZE": "4",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    job = joined(env)
    assert (job.launcher, job.rank, job.world_size, job.local_rank, job.local_world_size) == ("torchrun", 3, 4, 1, 2)
    assert job.init_method == "env://"


@pytest.mark.parametrize("change, message", [
    ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' in the environment is not a whole number"),
    ({"SLURM_PROCID": "2"}, "slurm says rank 2 of 2"),
    ({"SLURM_JOB_NODELIST": ""}, "neither MASTER_ADDR nor SLURM_JOB_NODELIST"),
])
def test_bad_slurm_variables_are_one_line_errors(change, message):
    env = {**SRUN_ONE_NODE, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", **change}
    with pytest.raises(PhalanxError, match=message):
        joined(env)


# ---------------------------------------------------------------- two real tasks, as srun starts them

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_")) and
            k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}


TRAIN = ["train", "--devices", "cpu", "--steps", "6", "--log-every", "3", "--checkpoint-every", "0",
         "--progress", "lines", "--batch-size", "16"]


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory):
    """Two tasks with the variables `srun -N1 -n2` sets: SLURM_PROCID/LOCALID 0 and 1 of SLURM_NTASKS 2.

    No MASTER_ADDR: the address comes from the first host of the compressed node list.
    """
    cwd = tmp_path_factory.mktemp("slurm")
    port = _free_port()
    procs = []
    for task in range(2):
        # No tasks-per-node list and no SLURM_CPUS_PER_TASK (as when the variables are set by hand): each
        # task must still take only its share of the cores.
        env = {**_clean_env(), "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "SLURM_NTASKS": "2",
               "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
               "SLURM_JOB_ID": "4242", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
        procs.append(subprocess.Popen(phalanx_cmd() + TRAIN, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL))
    outputs = [p.communicate(timeout=300) for p in procs]
    return cwd, [p.returncode for p in procs], outputs


@pytest.mark.slow
def test_two_slurm_tasks_form_one_job(slurm_run):
    _, codes, outputs = slurm_run
    assert codes == [0, 0], [err[-2000:] for _, err in outputs]
    out0, out1 = outputs[0][0], outputs[1][0]
    assert "world size 2" in out0 and "global batch 32 (16 per worker x 2)" in out0
    assert "test accuracy" in out0
    assert "phalanx train:" not in out1 and "test accuracy" not in out1  # only rank 0 reports the run
    assert "wall time" in out0 and out1 == ""
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"on digits, {share} thread{'s' if share > 1 else ''} per worker\n" in out0, out0
    assert not any(t in err for _, err in outputs for t in ("terminate called", "Exception raised from")), outputs


@pytest.mark.slow
def test_slurm_tasks_compute_what_phalanx_spawned_workers_compute(slurm_run, tmp_path):
    cwd, codes, _ = slurm_run
    assert codes == [0, 0]
    spawned = run_in_process(*TRAIN, "--workers", "2", cwd=tmp_path)
    assert spawned.returncode == 0, spawned.stderr[-2000:]
    a = torch.load(cwd / "checkpoints" / "step-00000006.pt", weights_only=True)["model"]
    b = torch.load(only_run(tmp_path) / "step-00000006.pt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)
