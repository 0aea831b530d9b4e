"""Every strategy's layout and the SSP gate, as pure logic: no processes (test tier 1 of docs/architecture.md)."""

import pytest
import torch
from torch import nn

from phalanx import FSDP, SSP, Backup, DiLoCo, Hogwild, LocalSGD, ParameterServer, Pipeline, Sync
from phalanx.errors import PhalanxError
from phalanx.task.models import lstm
from phalanx.strategies import STRATEGIES, Job, Layout, RankPlan, Role, StopRule
from phalanx.strategies.ps.gate import Gate

CPU = torch.device("cpu")


def cpus(n: int) -> tuple:
    return (CPU,) * n


@pytest.mark.slow
@pytest.mark.parametrize("options", [Sync(), LocalSGD(), DiLoCo(), Hogwild(), FSDP()], ids=lambda o: o.name)
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_data_parallel_layouts_one_worker_per_device_each_its_own_shard(options, workers):
    layout = options.layout(Job(cpus(workers), batch_size=8))
    assert layout.world_size == workers and layout.shards == workers and layout.lockstep
    assert [r.role for r in layout.ranks] == ["worker"] * workers
    assert [r.shard for r in layout.ranks] == list(range(workers))
    assert [r.evaluates for r in layout.ranks] == [(r, workers) for r in range(workers)]
    assert not any(r.expendable for r in layout.ranks)
    assert layout.devices == cpus(workers)
    assert [layout.label(r) for r in range(workers)] == [f"worker {r}" for r in range(workers)]


@pytest.mark.parametrize("options", [ParameterServer(), SSP(staleness=2), Backup(backup_workers=1)],
                         ids=lambda o: o.name)
@pytest.mark.parametrize("workers", [2, 3, 4])
def test_parameter_server_layout_adds_a_server_that_reads_no_data_and_workers_that_may_die(options, workers):
    layout = options.layout(Job(cpus(workers)))
    assert layout.world_size == workers + 1 and layout.shards == workers and not layout.lockstep
    assert [r.role for r in layout.ranks] == ["server"] + ["worker"] * workers
    assert [r.shard for r in layout.ranks] == [None] + list(range(workers))  # worker r reads shard r - 1
    assert layout.ranks[0].evaluates == (0, 1) and all(r.evaluates is None for r in layout.ranks[1:])
    assert [r.expendable for r in layout.ranks] == [False] + [True] * workers
    assert layout.label(0) == "the parameter server (rank 0)" and layout.label(workers) == f"worker {workers}"
    assert layout.expendable(1) and not layout.expendable(0)


@pytest.mark.parametrize("options", [Sync(), ParameterServer(), FSDP(tensor_parallel=2)], ids=lambda o: o.name)
def test_a_layout_of_a_million_workers_makes_no_rank_until_one_is_read(options):
    """What ``phalanx estimate --workers 1000000`` asks of a layout: its size and whether it accepts the workers.
    Its ranks are made when read (8 bytes a device is all it holds per rank: 4 s and 250 MB when each was made);
    read, they are what a small layout's are, and it pickles to workers and compares as the tuple of its ranks."""
    import pickle
    import tracemalloc

    n = 1_000_000
    job = Job(cpus(n), batch_size=8)
    tracemalloc.start()
    try:
        layout = options.layout(job)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 * n  # the devices: one tuple of references, and the server's copy of it (ps)
    last = layout.ranks[-1]
    assert layout.world_size == len(layout.ranks) == n + (options.name == "ps")
    assert last.label == f"worker {layout.world_size - 1}" and layout.label(layout.world_size - 1) == last.label
    small = options.layout(Job(cpus(4), batch_size=8))
    assert small.ranks == tuple(small.ranks) and list(small.ranks[1:3]) == [small.ranks[1], small.ranks[2]]
    assert pickle.loads(pickle.dumps(small)) == small and hash(small) == hash(pickle.loads(pickle.dumps(small)))
    with pytest.raises(IndexError):
        small.ranks[len(small.ranks)]


def test_kinds_are_their_words_and_a_word_that_is_none_is_refused():
    """A strategy of the user's may spell a kind as a word: it becomes the member; any other word is refused."""
    plan = RankPlan("server", "the server", None, None)
    layout = Layout((plan,), cpus(1), 1, False, stop_rule="each")
    assert plan.role is Role.SERVER and layout.stop_rule is StopRule.EACH and f"{layout.stop_rule}" == "each"
    assert ParameterServer().layout(Job(cpus(2))).stop_rule is StopRule.SERVER
    assert Hogwild().layout(Job(cpus(2))).stop_rule is StopRule.EACH
    assert Sync().layout(Job(cpus(2))).stop_rule is StopRule.AGREE
    with pytest.raises(PhalanxError,
                       match=r"^a layout's stop_rule 'lockstep' is not one of 'agree', 'server', 'each'$"):
        Layout((plan,), cpus(1), 1, True, stop_rule="lockstep")
    with pytest.raises(PhalanxError, match=r"^a rank's role 'replica' is not one of 'worker', 'server', 'stage'$"):
        RankPlan("replica", "a replica", 0, None)


def test_parameter_server_under_torchrun_counts_processes_not_workers():
    layout = ParameterServer().layout(Job(cpus(1), processes=4))  # torchrun started 4 processes
    assert layout.world_size == 4 and layout.shards == 3


def test_backup_workers_must_leave_at_least_one_gradient_per_update():
    assert Backup(backup_workers=2).layout(Job(cpus(3))).shards == 3
    with pytest.raises(PhalanxError, match=r"--backup-workers 3 leaves no gradient to average: each update takes the "
                                           r"first W - B = 3 - 3 = 0 of 3 workers' gradients; use --backup-workers 2 "
                                           r"or fewer, or --workers 4 or more"):
        Backup(backup_workers=3).layout(Job(cpus(3)))
    with pytest.raises(PhalanxError, match="--backup-workers must be 0 or more"):
        Backup(backup_workers=-1)


@pytest.mark.parametrize("options", [ParameterServer(), SSP(staleness=0), Backup(backup_workers=0)],
                         ids=lambda o: o.name)
def test_parameter_server_needs_two_workers(options):
    with pytest.raises(PhalanxError, match=f"--strategy {options.name} needs at least 2 workers .* with 1 worker"):
        options.layout(Job(cpus(1)))


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_pipeline_layout_one_stage_per_worker_all_reading_the_whole_batch(stages):
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    layout = Pipeline().layout(Job(cpus(stages), batch_size=8, model=model))
    assert layout.world_size == stages and layout.shards == 1 and layout.lockstep
    assert [r.role for r in layout.ranks] == ["stage"] * stages
    assert [r.shard for r in layout.ranks] == [0] * stages and all(r.evaluates == (0, 1) for r in layout.ranks)
    assert layout.label(1 if stages > 1 else 0).startswith("stage")


@pytest.mark.parametrize("stages, workers", [(2, 4), (2, 6), (3, 6), (1, 3)])
def test_pipeline_times_data_parallel_layout_is_a_stage_major_mesh_each_replica_its_own_shard(stages, workers):
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    layout = Pipeline(stages=stages).layout(Job(cpus(workers), batch_size=8, model=model))
    replicas = workers // stages
    assert layout.world_size == workers and layout.shards == replicas and layout.lockstep
    assert [r.role for r in layout.ranks] == ["stage"] * workers
    # rank = stage x replicas + replica: the stages of one replica read one shard, replicas differ
    assert [r.shard for r in layout.ranks] == [rank % replicas for rank in range(workers)]
    assert [r.evaluates for r in layout.ranks] == [(rank % replicas, replicas) for rank in range(workers)]
    last = workers - 1
    assert layout.label(last) == f"stage {stages - 1} replica {replicas - 1} (rank {last})"
    assert not any(r.expendable for r in layout.ranks)


@pytest.mark.parametrize("kwargs, job, message", [
    (dict(stages=3), Job(cpus(2)), "--stages 3 needs 3 workers .* add --workers 3"),
    (dict(stages=2), Job(cpus(5)), r"--workers 5 is not a multiple of --stages 2 \(5 / 2 = 2.5 replicas of the "
                                   r"pipeline\); use --workers 4 or 6"),
    (dict(stages=3), Job(cpus(1), processes=7), r"--workers 7 is not a multiple of --stages 3 .*use --workers 6 or 9"),
    (dict(chunks=4), Job(cpus(2), batch_size=30), r"batch 30 does not split into 4 equal micro-batches .* = 7.5"),
    (dict(chunks=2), Job(cpus(2), batch_size=16, accumulate=3), r"--chunks 2 x --accumulate 3"),
    (dict(balance="3,3"), Job(cpus(2), model=lstm((1, 8, 8), 10)),
     r"--balance 3,3 sums to 6 \(3 \+ 3\) but the model has 5"),
    (dict(), Job(cpus(4), model=nn.Sequential(nn.Linear(2, 2), nn.ReLU())), "4 stages but the model has only 2 blocks"),
    (dict(schedule="1f1b", chunks=1), Job(cpus(2), batch_size=8), "--schedule 1f1b needs at least one micro-batch"),
])
def test_pipeline_layout_refuses_what_cannot_run(kwargs, job, message):
    with pytest.raises(PhalanxError, match=message):
        Pipeline(**kwargs).layout(job)


class NoBlocks(nn.Module):
    """Parameters but no submodule: nothing for fsdp to shard block by block."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(64, 10))

    def forward(self, x):
        return x.flatten(1) @ self.weight


class Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8))
        self.act = nn.ReLU()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.act(self.encoder(x)))


def test_fsdp_shards_each_block_the_sequential_children_a_user_model_s_repeated_blocks_or_the_named_ones():
    from phalanx.strategies.fsdp import shard_units

    names = lambda units: [n for n, _ in units]  # noqa: E731
    assert names(shard_units(lstm((1, 8, 8), 10))) == ["0", "1", "2", "3", "4"]
    assert names(shard_units(Named())) == ["encoder.0", "encoder.1"]  # repeated in a Sequential; head: the root's
    assert names(shard_units(Named(), ("encoder", "act", "head"))) == ["encoder", "head"]  # act holds no parameter
    assert names(shard_units(Named(), ("encoder.0", "encoder.1", "head"))) == ["encoder.0", "encoder.1", "head"]
    assert FSDP(blocks="encoder, head").blocks == ("encoder", "head")
    assert FSDP().layout(Job(cpus(3), model=Named())).world_size == 3


@pytest.mark.parametrize("options, model, message", [
    (FSDP(), NoBlocks(), "NoBlocks has no blocks to shard: .* make the model an nn.Sequential of blocks"),
    (FSDP(), nn.Sequential(nn.ReLU(), nn.Flatten()), "Sequential has no blocks to shard"),
    (FSDP(blocks=("encoder", "decoder")), Named(),
     r"--blocks names 'decoder', neither a submodule nor a module class of Named \(its repeated blocks: Linear "
     r"\(encoder.0, encoder.1\); its children: encoder, act, head\)"),
])
def test_fsdp_layout_refuses_a_model_with_nothing_to_shard(options, model, message):
    with pytest.raises(PhalanxError, match=message):
        options.layout(Job(cpus(2), model=model))


def test_sync_orders_gpus_by_island_and_hands_the_rank_islands_to_the_runtime():
    """Pure: the GPU islands come in the Job (the parent detected them); no GPU is needed to lay out."""
    gpus = tuple(torch.device("cuda", i) for i in (0, 2, 1, 3))
    layout = Sync(reduce="auto").layout(Job(gpus, gpu_islands=((0, 1), (2, 3))))
    assert [d.index for d in layout.devices] == [0, 1, 2, 3]
    assert layout.islands == ((0, 1), (2, 3))
    flat = Sync().layout(Job(gpus, gpu_islands=((0, 1), (2, 3))))
    assert [d.index for d in flat.devices] == [0, 2, 1, 3] and flat.islands is None  # flat: nothing reordered


def test_sync_islands_given_must_cover_every_rank_and_cpu_hierarchy_needs_them():
    assert Sync(islands=((0, 1), (2, 3))).layout(Job(cpus(4))).islands == ((0, 1), (2, 3))
    with pytest.raises(PhalanxError, match=r"must list every rank 0..2 exactly once"):
        Sync(islands=((0, 1),)).layout(Job(cpus(3)))
    with pytest.raises(PhalanxError, match="--reduce hierarchical on CPU workers needs the islands spelled out"):
        Sync(reduce="hierarchical").layout(Job(cpus(2)))


def test_hogwild_refuses_cuda_and_several_machines(monkeypatch):
    with pytest.raises(PhalanxError, match="refuses CUDA"):
        Hogwild().layout(Job((torch.device("cuda", 0),)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(PhalanxError, match="one machine only"):
        Hogwild().layout(Job(cpus(2), processes=4))


def test_options_are_frozen_and_validated_with_the_arithmetic():
    with pytest.raises(Exception):
        Sync().bucket_mb = 1.0  # frozen: nothing edits options after they are made
    with pytest.raises(PhalanxError, match="--staleness must be 0 or more steps"):
        SSP(staleness=-1)
    with pytest.raises(PhalanxError, match=r"--balance 1,2,2 names 3 stages but the pipeline has 2"):
        Pipeline(stages=2, balance="1,2,2")
    assert Pipeline(balance="3,2").balance == (3, 2) and Sync(compress="none").compress is None


def test_every_strategy_is_registered_and_exported():
    import phalanx

    assert set(STRATEGIES) == {"sync", "ps", "ssp", "backup", "hogwild", "local-sgd", "diloco", "pipeline",
                               "fsdp"}
    for cls in STRATEGIES.values():
        assert getattr(phalanx, cls.__name__) is cls, cls.__name__


# ---- the SSP gate ----

def test_gate_bound_k_lets_a_worker_lead_the_slowest_by_at_most_k_steps():
    gate = Gate([1, 2, 3], bound=2)
    assert all(gate.may_start(w) for w in (1, 2, 3))
    for _ in range(2):
        gate.tick(1)
    assert gate.lead(1) == 2 and gate.may_start(1)  # 2 ahead of the slowest: still allowed
    gate.tick(1)
    assert gate.lead(1) == 3 and not gate.may_start(1)
    gate.tick(2)
    assert not gate.may_start(1)  # worker 3 is still at 0
    gate.tick(3)
    assert gate.slowest() == 1 and gate.may_start(1)


def test_gate_zero_is_lockstep_and_none_is_unbounded():
    lock = Gate([1, 2], bound=0)
    lock.tick(1)
    assert not lock.may_start(1) and lock.may_start(2)
    free = Gate([1, 2], bound=None)
    for _ in range(100):
        free.tick(1)
    assert free.may_start(1) and free.lead(1) == 100


def test_gate_a_dead_worker_no_longer_holds_the_others_back():
    gate = Gate([1, 2, 3], bound=1)
    gate.tick(1)
    gate.tick(1)
    gate.tick(2)
    gate.tick(2)
    assert not gate.may_start(1)  # worker 3 (clock 0) holds the floor
    gate.lose(3)
    assert gate.slowest() == 2 and gate.may_start(1) and gate.may_start(2)
    gate.lose(1)
    gate.lose(2)
    assert gate.slowest() == 0  # no live worker: the floor is 0, nothing divides by zero
