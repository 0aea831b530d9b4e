"""fsdp computes what one process computes on the whole batch, holds 1/W of it, and saves a plain model.

Test tier 3 of docs/architecture.md. One launch per worker count (2, then 3), each running every configuration
from the same seed against one process on the whole batch (worker start-up dominates):

- parameters after K steps with SGD (momentum) and Adam, with and without resharding after
  forward, and with gradient accumulation; in float64, to 1e-10: that is tight enough that the
  known failure of sharded averaging on gloo (gradients summed over ranks instead of averaged,
  a relative error of W - 1) or a shard applied to the wrong rows cannot hide, and float64
  because Adam divides by sqrt(v): in float32 the rounding of near-zero gradients, which
  depends on how the batch was split, moves such parameters by up to 1e-4 of lr. And SGD in
  float32 to 1e-5, because that is where the averaging can go wrong: fsdp reduce-scatters float32
  gradients with ReduceOp.AVG (gloo's, in one collective) but float64 ones with SUM, then divides;
- the checkpoint: the full model and the full optimizer state, in the plain optimizer's
  numbering; it loads into the unsplit model (which then continues exactly), into fsdp on 3
  workers, into sync on 3 workers and into a 3-stage pipeline (each continues exactly);
- evaluation when ranks hold different numbers of test batches;
- memory: every built-in model's parameters, gradients and optimizer state per rank are within
  10% of a replica's / W.

Then whole runs: the CLI trains the default digits model to >= 0.95 on 2 workers, reports half a
replica per rank and saves the unsplit model; --resume continues exactly; sync and pipeline
report their memory too; a model with no blocks is refused before a worker starts.
"""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from helpers import gather, only_run, run_cli, run_workers
from phalanx import FSDP, Pipeline, Sync, TrainConfig, Trainer
from phalanx.errors import PhalanxError
from phalanx.launcher import WorkerContext
from phalanx.memory import held
from phalanx.task.models import MODELS, build_model, cnn
from phalanx.strategies import runtime_for
from phalanx.checkpoint import latest_checkpoint, load_checkpoint, tensors

K, SPLIT = 4, 2  # steps compared; the step the resumed runs start from
BATCH = 12  # splits evenly over 2 and 3 workers
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def make_model(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return cnn((1, 8, 8), 10).to(dtype)


def batches(dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 1, 8, 8, generator=g).to(dtype), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(K)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


OPTIMIZERS = {"sgd": sgd, "adam": adam}


def reference(opt: str, steps: int = K, start: dict = None, dtype: torch.dtype = torch.float64) -> dict:
    """One process on the whole batch (from a checkpoint's state when ``start`` is given)."""
    model = make_model(dtype)
    optimizer = OPTIMIZERS[opt](model.parameters())
    if start is not None:
        start = copy.deepcopy(start)  # Adam counts its steps in place, in the tensor it was given
        model.load_state_dict(start["model"])
        optimizer.load_state_dict(start["optimizer"])
    for x, y in batches(dtype)[start["step"] if start else 0:steps]:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def my_part(ctx: WorkerContext, t: torch.Tensor) -> torch.Tensor:
    n = len(t) // ctx.world_size
    return t[ctx.rank * n:(ctx.rank + 1) * n]


def run(ctx: WorkerContext, options, opt: str, steps: int = K, accumulate: int = 1, start: dict = None,
        dtype: torch.dtype = torch.float64) -> dict:
    """``steps`` steps of ``options`` on this rank's part of each batch; rank 0 gets the full checkpoint."""
    # Every stage of a pipeline reads the whole batch; data-parallel ranks read their part.
    part = (lambda t: t) if isinstance(options, Pipeline) else (lambda t: my_part(ctx, t))
    example = tuple(part(t) for t in batches(dtype)[0])
    runtime = runtime_for(options, ctx, make_model(dtype), OPTIMIZERS[opt], F.cross_entropy, accumulate=accumulate,
                          example=example)
    if start is not None:
        # A copy: the checkpoint's tensors arrive in shared memory from the parent (torch.multiprocessing),
        # and Adam counts its steps in place, in the tensor it was given.
        start = copy.deepcopy(start)
        runtime.load_state_dict(start)
        assert all(type(v) is torch.Tensor for v in start["model"].values())  # still a plain checkpoint
    for x, y in batches(dtype)[start["step"] if start else 0:steps]:
        runtime.train_step(part(x), part(y))
    state = runtime.state_dict()
    return None if state is None else {**state, "step": steps}


def assert_same(got: dict, want: dict, label: str) -> None:
    assert list(got["model"]) == list(want["model"]), label  # the plain model's keys, in order
    tol = TOL[next(iter(want["model"].values())).dtype]
    for name, p in want["model"].items():
        torch.testing.assert_close(got["model"][name], p, **tol, msg=lambda m: f"{label}: {name}: {m}")
    g, w = got["optimizer"], want["optimizer"]
    assert [grp["params"] for grp in g["param_groups"]] == [grp["params"] for grp in w["param_groups"]], label
    assert g["state"].keys() == w["state"].keys(), label
    for i, state in w["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(g["state"][i][key], value, **tol, msg=lambda m: f"{label}: state {i} {key}: {m}")


def memory_of_builtins(ctx: WorkerContext, options) -> dict:
    """Per-rank bytes of each built-in model after one SGD-with-momentum step (the state then exists)."""
    out = {}
    for name in MODELS:
        torch.manual_seed(0)
        runtime = runtime_for(options, ctx, build_model(name, (1, 8, 8), 10), sgd)
        runtime.train_step(torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,)))
        out[name] = gather(ctx, held(runtime.module, runtime.optimizer))
    return out


def uneven_evaluation(ctx: WorkerContext) -> tuple:
    """Rank 0 evaluates two batches, the others one: every forward is a collective, so they must keep in step."""
    runtime = runtime_for(FSDP(), ctx, make_model(), sgd)
    g = torch.Generator().manual_seed(7)
    test = [(torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g))
            for n in (5, 4, 3, 2)]
    mine = test[:2] if ctx.rank == 0 else test[1 + ctx.rank:2 + ctx.rank]
    return test, gather(ctx, runtime.evaluate(mine))


def different_start(ctx: WorkerContext) -> str:
    """Every rank builds its model from another seed: fully_shard would keep a patchwork of them."""
    torch.manual_seed(ctx.rank)
    try:
        runtime_for(FSDP(), ctx, cnn((1, 8, 8), 10), sgd)
    except PhalanxError as e:
        return str(e)
    return "no error"


def _two_workers(ctx: WorkerContext) -> dict:
    return {
        "different start": different_start(ctx),
        "sgd": run(ctx, FSDP(), "sgd"),
        "sgd float32": run(ctx, FSDP(), "sgd", dtype=torch.float32),
        "adam": run(ctx, FSDP(), "adam"),
        "adam kept gathered": run(ctx, FSDP(reshard_after_forward=False), "adam"),
        "sgd accumulate 3": run(ctx, FSDP(), "sgd", accumulate=3),
        "checkpoint": run(ctx, FSDP(), "adam", steps=SPLIT),
        "memory": memory_of_builtins(ctx, FSDP()),
        "eval": uneven_evaluation(ctx),
    }


def _three_workers(ctx: WorkerContext, checkpoint: dict) -> dict:
    return {
        "sgd": run(ctx, FSDP(), "sgd"),
        "sgd float32": run(ctx, FSDP(), "sgd", dtype=torch.float32),
        "adam": run(ctx, FSDP(), "adam"),
        "fsdp(2) -> fsdp(3)": run(ctx, FSDP(), "adam", start=checkpoint),
        "fsdp(2) -> sync(3)": run(ctx, Sync(), "adam", start=checkpoint),
        "fsdp(2) -> pipeline(3)": run(ctx, Pipeline(chunks=2, balance="params"), "adam", start=checkpoint),
        "memory": memory_of_builtins(ctx, FSDP()),
        "eval": uneven_evaluation(ctx),
    }


@pytest.fixture(scope="module")
def two():
    return run_workers(_two_workers, 2)


@pytest.fixture(scope="module")
def three(two):
    return run_workers(_three_workers, 3, two["checkpoint"])


def want(label: str) -> dict:
    return reference("adam" if "adam" in label else "sgd", dtype=torch.float32 if "float32" in label else torch.float64)


@pytest.mark.parametrize("label", ["sgd", "sgd float32", "adam", "adam kept gathered", "sgd accumulate 3"])
def test_fsdp_on_two_workers_equals_one_process_on_the_whole_batch(two, label):
    assert_same(two[label], want(label), f"2 workers, {label}")


@pytest.mark.slow
@pytest.mark.parametrize("label", ["sgd", "sgd float32", "adam"])
def test_fsdp_on_three_workers_with_uneven_shards_equals_one_process(three, label):
    assert_same(three[label], want(label), f"3 workers, {label}")  # 10 classes: rows split 4, 3, 3


def test_the_comparison_is_not_between_untouched_weights(two):
    moved = max((two["sgd"]["model"][k] - v).abs().max() for k, v in make_model().state_dict().items())
    assert moved > 1e-3


def test_checkpoint_is_the_plain_model_and_optimizer_and_continues_exactly_there(two):
    saved = two["checkpoint"]
    assert saved["optimizer"]["param_groups"][0]["params"] == list(range(len(list(make_model().parameters()))))
    assert_same(saved, reference("adam", steps=SPLIT), "the checkpoint at step 2")
    # The unsplit model and a plain Adam take it and continue to step K exactly.
    assert_same(reference("adam", start=saved), reference("adam"), "fsdp(2) -> plain model")


@pytest.mark.parametrize("label", ["fsdp(2) -> fsdp(3)", "fsdp(2) -> sync(3)", "fsdp(2) -> pipeline(3)"])
def test_checkpoint_resumes_in_fsdp_on_another_worker_count_in_sync_and_in_a_pipeline(three, label):
    assert_same(three[label], reference("adam"), label)


def test_replicas_that_start_different_are_a_loud_error(two):
    assert two["different start"].startswith("replicas differ at start (rank 0 fingerprint")
    assert two["different start"].endswith("build the model identically on every worker (same seed, same code)")


def test_the_start_check_fingerprints_every_tensor_in_chunks_without_a_float64_copy_of_the_model():
    from phalanx.strategies.replicas import fingerprint

    model = make_model()
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    ramp = torch.linspace(1.0, 2.0, len(flat), dtype=torch.float64)
    want = torch.stack([flat.sum(), (flat * flat).sum(), (flat * ramp).sum()])
    torch.testing.assert_close(fingerprint(model, chunk=1000), want, rtol=1e-12, atol=1e-9)
    with torch.no_grad():
        next(model.parameters())[0, 0, 0, 0] += 1e-6
    assert not torch.allclose(fingerprint(model), want, rtol=1e-12, atol=0)


def test_one_process_is_the_plain_model_with_nothing_to_shard():
    ctx = WorkerContext(0, 1, 0, torch.device("cpu"), None)
    assert_same(run(ctx, FSDP(), "adam"), reference("adam"), "one process")


@pytest.mark.parametrize("workers", [2, 3])
def test_evaluation_keeps_ranks_in_step_when_they_hold_different_numbers_of_batches(two, three, workers):
    test, counts = (two if workers == 2 else three)["eval"]
    model = make_model()
    with torch.no_grad():
        used = test[:1 + workers]  # rank 0: batches 0, 1; rank r: batch r + 1
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in used)
    assert counts == [(correct, sum(len(y) for _, y in used))] * workers


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_holds_a_replicas_memory_over_w_within_ten_percent(two, three, workers, name):
    ctx = WorkerContext(0, 1, 0, torch.device("cpu"), None)
    replica = memory_of_builtins(ctx, Sync())[name][0]
    for rank, mine in enumerate((two if workers == 2 else three)["memory"][name]):
        for part in ("parameters", "gradients", "optimizer"):
            share = getattr(replica, part) / workers
            assert abs(getattr(mine, part) - share) <= 0.10 * share, (name, rank, part, mine, replica)
    assert sum(m.parameters for m in (two if workers == 2 else three)["memory"][name]) == replica.parameters


# --------------------------------------------------------------------------- whole runs (spawned workers)


def replica_bytes(name: str = "cnn") -> int:
    """A whole replica's parameter bytes (= its gradients' = SGD-with-momentum's state) of a built-in model."""
    return sum(p.numel() * p.element_size() for p in build_model(name, (1, 8, 8), 10).parameters())


def summary_of(metrics) -> dict:
    return [json.loads(line) for line in metrics.read_text().splitlines() if '"summary"' in line][-1]


def digits_accuracy(model: torch.nn.Module) -> float:
    from phalanx.data import load_data

    test = load_data("digits", seed=0).test
    with torch.no_grad():
        return (model(test.transform(test.x, None)).argmax(1) == test.y).float().mean().item()


@pytest.mark.slow
def test_cli_trains_the_default_digits_model_to_095_holding_half_a_replica_per_rank(tmp_path):
    # (150 steps: 0.983; the defaults' 300 add nothing to what it shows)
    out = run_cli("train", "--strategy", "fsdp", "--steps", "150", "--log-every", "100", "--progress", "lines",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("phalanx train: strategy fsdp (fully_shard), world size 2, devices cpu, backend gloo")
    assert lines[1] == ("fsdp plan: 4 blocks (0, 1, 2, 3) each sharded over a 1-D mesh of 2 ranks (cpu, gloo); "
                        "parameters gathered for forward, freed, gathered again for backward")
    summary = summary_of(only_run(tmp_path) / "metrics.jsonl")
    assert summary["test_accuracy"] >= 0.95
    half = replica_bytes() / 2
    for figures in (summary["memory_bytes"], summary["memory_bytes_max"]):
        assert set(figures) == {"parameters", "gradients", "optimizer"}
        assert all(abs(v - half) <= 0.10 * half for v in figures.values()), figures
    assert f"memory per rank: parameters {summary['memory_bytes']['parameters'] / 1e3:.1f} kB" in out.stdout
    # The checkpoint (sharded, read whole) is the unsplit model's: it loads, with its optimizer, and scores what
    # the run reported.
    state = whole(only_run(tmp_path) / "step-00000150.dcp")
    model = cnn((1, 8, 8), 10)
    model.load_state_dict(state["model"])
    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9).load_state_dict(state["optimizer"])
    assert digits_accuracy(model) == pytest.approx(summary["test_accuracy"], abs=1 / 360 + 1e-9)


def _train(tmp, name: str, **overrides) -> dict:
    cfg = dict(strategy="fsdp", steps=8, batch_size=8, workers=2, devices="cpu", optimizer="adam", lr=0.01,
               log_every=100, progress="none", checkpoint_dir=str(tmp / name), checkpoint_every=4)
    cfg.update(overrides)
    summary = Trainer(TrainConfig(**cfg)).fit()
    return {"summary": summary, "state": whole(latest_checkpoint(tmp / name))}


def whole(path) -> dict:
    """A checkpoint's state with its tensors, a sharded one's read whole (as sync or evaluate reads it)."""
    return tensors(load_checkpoint(path))


@pytest.mark.slow
def test_sync_and_pipeline_report_their_memory_too(tmp_path):
    whole = replica_bytes()
    sync = _train(tmp_path, "sync", strategy="sync", steps=2, optimizer="sgd", checkpoint_every=0)["summary"]
    assert sync["memory_bytes"] == sync["memory_bytes_max"] == {"parameters": whole, "gradients": whole,
                                                                   "optimizer": whole}
    pipe = _train(tmp_path, "pipe", strategy=Pipeline(balance=(1, 3), chunks=2), steps=2, optimizer="sgd",
                  checkpoint_every=0)["summary"]
    stage0 = sum(p.numel() * 4 for p in cnn((1, 8, 8), 10)[0].parameters())
    assert pipe["memory_bytes"] == {"parameters": stage0, "gradients": stage0, "optimizer": stage0}
    assert pipe["memory_bytes_max"]["parameters"] == whole - stage0  # stage 1 holds the rest


class NoBlocks(torch.nn.Module):
    """Parameters but no submodule: nothing for fsdp to shard block by block."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(64, 10))

    def forward(self, x):
        return x.flatten(1) @ self.weight


def test_a_model_without_blocks_is_refused_before_any_worker_starts(tmp_path):
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 10, (40,))
    config = TrainConfig(strategy=FSDP(), workers=2, devices="cpu", checkpoint_dir=str(tmp_path / "c"))
    with pytest.raises(PhalanxError, match="NoBlocks has no blocks to shard: fsdp shards each block"):
        Trainer(config, model=NoBlocks(), train_data=(x, y)).fit()
    assert not (tmp_path / "c").exists()
