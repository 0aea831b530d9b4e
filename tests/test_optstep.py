"""The optimization step as the user's recipe has it: clipping, an LR scheduler of theirs, an optimizer
factory that takes the model; model builders in the ecosystem's conventions; import errors in one line.

- ``--clip-grad-norm`` against one process that clips the same way (torch's ``clip_grad_norm_`` on the
  whole batch's gradient): sync and fsdp on 2 workers, a 2-stage pipeline (the norm over both stages),
  parameters after K steps with SGD and momentum, in float64; every step's norm is above the bound, so
  the comparison fails if a strategy clipped a part of the gradient, or did not clip; local-sgd against
  each worker clipping its own gradient; fp16's scaler unscaling before the clip;
- ``--lr-scheduler`` through the installed command: the learning rate logged at every step is the one the
  scheduler gives that step, under sync and under ps (whose server steps the optimizer W times a step), and
  a resumed run with a chainable scheduler (StepLR, which reads the optimizer's lr) ends where an
  uninterrupted one does;
- ``--optimizer`` of a factory whose first parameter is ``model``: parameter groups by name, under sync and
  fsdp; the norm before clipping is in the metrics file;
- a torchvision-style builder (``**kwargs`` only), one that names ``input_shape``; a module raising on
  import, a lazy module raising on attribute access, a module importing a missing package: one line each.
"""

import json
import os
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import run_cli, run_in_process, run_main, run_workers
from phalanx import FSDP, LocalSGD, Pipeline, Sync, TrainConfig, Trainer
from phalanx.errors import PhalanxError
from phalanx.launcher import WorkerContext
from phalanx.task.models import cnn
from phalanx.strategies import runtime_for
from phalanx.task import call_model_factory, call_optimizer_factory
from phalanx.checkpoint import latest_checkpoint, load_checkpoint, tensors

K, BATCH, MAX_NORM = 4, 12, 0.05  # the cnn's gradient norm on this data is 0.3-1.5: every step is clipped


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return cnn((1, 8, 8), 10).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 1, 8, 8, generator=g).double(), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(K)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference() -> tuple[dict, list[float]]:
    """One process on the whole batch, clipping as torch's own loop does; its parameters and norms."""
    model = make_model()
    optimizer = sgd(model.parameters())
    norms = []
    for x, y in batches():
        F.cross_entropy(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict(), norms


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def reference_local(workers: int = 2) -> dict:
    """Local SGD averaging every step with plain SGD, each worker clipping its own gradient: every step moves
    the parameters by -lr times the mean of the workers' clipped gradients."""
    model = make_model()
    for x, y in batches():
        clipped = []
        for xw, yw in zip(x.chunk(workers), y.chunk(workers)):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(xw), yw).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            clipped.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p, *grads in zip(model.parameters(), *clipped):
                p -= 0.1 * sum(grads) / workers
    return {k: v for k, v in model.state_dict().items() if k in dict(model.named_parameters())}


def clipped_runs(ctx: WorkerContext) -> dict:
    """Every strategy's parameters after K clipped steps (rank 0's full state) and its last norm."""
    out = {}
    for name, options in (("sync", Sync()), ("fsdp", FSDP()), ("pipeline", Pipeline(chunks=2, balance="params")),
                          ("local-sgd", LocalSGD(sync_every=1))):
        whole = isinstance(options, Pipeline)  # every stage reads the whole batch; replicas their part
        n = BATCH // ctx.world_size

        def part(t, whole=whole):
            return t if whole else t[ctx.rank * n:(ctx.rank + 1) * n]

        optimizer = plain_sgd if isinstance(options, LocalSGD) else sgd
        runtime = runtime_for(options, ctx, make_model(), optimizer, F.cross_entropy,
                              example=tuple(part(t) for t in batches()[0]), clip_grad_norm=MAX_NORM)
        for x, y in batches():
            runtime.train_step(part(x), part(y))
        state = runtime.state_dict()
        out[name] = (state["model"] if state else None, float(runtime.grad_norm))
    return out


@pytest.fixture(scope="module")
def clipped():
    return run_workers(clipped_runs, 2)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sync", "fsdp", "pipeline"])
def test_clipping_under_each_strategy_is_the_single_process_clip_of_the_whole_gradient(clipped, strategy):
    want, norms = reference()
    assert min(norms) > 2 * MAX_NORM  # every step was clipped: the test fails if a strategy does not clip
    got, last_norm = clipped[strategy]
    assert last_norm == pytest.approx(norms[-1], rel=1e-9)  # the whole gradient's norm, not one rank's part
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=1e-9, atol=1e-10, msg=lambda m: f"{strategy} {name}: {m}")


def test_local_sgd_clips_each_workers_own_inner_step(clipped):
    want = reference_local()
    got, _ = clipped["local-sgd"]
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=1e-9, atol=1e-10, msg=lambda m: f"local-sgd {name}: {m}")


def test_a_gradient_scaler_unscales_before_the_clip():
    # fp16's scaler (CUDA only in a run) with a CPU scaler here: the norm clipped is the true gradient's, so the
    # update equals the unscaled reference's; clipping the scaled gradient would shrink every step 1024-fold.
    want, norms = reference()
    runtime = runtime_for(Sync(), WorkerContext(0, 1, 0, torch.device("cpu"), None), make_model(), sgd,
                          F.cross_entropy, clip_grad_norm=MAX_NORM)
    runtime.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for x, y in batches():
        runtime.train_step(x, y)
    assert float(runtime.grad_norm) == pytest.approx(norms[-1], rel=1e-9)
    for name, p in want.items():
        torch.testing.assert_close(runtime.module.state_dict()[name], p, rtol=1e-9, atol=1e-10)


def test_an_optimizer_factory_whose_first_parameter_is_model_receives_the_model():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))

    def by_name(model):
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": [p for n, p in model.named_parameters() if n.endswith("bias")],
                                   "weight_decay": 0.0}])

    made = call_optimizer_factory(by_name, model)
    assert [g["weight_decay"] for g in made.param_groups] == [0.1, 0.0]
    plain = call_optimizer_factory(lambda params: torch.optim.SGD(params, lr=0.1), model)
    assert len(plain.param_groups[0]["params"]) == 4  # anything else gets the parameters, as before


def test_the_simulated_local_steps_clip_each_workers_gradient_as_torch_does():
    from phalanx.simulate.world import clip_rows

    g = torch.Generator().manual_seed(2)
    stacked = [torch.randn(3, 4, 5, generator=g), torch.randn(3, 5, generator=g)]
    for t in stacked:
        t[0] *= 0.01  # worker 0's norm is under the bound: left as it is
    want = []
    for w in range(3):  # each worker's own gradient, clipped by torch
        own = [torch.zeros(t.shape[1:], requires_grad=True) for t in stacked]
        for p, t in zip(own, stacked):
            p.grad = t[w].clone()
        torch.nn.utils.clip_grad_norm_(own, 0.5)
        want.append([p.grad for p in own])
    clip_rows(stacked, 0.5)
    for w in range(3):
        for t, expected in zip(stacked, want[w]):
            torch.testing.assert_close(t[w], expected)


# --------------------------------------------------------------------------- model builders


class Tiny(nn.Module):
    """Takes num_classes and nothing else, as torchvision's ResNet does."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.fc(x)


def resnet(*, weights=None, progress=True, **kwargs):  # torchvision's builder signature
    return Tiny(**kwargs)


def shaped(input_shape, hidden=8):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), hidden))


def test_builders_get_num_classes_through_kwargs_and_input_shape_only_by_name():
    model = call_model_factory(resnet, "m:resnet", (1, 8, 8), 10)
    assert model.fc[1].out_features == 10  # num_classes through **kwargs; input_shape not pushed in
    assert call_model_factory(shaped, "m:shaped", (1, 8, 8), 10)[1].in_features == 64
    with pytest.raises(PhalanxError, match=r"--model m:Tiny: calling it with \{'num_classes': 10\} failed"):
        call_model_factory(lambda num_classes: 1 / 0, "m:Tiny", (1, 8, 8), 10)


# --------------------------------------------------------------------------- through the command

MODULE = '''
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.net(x)


def resnet(*, weights=None, progress=True, **kwargs):
    return Tiny(**kwargs)


def groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.SGD([{"params": decay, "weight_decay": 1e-3}, {"params": rest, "weight_decay": 0.0}],
                           lr=0.1, momentum=0.9)


def halve(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** (s // 4))


def one_cycle(optimizer, total_steps):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=total_steps)


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("optstep")
    (root / "mymod.py").write_text(MODULE)
    return root


def _events(path, kind="step"):
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


def _schedule(make, steps: int) -> list[float]:
    """The learning rate each step uses under ``make``'s scheduler (read before it steps), on its own."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = make(optimizer)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


STEPS = 12
FLAGS = ("--steps", str(STEPS), "--log-every", "1", "--batch-size", "16", "--workers", "2", "--devices", "cpu",
         "--progress", "none", "--checkpoint-every", "0")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sync", "fsdp"])
def test_a_model_factory_and_a_scheduler_of_the_users_with_clipping(project, strategy):
    out = run_in_process("train", "--model", "mymod:resnet", "--optimizer", "mymod:groups", "--lr-scheduler",
                         "mymod:halve", "--clip-grad-norm", "0.5", "--strategy", strategy, *FLAGS, "--checkpoint-dir",
                         strategy, cwd=project)
    assert out.returncode == 0, out.stderr
    steps = _events(project / strategy / "metrics.jsonl")
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    want = _schedule(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** (s // 4)), STEPS)
    assert [e["lr"] for e in steps] == pytest.approx(want)  # once per global step, the rate each step used
    assert all(e["grad_norm"] > 0 for e in steps)
    state = tensors(load_checkpoint(latest_checkpoint(project / strategy)))  # (fsdp's: sharded, read whole)
    assert state["step"] == STEPS
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [1e-3, 0.0]  # the user's groups
    assert state["meta"]["settings"]["lr_scheduler"] == "mymod:halve"
    assert state["meta"]["settings"]["clip_grad_norm"] == 0.5
    assert state["lr_scheduler"]["last_epoch"] == STEPS


@pytest.mark.slow
def test_the_parameter_server_steps_the_scheduler_once_per_global_step(project):
    # The server applies W updates per global step (ps): a scheduler stepped per update would end at half time,
    # and OneCycleLR would refuse to step past total_steps.
    out = run_in_process("train", "--model", "mymod:resnet", "--optimizer", "mymod:groups", "--lr-scheduler",
                         "mymod:one_cycle", "--clip-grad-norm", "0.5", "--strategy", "ps", *FLAGS, "--checkpoint-dir",
                         "ps", cwd=project)
    assert out.returncode == 0, out.stderr
    steps = _events(project / "ps" / "metrics.jsonl")
    want = _schedule(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=STEPS), STEPS)
    assert [e["lr"] for e in steps] == pytest.approx(want)
    assert all(e["grad_norm"] > 0 for e in steps)  # the server's update's norm


def _fit(root, name, **overrides):
    cfg = dict(model="mymod:Tiny", optimizer="sgd", lr=0.1, steps=10, batch_size=16, workers=1, devices="cpu",
               log_every=1, progress="none",
               checkpoint_dir=str(root / name), checkpoint_every=5, clip_grad_norm=0.5, lr_scheduler="mymod:step_lr")
    cfg.update(overrides)
    Trainer(TrainConfig(**cfg)).fit()
    return torch.load(latest_checkpoint(root / name), weights_only=True)


@pytest.mark.slow
def test_a_resumed_run_with_a_users_scheduler_ends_where_an_uninterrupted_one_does(project, monkeypatch):
    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    straight = _fit(project, "straight")
    resumed = _fit(project, "resumed", resume=str(project / "straight" / "step-00000005.pt"),
                   lr_scheduler=None, clip_grad_norm=None)  # both continue as the checkpoint has them
    assert resumed["step"] == 10 and resumed["lr_scheduler"] == straight["lr_scheduler"]
    for name, p in straight["model"].items():
        torch.testing.assert_close(resumed["model"][name], p, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    lrs = [e["lr"] for e in _events(project / "resumed" / "metrics.jsonl")]
    assert lrs == pytest.approx(_schedule(lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5), 10)[5:])


def test_a_users_scheduler_replaces_phalanx_schedule_in_one_line():
    with pytest.raises(PhalanxError, match="--lr-scheduler m:s replaces phalanx's own schedule, and --lr-schedule "
                                           "sets that one: drop --lr-schedule, or --lr-scheduler"):
        TrainConfig(lr_scheduler="m:s", lr_schedule="cosine")
    with pytest.raises(PhalanxError, match="--clip-grad-norm must be a positive, finite norm"):
        TrainConfig(clip_grad_norm=0)


# --------------------------------------------------------------------------- import errors

BROKEN = {
    "raises.py": "raise RuntimeError('no GPU driver here')\n",
    "needs.py": "import package_that_is_not_installed\n",
    "lazy.py": textwrap.dedent('''
        def __getattr__(name):  # as transformers' _LazyModule imports on attribute access
            raise RuntimeError(f"Failed to import transformers.models.gpt2 because of: {name} needs torch>=9")
        '''),
    "lazyimport.py": textwrap.dedent('''
        def __getattr__(name):
            raise ImportError("cannot import name 'GPT2Model' from partially initialized module")
        '''),
}

IMPORT_ERRORS = [
    ("raises:Net", "--model raises:Net: importing module 'raises' raised RuntimeError: no GPU driver here"),
    ("needs:Net", "--model needs:Net: importing module 'needs' failed (ModuleNotFoundError: No module named "
                  "'package_that_is_not_installed'); install what it imports"),
    ("lazy:GPT2", "--model lazy:GPT2: looking up 'GPT2' in module 'lazy' raised RuntimeError: Failed to import "
                  "transformers.models.gpt2 because of: GPT2 needs torch>=9"),
    ("lazyimport:GPT2", "--model lazyimport:GPT2: looking up 'GPT2' in module 'lazyimport' raised ImportError: "
                        "cannot import name 'GPT2Model'"),
]


@pytest.fixture
def broken(tmp_path, monkeypatch):
    for name, text in BROKEN.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    yield tmp_path
    for name in BROKEN:
        sys.modules.pop(name[:-3], None)


@pytest.mark.parametrize("spec, message", IMPORT_ERRORS, ids=[s for s, _ in IMPORT_ERRORS])
def test_an_exception_while_importing_or_resolving_is_one_line_naming_the_module(broken, spec, message, capsys):
    code, out = run_main(["train", "--model", spec, "--steps", "2", "--devices", "cpu", "--checkpoint-dir", "never"],
                         capsys)
    assert code == 2, out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.err
    assert "run from the directory" not in lines[0]  # only for the module itself not found
    assert not (broken / "never").exists()


@pytest.mark.slow
def test_a_torchvision_style_builder_trains_through_the_command(project):
    out = run_cli("train", "--model", "mymod:resnet", "--steps", "2", "--workers", "1", "--devices", "cpu",
                  "--progress", "none", "--checkpoint-dir", "tv", cwd=project)
    assert out.returncode == 0, out.stderr
    assert torch.load(project / "tv" / "step-00000002.pt", weights_only=True)["model"]["net.3.weight"].shape == (10, 32)
