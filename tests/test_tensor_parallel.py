"""fsdp's ``--tensor-parallel N`` (issue 32, item 6): each block's attention and MLP Linear layers split column-
then row-wise over N ranks by DTensor's ``parallelize_module``, on the "tp" dim of a (W/N, N) mesh whose "shard"
dim fsdp shards over. The plan is found by structure in the parent and refused in one line where it cannot hold;
the GPT example trained k steps this way equals one process on the whole batch (what sync computes), pure (2 ranks)
and 2-D (2 x 2), in float64 with AdamW and gradient clipping."""

import copy
import re
import sys

import pytest
import torch
from torch import nn

from helpers import REPO, run_cli, run_in_process, run_workers
from test_meta_init import adamw, batch  # the same 8 windows split over the ranks, the same AdamW
from phalanx import FSDP, PhalanxError, Sync
from phalanx.strategies import Job, runtime_for
from phalanx.strategies.fsdp import tensor_parallel
from phalanx.strategies.fsdp import shard_units

sys.path.insert(0, str(REPO / "examples"))
import gpt  # noqa: E402  (the example, importable here and in the spawned workers)

K = 3
GPT = dict(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)
CPU4 = (torch.device("cpu"),) * 4


def small(**changes) -> gpt.GPT:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(**{**GPT, **changes}))


# --------------------------------------------------------------------------- the plan, in the parent


def test_the_gpt_examples_blocks_split_q_k_v_and_the_first_mlp_layer_by_columns_the_projections_by_rows():
    plan = tensor_parallel.model_plan(small(), shard_units(small()), 2)
    assert list(plan) == ["transformer.h.0", "transformer.h.1"]
    assert plan["transformer.h.0"] == {"attn.q": "column-wise", "attn.k": "column-wise", "attn.v": "column-wise",
                                       "attn.c_proj": "row-wise", "mlp.c_fc": "column-wise",
                                       "mlp.c_proj": "row-wise"}
    assert tensor_parallel.describe(plan).startswith("each of 2 blocks: attn.q column-wise")


def test_the_layout_groups_n_ranks_on_one_data_shard():
    layout = FSDP(tensor_parallel=2).layout(Job(CPU4, 4, model=small()))
    assert layout.shards == 2 and [r.shard for r in layout.ranks] == [0, 0, 1, 1]
    assert [r.evaluates for r in layout.ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]


class FusedAttention(nn.Module):
    """nanoGPT's attention: q, k, v from one Linear, split in forward (a column split would mix them)."""

    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = nn.Linear(8, 24), nn.Linear(8, 8), 2


class FusedGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList([nn.ModuleDict({"attn": FusedAttention()}) for _ in range(2)])


@pytest.mark.parametrize("model, n, workers, message", [
    (lambda: small(), 3, 4, "--tensor-parallel 3 does not divide 4 workers"),
    (lambda: small(n_embd=12, n_head=3), 2, 2, r"'transformer.h.0.attn' has 3 heads, which do not split between 2"),
    (lambda: small(n_embd=10, n_head=2), 4, 4, r"'transformer.h.0.attn' has 2 heads, which do not split between 4"),
    (FusedGPT, 2, 2,
     r"'h.0.attn' computes q, k, v in one projection \(attn.c_attn 8->24\) split in forward by a width"),
])
def test_a_plan_that_cannot_hold_is_one_line_naming_the_layer(model, n, workers, message):
    with pytest.raises(PhalanxError, match=message):
        FSDP(tensor_parallel=n).layout(Job(CPU4[:workers], 4, model=model()))


# --------------------------------------------------------------------------- gloo workers against one process


def train(ctx, options, groups: int) -> dict:
    """k steps of the GPT example in float64; data group ``rank // (W / groups)`` reads its share of 8 windows."""
    torch.set_default_dtype(torch.float64)
    try:  # (one worker runs in the test's own process: its default dtype is put back)
        runtime = runtime_for(options, ctx, small(), adamw, clip_grad_norm=0.5, training_step=gpt.step,
                              example=batch(0, 1))
        for _ in range(K):
            runtime.train_step(batch(ctx.rank // (ctx.world_size // groups), groups))
        state = runtime.state_dict()
        return None if state is None else {"model": state["model"], "notes": runtime.notes,
                                           "report": runtime.report().fields}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.fixture(scope="module")
def reference():
    return run_workers(train, 1, Sync(), 1)["model"]


def assert_same(got: dict, want: dict, start: dict) -> None:
    assert max((want[k] - start[k].to(want[k].dtype)).abs().max().item() for k in want) > 1e-3  # trained weights
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-12, msg=name)


def test_pure_tensor_parallel_on_two_ranks_equals_one_process(reference):
    got = run_workers(train, 2, FSDP(tensor_parallel=2), 1)
    assert got["notes"][0].startswith("tensor parallel plan: mesh (1 shard x 2 tp)")
    assert got["report"] == {"sharded_blocks": [], "tensor_parallel": 2}  # no fsdp: N == W
    assert_same(got["model"], reference, small().state_dict())


@pytest.mark.slow
def test_two_d_fsdp_by_tensor_parallel_on_four_ranks_equals_one_process_on_the_whole_batch(reference):
    got = run_workers(train, 4, FSDP(tensor_parallel=2), 2)
    assert got["notes"][0].startswith("fsdp plan: 2 blocks") and "mesh (2 shard x 2 tp)" in got["notes"][1]
    assert_same(got["model"], reference, small().state_dict())


def built_on_meta(ctx, options) -> dict:
    """The GPT example built on meta, materialised (and split, and sharded) by fsdp; k steps; a checkpoint
    loaded back (every rank takes its slices of the full state) gives the same full state again."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = gpt.GPT(gpt.GPTConfig(**GPT))
        runtime = runtime_for(options, ctx, model, adamw, clip_grad_norm=0.5, training_step=gpt.step,
                              example=batch(0, 1))
        for _ in range(K):
            runtime.train_step(batch(0, 1))
        saved = runtime.state_dict()  # (one process: the live tensors, copied before they move)
        saved = None if saved is None else {"model": {k: v.clone() for k, v in saved["model"].items()},
                                            "optimizer": copy.deepcopy(saved["optimizer"])}
        runtime.train_step(batch(0, 1))  # moved away from the checkpoint, then back to it
        runtime.load_state_dict(rank0s(ctx, saved))
        again = runtime.state_dict()
        return None if saved is None else {"saved": saved["model"], "again": again["model"]}
    finally:
        torch.set_default_dtype(torch.float32)


def rank0s(ctx, state):
    """Rank 0's checkpoint on every rank (as every rank reads the file rank 0 wrote)."""
    import torch.distributed as dist

    box = [state]
    if ctx.distributed:
        dist.broadcast_object_list(box, src=0)
    return box[0]


@pytest.mark.slow
def test_tensor_parallel_on_a_model_built_on_meta_equals_its_one_process_materialisation_and_resumes():
    meta = dict(init_device="meta", init_weights=gpt.init_weights)
    one = run_workers(built_on_meta, 1, FSDP(**meta))
    two = run_workers(built_on_meta, 2, FSDP(tensor_parallel=2, **meta))
    for name, want in one["saved"].items():
        torch.testing.assert_close(two["saved"][name], want, rtol=1e-9, atol=1e-12, msg=name)
        assert torch.equal(two["again"][name], two["saved"][name]), name


# --------------------------------------------------------------------------- the installed command

GPT_FLAGS = ("--model", "gpt:make", "--data", "gpt:load", "--training-step", "gpt:step", "--optimizer",
             "gpt:optimizer", "--clip-grad-norm", "1.0", "--batch-size", "4", "--devices", "cpu", "--steps", "4",
             "--eval-every", "0")


@pytest.mark.slow
def test_cli_tensor_parallel_prints_its_plan_and_ends_where_one_sync_worker_ends(tmp_path):
    tp = run_cli("train", *GPT_FLAGS, "--strategy", "fsdp", "--tensor-parallel", "2", "--workers", "2",
                 "--checkpoint-dir", str(tmp_path / "tp"), cwd=REPO / "examples")
    assert tp.returncode == 0, tp.stderr
    assert "tensor parallel plan: mesh (1 shard x 2 tp), every 2 ranks split one replica" in tp.stdout
    one = run_in_process("train", *GPT_FLAGS, "--strategy", "sync", "--workers", "1", "--checkpoint-dir",
                         str(tmp_path / "one"), cwd=REPO / "examples")
    assert one.returncode == 0, one.stderr
    loss = [float(re.search(r"test perplexity .* loss (\d+\.\d+)", out.stdout).group(1)) for out in (tp, one)]
    assert loss[0] == pytest.approx(loss[1], abs=2e-4)  # (float32; the tp ranks evaluate one part, counted once)


def test_estimate_and_compare_refuse_tensor_parallel_in_one_line(tmp_path):
    for command in (("estimate", "--strategy", "fsdp"), ("compare", "--strategies", "sync,fsdp"),
                    ("compare", "--simulate", "--strategies", "sync,fsdp")):
        out = run_in_process(*command, "--tensor-parallel", "2", cwd=tmp_path)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "--tensor-parallel is fsdp's option in phalanx train" in lines[0], out.stderr
