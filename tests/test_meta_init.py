"""fsdp's ``--init-device meta`` (issue 32, item 5): every worker builds the model on the meta device and
materialises it one shard unit at a time, from one seed in one order, so every rank's shard is a slice of one
reference model (the one a single process materialises the same way) and no rank ever holds the whole model.

Where the eager constructor draws its numbers as the modules' own ``reset_parameters`` do, in the same order
(an ``nn.Sequential`` of layers), the materialised model equals the eagerly built one exactly; the GPT example's
constructor re-initialises after building (GPT-2's ``apply(_init_weights)``), so it is compared with its own
materialisation in one process instead, after k steps of AdamW with clipping, in float64."""

import sys

import pytest
import torch
from torch import nn

from helpers import REPO, run_cli, run_in_process, run_workers
from phalanx import FSDP, PhalanxError
from phalanx.strategies import meta_init, runtime_for

sys.path.insert(0, str(REPO / "examples"))
import gpt  # noqa: E402  (the example, importable here and in the spawned workers)

K = 3
GPT = dict(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                         nn.Linear(8, 3))


def on_meta(factory, *args):
    with meta_init.building(True):
        return factory(*args)


# --------------------------------------------------------------------------- one process, no process group


def test_a_sequential_materialised_from_meta_equals_the_eagerly_built_model():
    torch.manual_seed(3)
    eager = mlp()
    torch.manual_seed(3)
    model = on_meta(mlp)
    assert meta_init.on_meta(model) and not any(p.is_meta for p in eager.parameters())
    made = meta_init.materialise(model, torch.device("cpu"))
    assert made == sum(p.numel() * 4 for p in eager.parameters())
    for (name, want), got in zip(eager.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name


def test_tied_weights_stay_one_tensor_and_the_example_init_draws_gpt2s_distributions():
    torch.manual_seed(0)
    model = on_meta(gpt.GPT, gpt.GPTConfig(**GPT))
    meta_init.materialise(model, torch.device("cpu"), gpt.init_weights)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not any(t.isnan().any() for t in model.state_dict().values())
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.004  # N(0, 0.02), not kaiming
    assert model.transformer.h[0].attn.q.bias.abs().max() == 0
    assert model.transformer.h[1].mlp.c_proj.weight.std() < 0.02 / 1.5  # scaled by 1/sqrt(2 n_layer)


class Rotary(nn.Module):
    """A table the constructor computes (a buffer, not a parameter) and no reset_parameters."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(8.0))


class WithTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary, self.proj = Rotary(), nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x + self.rotary.table)


def recompute_table(module: nn.Module) -> None:
    if isinstance(module, Rotary):
        module.table.copy_(torch.arange(8.0))


def test_a_module_without_reset_parameters_is_refused_naming_it_and_the_fix():
    with pytest.raises(PhalanxError, match=r"'rotary' \(Rotary\) holds table and has no reset_parameters\(\).*"
                                           r"--init-weights MODULE:CALLABLE"):
        meta_init.check_initialisable(WithTable(), None)
    meta_init.check_initialisable(WithTable(), recompute_table)  # the user's function owns it


def test_a_buffer_no_initialisation_writes_is_named_not_trained_from_garbage():
    model = on_meta(WithTable)
    with pytest.raises(PhalanxError, match=r"'rotary.table' \(Rotary\) was not initialised \(still NaN"):
        meta_init.materialise(model, torch.device("cpu"), lambda module: None)
    model = on_meta(WithTable)
    meta_init.materialise(model, torch.device("cpu"), recompute_table)
    assert torch.equal(model.rotary.table, torch.arange(8.0))


def test_options_refuse_init_weights_without_meta_and_other_devices():
    with pytest.raises(PhalanxError, match="--init-weights initialises a model built on the meta device"):
        FSDP(init_weights="gpt:init_weights")
    with pytest.raises(PhalanxError, match="--init-device cuda: only 'meta' is known"):
        FSDP(init_device="cuda")
    assert FSDP(init_device="meta").builds_on_meta() and not FSDP().builds_on_meta()


# --------------------------------------------------------------------------- 2 gloo workers


def batch(part: int, parts: int):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 32, (8, 8), generator=g), torch.randint(0, 32, (8, 8), generator=g)
    n = 8 // parts
    return x[part * n:(part + 1) * n], y[part * n:(part + 1) * n]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def train_gpt(ctx, options, steps: int = K) -> dict:
    """k steps of the GPT example built on meta (float64), this rank on its share of a fixed batch of 8."""
    torch.set_default_dtype(torch.float64)
    try:  # (one worker runs in the test's own process: its default dtype is put back)
        return _train_gpt(ctx, options, steps)
    finally:
        torch.set_default_dtype(torch.float32)


def _train_gpt(ctx, options, steps: int) -> dict:
    torch.manual_seed(0)
    model = on_meta(gpt.GPT, gpt.GPTConfig(**GPT))
    runtime = runtime_for(options, ctx, model, adamw, clip_grad_norm=0.5, training_step=gpt.step,
                          example=batch(0, 1))
    start = initial(ctx, runtime.model)
    for _ in range(steps):
        runtime.train_step(batch(ctx.rank, ctx.world_size))
    end = runtime.state_dict()
    return None if end is None else {"start": start, "end": end["model"], "notes": runtime.notes}


def initial(ctx, model) -> dict:
    """The whole model's weights as they are (the runtime's state_dict would first step the optimizer to build its
    state, as torch's get_state_dict does)."""
    if not ctx.distributed:
        return {name: t.clone() for name, t in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def initial_sequential(ctx) -> dict:
    torch.manual_seed(3)
    runtime = runtime_for(FSDP(init_device="meta"), ctx, on_meta(mlp), adamw)
    return initial(ctx, runtime.model)


@pytest.fixture(scope="module")
def meta_runs():
    options = FSDP(init_device="meta", init_weights=gpt.init_weights)
    return run_workers(train_gpt, 1, options), run_workers(train_gpt, 2, options)


@pytest.mark.slow
def test_two_ranks_shards_are_slices_of_the_one_process_materialisation_and_train_as_it_does(meta_runs):
    one, two = meta_runs
    assert any("built on the meta device; materialised block by block" in line for line in two["notes"])
    for name, want in one["start"].items():
        assert torch.equal(two["start"][name], want), name  # the same numbers, not just the same distribution
    moved = max((one["end"][k] - one["start"][k]).abs().max().item() for k in one["end"])
    assert moved > 1e-3  # the comparison below is between trained weights
    for name, want in one["end"].items():
        torch.testing.assert_close(two["end"][name], want, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.slow
def test_on_two_ranks_a_sequential_built_on_meta_starts_as_the_eagerly_built_model():
    torch.manual_seed(3)
    eager = mlp().state_dict()
    got = run_workers(initial_sequential, 2)
    for name, want in eager.items():
        assert torch.equal(got[name], want), name


def whole_tensors_alive(ctx) -> tuple:
    """(tensors materialised whole, how many still alive once the runtime is built) on this rank."""
    import gc
    import weakref

    made, allocate = [], meta_init._allocate

    def watched(tensor, device):
        whole = allocate(tensor, device)
        made.append(weakref.ref(whole))
        return whole

    meta_init._allocate = watched  # (this worker's module only)
    torch.manual_seed(0)
    model = on_meta(gpt.GPT, gpt.GPTConfig(**GPT))
    runtime = runtime_for(FSDP(init_device="meta", init_weights=gpt.init_weights), ctx, model, adamw)
    gc.collect()
    return len(made), sum(ref() is not None for ref in made), runtime.module is not None


@pytest.mark.slow
def test_no_whole_tensor_outlives_its_unit_once_sharded():
    made, alive, _ = run_workers(whole_tensors_alive, 2)
    assert made == len(on_meta(gpt.GPT, gpt.GPTConfig(**GPT)).state_dict()) - 1  # (lm_head's is wte's)
    assert alive == 0  # each rank keeps only its slices: a memo across units once kept them all


def test_a_model_object_given_to_the_api_is_refused_with_meta_init_it_is_copied_not_built(tmp_path):
    from phalanx import TrainConfig, Trainer

    config = TrainConfig(strategy=FSDP(init_device="meta"), workers=2, devices="cpu", batch_size=4,
                         checkpoint_dir=str(tmp_path / "c"))
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with pytest.raises(PhalanxError, match=r"--init-device meta: the model's factory made '0.0.weight' with storage "
                                           r".*a model object given to the API is copied, not built"):
        Trainer(config, model=mlp(), train_data=(x, y)).fit()
    assert not (tmp_path / "c").exists()


# --------------------------------------------------------------------------- the installed command

GPT_FLAGS = ("--model", "gpt:make", "--data", "gpt:load", "--training-step", "gpt:step", "--optimizer",
             "gpt:optimizer", "--clip-grad-norm", "1.0", "--batch-size", "4", "--devices", "cpu", "--eval-every", "0")


@pytest.mark.slow
def test_cli_trains_the_gpt_example_built_on_meta_with_its_own_init(tmp_path):
    # With --activation-checkpointing too: its measuring forward ran on the meta model and failed ("Tensor on
    # device meta is not on the expected device cpu"); it now says it measured nothing, and why.
    out = run_cli("train", *GPT_FLAGS, "--strategy", "fsdp", "--init-device", "meta", "--init-weights",
                  "gpt:init_weights", "--activation-checkpointing", "--workers", "2", "--steps", "3",
                  "--checkpoint-dir", str(tmp_path / "c"), cwd=REPO / "examples")
    assert out.returncode == 0, out.stderr
    assert "strategy fsdp (fully_shard, built on meta)" in out.stdout
    assert "built on the meta device; materialised block by block on cpu" in out.stdout
    assert "(what it saves not measured: the model is built on the meta device)" in out.stdout
    assert "test perplexity" in out.stdout


@pytest.mark.parametrize("flags, message", [
    (("--strategy", "sync", "--init-device", "meta"), "--init-device is an option of fsdp; --strategy sync does not"),
    (("--strategy", "fsdp", "--init-weights", "gpt:init_weights"), "--init-weights initialises a model built on"),
    (("--strategy", "fsdp", "--init-device", "meta", "--init-from", "nowhere.pt"),
     "--init-from .* loads the whole model into every worker, and --init-device meta builds none"),
])
def test_what_meta_init_cannot_do_is_one_line_before_any_worker_starts(tmp_path, flags, message):
    out = run_in_process("train", *GPT_FLAGS, *flags, "--workers", "2", "--steps", "1", "--checkpoint-dir",
                         str(tmp_path / "c"), cwd=REPO / "examples")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert __import__("re").search(message, lines[0]), lines[0]
