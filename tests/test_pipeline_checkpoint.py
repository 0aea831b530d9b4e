"""A pipeline's sharded checkpoints: each stage writes its own part, under the unsplit model's names.

- 2 stages save a ``step-N.dcp/`` directory: one shard file per rank, each holding its own stage's
  parameters and their optimizer state (DCP's index says which file holds what), and no file with the
  whole model;
- a run resumed from it on 2 stages with another balance, on 3 stages, in sync (read whole) and in fsdp ends
  where the uninterrupted pipeline run ends (the checkpoints of both compared, read whole: the method of
  test_sharded_checkpoint.py, itself test_pipeline_equivalence.py's on the trainer's files);
- ``phalanx evaluate`` on it prints the numbers the run printed; ``--async-checkpoint`` changes nothing;
- the GPT example, traced and split with its tied embedding on both stages, saves it once and resumes
  exactly; a pipeline's replicas (1 stage x 2 replicas) write one copy between them.
"""

import copy
import json
import sys

import pytest
import torch

from helpers import REPO, run_in_process
from phalanx import Pipeline, TrainConfig, Trainer
from phalanx.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, tensors
from test_sharded_checkpoint import assert_same

sys.path.insert(0, str(REPO / "examples"))
import gpt  # noqa: E402  (the example, importable here and in the spawned workers)


def _train(root, name: str, **overrides) -> dict:
    """A 2-stage pipeline of the digits CNN (Adam and a decaying rate: state and a schedule to carry over)."""
    cfg = dict(strategy=Pipeline(chunks=2, balance=(2, 2)), steps=8, batch_size=12, workers=2, devices="cpu",
               optimizer="adam", lr=0.01, lr_schedule="exponential", lr_decay_every=2, lr_decay_factor=0.5,
               log_every=100, progress="none", checkpoint_dir=str(root / name), checkpoint_every=4)
    cfg.update(overrides)
    summary = Trainer(TrainConfig(**cfg)).fit()
    return {"summary": summary, "state": tensors(load_checkpoint(latest_checkpoint(root / name)))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run, and its first half (4 steps) in another directory."""
    root = tmp_path_factory.mktemp("pipeline-dcp")
    return {"root": root, "straight": _train(root, "straight"), "half": _train(root, "half", steps=4)}


def stored_in(checkpoint) -> dict[str, set[str]]:
    """Which shard file holds each saved entry (``model.<key>``, ``optimizer.state.<name>.<what>``), by DCP's
    own index."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    files: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(index.fqn, set()).add(info.relative_path)
    return files


@pytest.mark.slow
def test_each_stage_writes_its_own_part_and_no_file_holds_the_whole_model(runs):
    root = runs["root"] / "straight"
    saved = list_checkpoints(root)
    assert [p.name for p in saved] == ["step-00000004.dcp", "step-00000008.dcp"]
    assert not list(root.glob("*.pt"))  # no single file
    assert sorted(p.name for p in saved[-1].iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "phalanx.pt"]
    small = torch.load(saved[-1] / "phalanx.pt", weights_only=True)
    assert "model" not in small and "optimizer" not in small and small["step"] == 8
    model = runs["straight"]["state"]["model"]
    assert small["meta"]["parameter_shapes"] == {k: list(v.shape) for k, v in model.items()}  # every stage's
    # The CNN's 4 blocks, 2 a stage: each rank wrote its own
    # blocks' tensors and their Adam moments, and nothing of the other stage's.
    where = stored_in(saved[-1])
    stage = {"0": "__0_0.distcp", "1": "__0_0.distcp", "2": "__1_0.distcp", "3": "__1_0.distcp"}
    for key in model:
        block = key.split(".")[0]
        assert where[f"model.{key}"] == {stage[block]}, key
        assert where[f"optimizer.state.{key}.exp_avg"] == {stage[block]}, key
    # Read whole, the optimizer state is a plain Adam's over the unsplit model: parameter i is model key i.
    state = runs["straight"]["state"]["optimizer"]
    assert state["param_groups"][0]["params"] == list(range(len(model))) == sorted(state["state"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy,workers", [(Pipeline(chunks=2, balance=(3, 1)), 2),
                                              (Pipeline(chunks=3, stages=3), 3), ("sync", 2), ("fsdp", 2)],
                         ids=["pipeline-3,1", "pipeline-3-stages", "sync", "fsdp"])
def test_a_resumed_run_ends_where_the_uninterrupted_one_ends(runs, tmp_path, strategy, workers):
    import shutil

    # A copy of the first half for each resume (a resume writes into its directory); --keep-global-batch:
    # sync's and fsdp's 2 workers read the same global batches (12 examples) as the one pipeline did.
    shutil.copytree(runs["root"] / "half", tmp_path / "half")
    resumed = _train(tmp_path, "half", resume=str(tmp_path / "half"), strategy=strategy, workers=workers,
                     keep_global_batch=True)
    label = f"pipeline(2) -> {strategy}({workers})"
    assert_same(resumed["state"], runs["straight"]["state"], label)
    kind = ".pt" if strategy == "sync" else ".dcp"  # (fsdp, and a pipeline, write shards again)
    assert latest_checkpoint(tmp_path / "half").name == f"step-00000008{kind}"


@pytest.mark.slow
def test_async_checkpoint_ends_with_the_same_parameters_and_its_saves_verify(runs, tmp_path):
    background = _train(tmp_path, "async", async_checkpoint=True)
    for key, value in runs["straight"]["state"]["model"].items():
        assert torch.equal(background["state"]["model"][key], value), key  # a background save changes nothing
    assert_same(background["state"], runs["straight"]["state"], "--async-checkpoint")
    assert [load_checkpoint(p)["step"] for p in list_checkpoints(tmp_path / "async")] == [4, 8]  # every shard verifies


def test_phalanx_evaluate_reads_it_and_prints_the_numbers_the_run_printed(runs, tmp_path):
    checkpoint = runs["root"] / "straight" / "step-00000008.dcp"
    out = run_in_process("evaluate", "--checkpoint", str(checkpoint), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout.splitlines()[-1])
    assert printed["step"] == 8 and printed["metrics"] == pytest.approx(runs["straight"]["summary"]["test_metrics"])


# --------------------------------------------------------------------------- traced, tied: the GPT example

VOCAB = 105  #: the bytes the corpus of examples/gpt.py uses


def _gpt_run(root, name: str, steps: int, **overrides) -> dict:
    (x, y), (xt, yt) = gpt.load(16)
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=16))
    settings = dict(strategy=Pipeline(chunks=2), workers=2, devices="cpu", steps=steps, batch_size=8,
                    clip_grad_norm=1.0, checkpoint_dir=str(root / name), checkpoint_every=2, progress="none",
                    log_every=100)
    cfg = TrainConfig(**{**settings, **overrides})
    Trainer(cfg, model=copy.deepcopy(model), train_data=(x[:64], y[:64]), test_data=(xt[:16], yt[:16]),
            training_step=gpt.step, optimizer=gpt.optimizer, lr_scheduler=gpt.schedule).fit()
    return tensors(load_checkpoint(latest_checkpoint(root / name)))


@pytest.mark.slow
def test_the_traced_gpt_with_tied_weights_saves_them_once_and_resumes_exactly(tmp_path):
    straight = _gpt_run(tmp_path, "straight", 4)
    half = str(tmp_path / "straight" / "step-00000002.dcp")  # (its checkpoint halfway, resumed in new directories)
    resumed = _gpt_run(tmp_path, "resumed", 4, resume=half)
    assert_same(resumed, straight, "gpt pipeline(2) resumed")
    # fsdp fills the tied weight's second key from its first (2 workers of 4 windows: the same global batch).
    in_fsdp = _gpt_run(tmp_path, "fsdp", 4, resume=half, strategy="fsdp", keep_global_batch=True)
    assert_same(in_fsdp, straight, "gpt pipeline(2) -> fsdp(2)")
    # The tied embedding is on both stages, and in the checkpoint once: one file holds it, under its first key
    # (lm_head.weight, its second, is given back on reading), and one of each of its moments.
    where = stored_in(latest_checkpoint(tmp_path / "straight"))
    assert len(where["model.transformer.wte.weight"]) == 1 and "model.lm_head.weight" not in where
    assert len(where["optimizer.state.transformer.wte.weight.exp_avg"]) == 1
    assert torch.equal(straight["model"]["lm_head.weight"], straight["model"]["transformer.wte.weight"])
    assert len(straight["optimizer"]["param_groups"]) == 2  # the model's own groups (decayed, not)


@pytest.mark.slow
def test_replicas_write_one_copy_between_them(tmp_path):
    """1 stage x 2 replicas: both ranks hold every tensor alike; DCP writes each once (one rank's copy)."""
    state = _train(tmp_path, "replicas", strategy=Pipeline(chunks=2, stages=1), steps=2, checkpoint_every=2)["state"]
    checkpoint = latest_checkpoint(tmp_path / "replicas")
    assert all(len(files) == 1 for files in stored_in(checkpoint).values())
    whole_bytes = 3 * sum(v.numel() * v.element_size() for v in state["model"].values())  # weights, 2 moments
    written = sum((checkpoint / f).stat().st_size for f in ("__0_0.distcp", "__1_0.distcp"))
    assert whole_bytes <= written < 1.2 * whole_bytes, (written, whole_bytes)


def test_a_stage_optimizer_with_other_param_groups_than_the_checkpoints_is_refused_in_one_line():
    """Pure: a stage maps the saved groups onto its own by position; another count cannot be mapped."""
    from phalanx.errors import PhalanxError
    from phalanx.strategies.pipeline.state import from_names

    net = torch.nn.Linear(2, 2)
    saved = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["weight"]}, {"lr": 0.1, "params": ["bias"]}]}
    with pytest.raises(PhalanxError) as e:
        from_names(saved, ["weight", "bias"], torch.optim.SGD(net.parameters(), lr=0.1))
    assert str(e.value) == ("the checkpoint's optimizer has 2 param groups and this run's 1; resume with the "
                            "optimizer the checkpoint was trained with")
    two = torch.optim.SGD([{"params": [net.weight]}, {"params": [net.bias]}], lr=0.1)
    assert from_names(saved, ["weight", "bias"], two)["param_groups"][1]["params"] == [1]  # numbered on
