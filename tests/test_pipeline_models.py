"""Pipelines of models as written (issue 32, item 1): the training step traced by torch.export and split at
named points or between repeated blocks, tied weights kept on every stage that uses them.

Each model is pipelined on 2 gloo workers (2 stages) for K steps and compared with one process on the same
global batches (test tier 3 of docs/architecture.md): parameters, buffers and losses. The GPT example keeps its tied
embedding and output layer (AdamW in its own decay groups, clipped to 1.0): float64, so only the order of a
sum differs. The torchvision-style ResNet is written as torchvision writes it (a class with conv1, bn1,
ReLU(inplace=True), layer1.., avgpool, fc and ``torch.flatten`` in its forward); BatchNorm normalises each
micro-batch by its own statistics, so its reference runs the same micro-batches in the same order. Hugging
Face's GPT2LMHeadModel is called as its authors call it (``model(**batch)``, its own loss on ``labels``).
"""

import json
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import REPO, gather, run_cli, run_in_process, run_workers
from test_pipeline_bn import BasicBlock  # torchvision's, as written there (in-place ReLUs, out += identity)
from phalanx.errors import PhalanxError
from phalanx.task.metrics import add_up
from phalanx.strategies.pipeline.trace import candidate_points, check_points, segment_params
from phalanx.task.step import DefaultStep, UserStep
from phalanx.task import call_optimizer_factory
from phalanx.strategies import Pipeline, runtime_for
from phalanx.strategies.base import COUNT_CORRECT
from phalanx.strategies.layout import Job
from phalanx.checkpoint import latest_checkpoint, load_checkpoint, tensors

sys.path.insert(0, str(REPO / "examples"))
import gpt  # noqa: E402  (the example, importable here and in the spawned workers)

K = 3  #: steps compared
CHUNKS = 2
VOCAB = 40


# --------------------------------------------------------------------------- the models, as their authors write them


def small_gpt() -> gpt.GPT:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=16)).double()


def gpt_batches(n: int = K) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (8, 16), generator=g), torch.randint(0, VOCAB, (8, 16), generator=g))
            for _ in range(n)]


class ResNet(nn.Module):
    """torchvision's ResNet, as written there (no nn.Sequential around it, no pipeline_blocks()), narrow and
    with a 3x3 stem for 8x8 images."""

    def __init__(self, num_classes: int = 10, widths: tuple = (8, 16)):
        super().__init__()
        self.conv1 = nn.Conv2d(1, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(widths[0], widths[0]), BasicBlock(widths[0], widths[0]))
        self.layer2 = nn.Sequential(BasicBlock(widths[0], widths[1], 2), BasicBlock(widths[1], widths[1]))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(input_shape: tuple = (1, 8, 8), num_classes: int = 10) -> ResNet:
    torch.manual_seed(0)
    return ResNet(num_classes)


def image_batches(n: int = K) -> list:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 1, 8, 8, generator=g) * 2 + 1, torch.randint(0, 10, (8,), generator=g)) for _ in range(n)]


def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).double()


def token_dicts(n: int = K) -> list:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (8, 16), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


# --------------------------------------------------------------------------- where a model may be split (pure)


def test_default_points_are_the_repeated_blocks_and_a_wrong_name_is_one_line_listing_them():
    assert candidate_points(small_gpt()) == ["transformer.h.0", "transformer.h.1"]
    assert candidate_points(resnet()) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]
    with pytest.raises(PhalanxError,
                       match=r"^--split-points transformer\.h\.7: no such submodule in GPT; "
                             r"candidates \(its repeated blocks\): transformer\.h\.0, transformer\.h\.1$"):
        check_points(small_gpt(), ["transformer.h.1", "transformer.h.7"])
    model = resnet()
    counts = segment_params(model, candidate_points(model))
    assert sum(counts) == sum(p.numel() for p in model.parameters()) and len(counts) == 5
    assert counts[0] == sum(p.numel() for m in (model.conv1, model.bn1) for p in m.parameters())


class Branchy(nn.Module):
    """A forward whose path depends on the data: torch.export cannot follow it."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if x.sum() > 0 else -block(x)
        return x


def test_a_model_torch_export_cannot_follow_is_one_line_naming_the_way_out():
    from phalanx.strategies.pipeline.trace import Traced

    batch, model = (torch.randn(4, 4), torch.randint(0, 4, (4,))), Branchy()
    with pytest.raises(PhalanxError, match=r"^--strategy pipeline cannot trace Branchy with torch.export \(\w+: .*\); "
                                           r"make it an nn.Sequential of blocks or give it a pipeline_blocks\(\) "
                                           r"method, and phalanx cuts it at its blocks instead$") as info:
        Traced(model, DefaultStep(F.cross_entropy), batch, ("blocks.1",), 2)
    assert "\n" not in str(info.value)
    # given back as it was
    assert "forward" not in vars(model.blocks[1]) and "_orig_forward" not in vars(model.blocks[1])


def test_bad_split_points_are_refused_by_the_layout_before_any_worker_starts():
    job = Job(("cpu",) * 2, 8, 1, processes=2, model=small_gpt())
    with pytest.raises(PhalanxError, match="no such submodule in GPT"):
        Pipeline(split_points=("transformer.h.9",)).layout(job)
    with pytest.raises(PhalanxError, match=r"makes 3 stages but the pipeline has 2"):
        Pipeline(split_points=("transformer.h.0", "transformer.h.1")).layout(job)
    with pytest.raises(PhalanxError, match="4 stages but GPT has only 2 repeated blocks to begin a stage at"):
        Pipeline(stages=4).layout(Job(("cpu",) * 4, 8, 1, processes=4, model=small_gpt()))


# --------------------------------------------------------------------------- 2 stages == one process


def _pipeline_run(ctx, make, data, step, optimizer, clip, reload: bool = False, chunks_: int = CHUNKS,
                  **options) -> dict:
    def build():
        return runtime_for(Pipeline(chunks=chunks_, **options), ctx, make(), optimizer, example=data[0],
                           training_step=step, clip_grad_norm=clip)

    runtime = build()
    losses = [float(runtime.global_losses(runtime.train_step(batch))) for batch in data]
    counted = runtime.evaluate(data[:2])
    out = {"losses": losses, "state": runtime.state_dict(), "eval": gather(ctx, counted), "notes": runtime.notes}
    if reload:  # the checkpoint, loaded by every stage of a fresh pipeline, gathers back to itself
        import torch.distributed as dist

        shared = [out["state"]]
        dist.broadcast_object_list(shared, src=0)
        fresh = build()
        fresh.load_state_dict(shared[0])
        out["reloaded"] = fresh.state_dict()
    return out


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _workers(ctx) -> dict:
    return {
        "gpt": _pipeline_run(ctx, small_gpt, gpt_batches(), gpt.step, gpt.optimizer, 1.0, reload=True),
        "gpt-explicit": _pipeline_run(ctx, small_gpt, gpt_batches(), gpt.step, gpt.optimizer, 1.0,
                                      split_points=("transformer.h.0",)),
        "resnet": _pipeline_run(ctx, resnet, image_batches(), None, _sgd, None, balance="time"),
        "resnet-params": _pipeline_run(ctx, resnet, image_batches(), None, _sgd, None, balance="params",
                                       schedule="1f1b"),
        "hf-gpt2": _pipeline_run(ctx, hf_gpt2, token_dicts(), None, _sgd, None),
    }


@pytest.fixture(scope="module")
def pipelined() -> dict:
    return run_workers(_workers, 2)


def reference(model: nn.Module, data: list, step, optimizer, clip, micro: int = 1) -> dict:
    """One process: each batch's micro-batches in order, each loss divided by their number (the engine's
    scaling), clipped and stepped once per batch."""
    opt = call_optimizer_factory(optimizer, model)  # (as phalanx calls it: params, or a model named model)
    losses = []
    for batch in data:
        parts = []
        for piece in _split(batch, micro):
            loss = step(model, piece).loss
            (loss / micro).backward()
            parts.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(sum(parts) / len(parts))
    counted = add_up(model, data[:2], torch.device("cpu"), COUNT_CORRECT, step)
    model.train()
    return {"losses": losses, "state": model.state_dict(), "eval": tuple(counted.tolist())}


def _split(batch, parts: int) -> list:
    from phalanx.data.batch import split

    return split(batch, parts)


def assert_same(got: dict, want: dict, rtol: float, atol: float, label: str) -> None:
    assert list(got["state"]["model"]) == list(want["state"]), label  # the unsplit model's keys, in order
    for name, value in want["state"].items():
        if value.is_floating_point():
            torch.testing.assert_close(got["state"]["model"][name], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{label} {name}: {m}")
        else:
            assert torch.equal(got["state"]["model"][name], value), f"{label} {name}"
    assert got["losses"] == pytest.approx(want["losses"], rel=max(rtol, 1e-6)), label  # (reported in float32)
    assert got["eval"] == [want["eval"]] * len(got["eval"]), label  # every rank hears the last stage's counts


@pytest.mark.slow
@pytest.mark.parametrize("run", ["gpt", "gpt-explicit"])
def test_the_gpt_example_with_tied_embeddings_kept_equals_one_process(pipelined, run):
    got = pipelined[run]
    want = reference(small_gpt(), gpt_batches(), UserStep(gpt.step), gpt.optimizer, 1.0)
    assert_same(got, want, 1e-9, 1e-12, run)
    state = got["state"]["model"]
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # one tensor's value, saved twice
    assert not torch.equal(state["lm_head.weight"], small_gpt().state_dict()["lm_head.weight"])  # it trained
    assert any("transformer.wte.weight on stages 0, 1" in line for line in got["notes"]), got["notes"]
    # The optimizer state is the unsplit model's: the tied matrix once, configure_optimizers' two groups.
    groups = got["state"]["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sorted(i for g in groups for i in g["params"]) == list(range(len(list(small_gpt().parameters()))))
    if run == "gpt":  # loaded into a fresh pipeline's stages (both copies of the tied matrix), saved again: the same
        again = got["reloaded"]
        assert all(torch.equal(again["model"][k], v) for k, v in state.items())
        before, after = got["state"]["optimizer"], again["optimizer"]
        assert before["param_groups"] == after["param_groups"] and before["state"].keys() == after["state"].keys()
        assert all(torch.equal(after["state"][i][k], v) for i, s in before["state"].items() for k, v in s.items()
                   if isinstance(v, torch.Tensor))


@pytest.mark.slow
@pytest.mark.parametrize("run", ["resnet", "resnet-params"])
def test_a_torchvision_style_resnet_with_batchnorm_and_inplace_relus_equals_one_process(pipelined, run):
    """Balanced by the time profiler (its pieces run on a copy: the model's statistics count no extra pass),
    and by parameter count under 1f1b."""
    want = reference(resnet(), image_batches(), DefaultStep(F.cross_entropy), _sgd, None, micro=CHUNKS)
    assert_same(pipelined[run], want, 1e-4, 1e-5, run)
    state = pipelined[run]["state"]["model"]
    assert int(state["bn1.num_batches_tracked"]) == K * CHUNKS  # every micro-batch counted once, no extra pass
    notes = pipelined[run]["notes"]
    if run == "resnet-params":
        assert "split at layer2.1 into 2 stages (by parameter count, among 4 repeated blocks)" in notes[0], notes
    else:
        assert "into 2 stages (by measured time, among 4 repeated blocks)" in notes[0], notes
        assert all(re.search(r"ms per micro-batch \(fwd\+bwd\)$", line) for line in notes[1:3]), notes
        assert notes[4].startswith("  measured in every worker at once: 1 torch thread each on cpu, 2 micro-batches "
                                   "of 4 per pass in gpipe order"), notes


@pytest.mark.slow
def test_hugging_face_gpt2_as_its_authors_call_it_equals_one_process(pipelined):
    want = reference(hf_gpt2(), token_dicts(), DefaultStep(F.cross_entropy), _sgd, None)
    assert_same(pipelined["hf-gpt2"], want, 1e-9, 1e-12, "hf-gpt2")
    state = pipelined["hf-gpt2"]["state"]["model"]
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


def _three_stages(ctx) -> dict:
    return _pipeline_run(ctx, small_gpt, gpt_batches(), gpt.step, gpt.optimizer, 1.0, schedule="1f1b", chunks_=4,
                         split_points=("transformer.h.0", "transformer.h.1"))


@pytest.mark.slow
def test_three_stages_the_tied_matrix_on_the_first_and_last_and_the_targets_skipping_the_middle(tmp_path):
    """Stage 0 the embeddings, stage 1 a block, stage 2 a block and the head: the tied matrix's gradients are
    summed over a group of ranks 0 and 2 only, the targets go from stage 0 straight to stage 2."""
    got = run_workers(_three_stages, 3)
    want = reference(small_gpt(), gpt_batches(), UserStep(gpt.step), gpt.optimizer, 1.0)
    assert_same(got, want, 1e-9, 1e-12, "3 stages")
    assert any("transformer.wte.weight on stages 0, 2" in line for line in got["notes"]), got["notes"]


# --------------------------------------------------------------------------- through the CLI

GPT_CLI = ("--model", "gpt:make", "--data", "gpt:load", "--training-step", "gpt:step", "--optimizer", "gpt:optimizer",
           "--lr-scheduler", "gpt:schedule", "--clip-grad-norm", "1.0", "--devices", "cpu", "--workers", "2",
           "--log-every", "5", "--progress", "none", "--checkpoint-every", "0")


def test_bad_split_points_through_the_cli_are_one_line_and_exit_2(tmp_path):
    out = run_in_process("train", *GPT_CLI, "--strategy", "pipeline", "--split-points", "transformer.h.5",
                         "--steps", "2", "--batch-size", "8", "--checkpoint-dir", str(tmp_path), cwd=REPO / "examples")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: --split-points transformer.h.5: no such submodule in GPT; candidates (its repeated blocks): "
        "transformer.h.0, transformer.h.1"]


@pytest.mark.slow
def test_the_gpt_example_under_pipeline_ends_with_syncs_parameters_and_evaluate_finds_the_printed_numbers(tmp_path):
    """The issue's measure: 2 stages, tied embeddings kept, 20 steps of the example's own recipe (AdamW groups,
    warmup, clipping) through the installed CLI; sync on 2 workers of 16 reads the same global batches of 32."""
    steps = ("--steps", "20")
    pipe = run_cli("train", *GPT_CLI, *steps, "--strategy", "pipeline", "--batch-size", "32", "--progress", "lines",
                   "--checkpoint-dir", str(tmp_path / "pipe"), cwd=REPO / "examples")
    assert pipe.returncode == 0, pipe.stderr
    assert "tied across stages (each keeps a copy, their gradients summed before the step): transformer.wte.weight " \
           "on stages 0, 1" in pipe.stdout
    sync = run_in_process("train", *GPT_CLI, *steps, "--strategy", "sync", "--batch-size", "16", "--checkpoint-dir",
                          str(tmp_path / "sync"), cwd=REPO / "examples")
    assert sync.returncode == 0, sync.stderr
    got, want = (tensors(load_checkpoint(latest_checkpoint(tmp_path / run))) for run in ("pipe", "sync"))
    assert list(got["model"]) == list(want["model"])
    for name, value in want["model"].items():
        torch.testing.assert_close(got["model"][name], value, rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert torch.equal(got["model"]["lm_head.weight"], got["model"]["transformer.wte.weight"])
    printed = summary_of(tmp_path / "pipe")["test_metrics"]
    out = run_in_process("evaluate", "--checkpoint", str(tmp_path / "pipe"), "--json", cwd=REPO / "examples")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["metrics"] == pytest.approx(printed, rel=1e-6)


def summary_of(run_dir) -> dict:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(e for e in events if e["event"] == "summary")


# --------------------------------------------------------------------------- estimate and compare

PRICED = ("--model", "test_pipeline_models:resnet", "--workers", "2", "--link-bandwidth", "10GB/s", "--link-latency",
          "10us")


@pytest.mark.parametrize("flags,message", [
    (["--split-points", "layer2.0"], "error: --split-points layer2.0: estimate prices a pipeline by the model's blocks "
     "(an nn.Sequential or pipeline_blocks()), and a model split by tracing is not priced yet; leave --split-points "
     "out, or run phalanx compare (real runs)"),
    (["--stages", "2"], "error: --stages 2: estimate prices a pipeline by the model's blocks (an nn.Sequential or "
     "pipeline_blocks()), and this model has none of its own (training splits it by tracing, which estimate does not "
     "price yet); run phalanx compare (real runs)"),
], ids=["split points", "no blocks"])
def test_estimate_refuses_a_pipeline_split_by_tracing_in_one_line(tmp_path, flags, message):
    out = run_in_process("estimate", *PRICED, "--strategy", "pipeline", *flags, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [message]


def test_compare_and_its_simulation_refuse_split_points_in_one_line(tmp_path):
    """compare runs each strategy with its defaults (a traced model split between its repeated blocks); it has
    no flag for split points, and --simulate has no simulated rule for a pipeline at all."""
    for simulate in ([], ["--simulate"]):
        out = run_in_process("compare", "--model", "test_pipeline_models:resnet", "--strategies", "sync,pipeline",
                             "--split-points", "layer2.0", *simulate, cwd=tmp_path)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "--split-points" in out.stderr
    out = run_in_process("compare", "--model", "test_pipeline_models:resnet", "--strategies", "sync,pipeline",
                         "--simulate", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[0].startswith(
        "error: pipeline has no simulated rule yet"), out.stderr
