"""Pipeline x data parallel computes what the unsplit model computes on the whole batch (test tier 3 of
docs/architecture.md).

P = 2 stages x R = 2 replicas on 4 gloo workers (rank = stage x 2 + replica), and one stage on 4
replicas (data parallelism through the pipeline strategy). Each replica reads its part of every
batch; its stages run the schedule over its own pipeline group, and each
stage's two replicas average their gradients (DDP over the stage's replica group). Every
configuration runs inside ONE launch (four workers' start-up dominates on two cores), each from
the same seed, against one process on the whole batch: the loss of every step, the gradients of
the last step, the parameters after K steps, one whole-model checkpoint that loads into the plain
model, and the evaluation count summed over the replicas. Then the CLI end to end on 4 workers,
and W not a multiple of P refused.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import gather, only_run, run_cli, run_in_process, run_workers
from phalanx.launcher import WorkerContext
from phalanx.task.models import cnn
from phalanx.strategies import Pipeline, runtime_for
from phalanx.checkpoint import load_checkpoint, tensors
import test_pipeline_bn as bn
from test_pipeline_equivalence import BATCH, K, assert_same, batches, make_model, make_optimizer, reference

STAGES, WORKERS = 2, 4
REPLICAS = WORKERS // STAGES
CONFIGS = [("gpipe", 2), ("1f1b", 2), ("gpipe", 4)]  # (schedule, micro-batches per replica's half batch)


def my_part(ctx: WorkerContext, x: torch.Tensor, replicas: int) -> torch.Tensor:
    """The shard of replica (rank mod R): every stage of one replica reads the same part."""
    replica, n = ctx.rank % replicas, len(x) // replicas
    return x[replica * n:(replica + 1) * n]


def run_mesh(ctx: WorkerContext, strategy: Pipeline) -> dict:
    replicas = ctx.world_size // strategy.stages
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    example = tuple(my_part(ctx, t, replicas) for t in batches()[0])
    runtime = runtime_for(strategy, ctx, model, make_optimizer, F.cross_entropy, example=example)
    losses = []
    for x, y in batches()[:K]:
        loss = runtime.train_step(my_part(ctx, x, replicas), my_part(ctx, y, replicas))
        losses.append(float(runtime.global_losses(loss)))
    grads = {names[g]: t for g, t in zip(runtime.local_to_global, runtime.optimizer.seen)}
    merged, per_rank = {}, gather(ctx, grads)
    for part in per_rank[::replicas]:  # replica 0 of each stage
        merged.update(part)
    # Every replica of a stage must hold the same gradients (that is what makes them one model).
    same = all(torch.equal(per_rank[rank][k], v) for rank in range(ctx.world_size)
               for k, v in per_rank[rank - rank % replicas].items())
    g = torch.Generator().manual_seed(5)
    test = [(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in (6, 5, 0, 0)]
    counted = runtime.evaluate([test[ctx.rank % replicas]] if ctx.rank % replicas < 2 else [])
    return {"losses": losses, "grads": merged, "state": runtime.state_dict(), "replicas_equal": same,
            "eval": gather(ctx, counted), "test": test, "label": runtime.build.layout.label(ctx.rank),
            "notes": runtime.notes, "description": runtime.description}


def run_bn_mesh(ctx: WorkerContext, strategy: Pipeline) -> dict:
    """The BatchNorm model of tests/test_pipeline_bn.py on the mesh: the checkpoint and every rank's stage state."""
    replicas = ctx.world_size // strategy.stages
    example = tuple(my_part(ctx, t, replicas) for t in bn.batches()[0])
    runtime = runtime_for(strategy, ctx, bn.make_model(), bn.make_optimizer, F.cross_entropy, example=example)
    losses = [float(runtime.global_losses(runtime.train_step(my_part(ctx, x, replicas), my_part(ctx, y, replicas))))
              for x, y in bn.batches()]
    stage = runtime.stage_module
    mine = stage.full_state_dict() if hasattr(stage, "full_state_dict") else stage.state_dict()
    return {"losses": losses, "state": runtime.state_dict(), "per_rank": gather(ctx, mine), "replicas": replicas}


def _mesh_worker(ctx: WorkerContext) -> dict:
    out = {config: run_mesh(ctx, Pipeline(stages=STAGES, chunks=config[1], schedule=config[0], balance="params"))
           for config in CONFIGS}
    # One stage on four replicas: plain data parallelism, micro-batched in-process.
    out[("one stage", 2)] = run_mesh(ctx, Pipeline(stages=1, chunks=2))
    # BatchNorm, the in-place ReLU first in stage 1: 2 stages x 2 replicas, and one stage x 4 replicas
    bn_runs = {STAGES: Pipeline(stages=STAGES, chunks=2, balance=(1, 2)), 1: Pipeline(stages=1, chunks=2)}
    out["bn"] = {stages: run_bn_mesh(ctx, strategy) for stages, strategy in bn_runs.items()}
    return out


@pytest.fixture(scope="module")
def mesh() -> dict:
    return run_workers(_mesh_worker, WORKERS)


@pytest.mark.slow
def test_two_stages_times_two_replicas_equal_the_unsplit_model_on_the_whole_batch(mesh):
    want = reference()
    assert BATCH % (REPLICAS * 4) == 0
    results = {config: got for config, got in mesh.items() if config != "bn"}
    for config, got in results.items():
        assert got["replicas_equal"], config
        assert_same(got, want, f"2 stages x 2 replicas {config}")
        # The checkpoint is the plain model's: it loads into the unsplit model and its optimizer.
        plain = make_model()
        plain.load_state_dict(got["state"]["model"])
        make_optimizer(plain.parameters()).load_state_dict(got["state"]["optimizer"])
        with torch.no_grad():
            correct = sum(int((plain(x).argmax(1) == y).sum()) for x, y in got["test"])
        assert got["eval"] == [(correct, 11)] * WORKERS, config  # both replicas' parts, on every rank
    some = results[CONFIGS[0]]
    assert some["label"] == "stage 0 replica 0 (rank 0)"
    assert "2 stages x 2 data-parallel replicas" in some["description"]
    assert any("mesh: 2 stages x 2 replicas = 4 ranks" in line for line in some["notes"])
    assert any("stage 1 (ranks 2, 3)" in line for line in some["notes"])


def test_replicas_of_a_stage_hold_the_same_batchnorm_buffers_the_average_of_theirs(mesh):
    for stages, got in mesh["bn"].items():
        replicas, label = got["replicas"], f"{stages} stages x {got['replicas']} replicas"
        for rank, state in enumerate(got["per_rank"]):
            first = got["per_rank"][rank - rank % replicas]  # replica 0 of this rank's stage
            assert list(state) == list(first) and all(torch.equal(v, first[k]) for k, v in state.items()), \
                f"{label}: rank {rank} differs from its stage's replica 0"
        want = bn.reference(chunks=2, replicas=replicas)
        assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **bn.TOL), label
        bn.assert_state_equal(got["state"]["model"], want["state"], label)


@pytest.mark.slow
def test_cli_trains_the_default_digits_model_to_095_on_two_stages_times_two_replicas(tmp_path):
    # (150 steps: 0.983; the defaults' 300 add nothing to what it shows)
    out = run_cli("train", "--strategy", "pipeline", "--stages", "2", "--workers", "4", "--steps", "150",
                  "--log-every", "100", "--progress", "lines", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("phalanx train: strategy pipeline (2 stages x 2 data-parallel replicas, 4 "
                               "micro-batches, gpipe), world size 4")
    assert lines[2].startswith("  mesh: 2 stages x 2 replicas = 4 ranks (rank = stage x 2 + replica)")
    assert lines[3].startswith("  stage 0 (ranks 0, 1): blocks") and lines[4].startswith("  stage 1 (ranks 2, 3)")
    summary = [json.loads(line) for line in (only_run(tmp_path) / "metrics.jsonl").read_text().splitlines()
               if '"summary"' in line][-1]
    assert summary["test_accuracy"] >= 0.95 and summary["replicas"] == 2 and summary["world_size"] == 4
    # The stages' sharded checkpoint (one copy of each stage's state between its replicas), read whole: the
    # unsplit network scores what the run reported.
    state = tensors(load_checkpoint(only_run(tmp_path) / "step-00000150.dcp"))
    model = cnn((1, 8, 8), 10)
    model.load_state_dict(state["model"])
    from phalanx.data import load_data

    test = load_data("digits", seed=0).test
    with torch.no_grad():
        plain = (model(test.transform(test.x, None)).argmax(1) == test.y).float().mean().item()
    assert plain == pytest.approx(summary["test_accuracy"], abs=1 / 360 + 1e-9)


def test_workers_not_a_multiple_of_stages_is_one_line_with_the_arithmetic(tmp_path):
    out = run_in_process("train", "--strategy", "pipeline", "--stages", "2", "--workers", "3", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == ("error: --workers 3 is not a multiple of --stages 2 (3 / 2 = 1.5 replicas of the pipeline); "
                          "use --workers 2 or 4\n")
    assert not list(tmp_path.iterdir())
