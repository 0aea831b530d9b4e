"""compare --simulate on the device the user names (``--devices``): the workers' gradients, parameters, optimizer
states and evaluations live there.

- on the CPU, ``--devices cpu`` named explicitly is today's simulation, number for number;
- a GPU's way of computing the workers (vmap kept where an op loops inside it, calls of 256 workers, no threads
  with model copies) runs here on the CPU and gives the CPU's gradients, so its logic is covered without a GPU;
- on a GPU (marked ``gpu``, skipped where none exists): every tensor of the run is on it, and sync, local SGD
  and a parameter server end within float tolerance of the CPU's run (not bit for bit: other kernels).
--step-time and --link-* given, so nothing is measured and no process starts.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx import LocalSGD, ParameterServer, Sync, TrainConfig
from phalanx.compare.simulated_problem import build_problem
from phalanx.costs import Link
from phalanx.simulate import simulated_rule
from phalanx.simulate.gradients import Gradients
from phalanx.simulate.world import World
from phalanx.task.step import UserStep

LINK = Link(1e-5, 1e-9, "given")
RULES = [Sync(), LocalSGD(sync_every=4), ParameterServer()]


def simulate(options, devices, workers=4, steps=8):
    config = TrainConfig(model="mlp", devices=devices, batch_size=8)
    # (2 workers a machine, as on the CPU: on a GPU it would be the GPU count, and the clock would differ)
    world = World(build_problem(config, (workers,), 2, 0.01, LINK, lambda line: None), options, workers, None, 0,
                  steps, 4, None)
    simulated_rule(options).run(options, world)
    world.finish()
    return world


class Attention(nn.Module):
    """The GPT example's shape in small: an embedding, attention by scaled_dot_product_attention (which has no
    batching rule on the CPU: vmap loops over the workers there), a head."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv, self.head = nn.Embedding(11, 8), nn.Linear(8, 24), nn.Linear(8, 11)

    def forward(self, x):
        q, k, v = self.qkv(self.embed(x)).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        return self.head(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


def lm_step(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


@pytest.mark.slow
def test_naming_the_cpu_is_todays_simulation_number_for_number():
    """Where there is no GPU, ``auto`` is the CPU; naming it (``torch.device("cpu")``) runs the same code on it."""
    for options in RULES:
        default, named = simulate(options, "auto" if not torch.cuda.is_available() else "cpu"), \
            simulate(options, torch.device("cpu"))
        assert named.device == named.final.device == torch.device("cpu")
        assert all(p.device.type == "cpu" for p in named.template.parameters())
        assert torch.equal(default.final, named.final), options.name
        assert default.outcome.values == named.outcome.values


def test_a_gpus_way_of_computing_the_workers_gives_the_cpus_gradients_on_the_cpu():
    torch.manual_seed(0)
    model = Attention()
    W = 6
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = torch.stack([flat + 1e-2 * w for w in range(W)])
    tokens = torch.randint(0, 11, (W, 3, 5))
    shards = [(t, t.roll(-1, 1)) for t in tokens]
    cpu = Gradients(model, None, UserStep(lm_step), threads=2)
    device = Gradients(model, None, UserStep(lm_step), threads=2)
    device.on_cpu(False)
    device.chunk = 4  # two calls of 4 and 2 workers: the second after vmap was found to loop
    cpu.chunk = 4
    want, want_losses = cpu.each(rows, shards)
    got, losses = device.each(rows, shards)
    assert cpu.vmappable is False and len(cpu._helpers()) == 2  # in turn, two at once, after the first call
    assert device.vmappable is True and len(device._helpers()) == 1  # vmap kept, no copies of the model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    alone = torch.stack([cpu._by_shard(r.clone().requires_grad_(True), [s])[0] for r, s in zip(rows, shards)])
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-6)  # each worker's own, as one worker computes it


@pytest.mark.gpu
@pytest.mark.parametrize("options", RULES, ids=lambda o: o.name)
def test_on_a_gpu_the_simulation_ends_where_the_cpus_does(options):
    cpu, gpu = simulate(options, "cpu"), simulate(options, "cuda")
    assert gpu.device.type == gpu.final.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in gpu.template.parameters())
    torch.testing.assert_close(gpu.final.cpu(), cpu.final, rtol=1e-4, atol=1e-5)
    for a, b in zip(gpu.outcome.values, cpu.outcome.values):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-3)
    assert gpu.outcome.seconds == pytest.approx(cpu.outcome.seconds)  # the clock is the same given figures


@pytest.mark.gpu
def test_on_a_gpu_the_workers_gradients_are_the_cpus():
    torch.manual_seed(0)
    model = Attention()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = torch.stack([flat + 1e-2 * w for w in range(5)])
    tokens = torch.randint(0, 11, (5, 3, 5))
    shards = [(t, t.roll(-1, 1)) for t in tokens]
    want, _ = Gradients(model, None, UserStep(lm_step)).each(rows, shards)
    on_gpu = Gradients(Attention().cuda(), None, UserStep(lm_step))
    got, _ = on_gpu.each(rows.cuda(), [(x.cuda(), y.cuda()) for x, y in shards])
    assert got.device.type == "cuda" and on_gpu.vmappable is True
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
