"""make_parallel against the plain module: outputs, gradients, buffers, state dicts, errors."""

import threading

import pytest
import torch
from torch import nn

from phalanx import PhalanxError, make_parallel


class TwoInputs(nn.Module):
    """Positional and keyword tensors, a non-tensor option, and a tuple or dict output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(3, 4)

    def forward(self, x, y=None, scale=1.0, as_dict=False):
        h = torch.tanh(self.a(x)) * scale
        if y is not None:
            h = h + self.b(y)
        if as_dict:
            return {"h": h, "norm": h.pow(2).sum(1, keepdim=True)}
        return h, h.sum(1)


def _pair(seed=0):
    torch.manual_seed(seed)
    plain = TwoInputs().double()
    twin = TwoInputs().double()
    twin.load_state_dict(plain.state_dict())
    return plain, twin


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("towers", [1, 2, 3])
@pytest.mark.parametrize("rows", [12, 10, 7])
def test_outputs_and_gradients_equal_the_plain_model(towers, rows):
    plain, twin = _pair()
    par = make_parallel(twin, ["cpu"] * towers)
    x, y = torch.randn(rows, 5, dtype=torch.double), torch.randn(rows, 3, dtype=torch.double)
    ref = plain(x, y=y, scale=0.5)
    out = par(x, y=y, scale=0.5)  # positional + keyword tensors + a non-tensor argument
    for a, b in zip(ref, out):
        torch.testing.assert_close(a, b)
    (ref[0].pow(2).mean() + ref[1].mean()).backward()
    (out[0].pow(2).mean() + out[1].mean()).backward()
    for name, g in _grads(plain).items():
        torch.testing.assert_close(g, _grads(twin)[name], msg=name)


def test_dict_outputs_and_positional_only_call():
    plain, twin = _pair(1)
    par = make_parallel(twin, 3)
    x, y = torch.randn(10, 5, dtype=torch.double), torch.randn(10, 3, dtype=torch.double)
    ref, out = plain(x, y, 2.0, True), par(x, y, 2.0, True)
    assert set(out) == {"h", "norm"}
    for k in ref:
        torch.testing.assert_close(ref[k], out[k])
    ref["norm"].sum().backward()
    out["norm"].sum().backward()
    for name, g in _grads(plain).items():
        torch.testing.assert_close(g, _grads(twin)[name])


def test_a_hugging_face_output_keeps_its_type_and_its_loss_is_one_per_tower():
    """A transformers model returns a ModelOutput (``out.loss``, ``out.logits``); the towers' were gathered into a
    plain dict, so ``out.loss`` failed. As with nn.DataParallel: the same type, the loss one value per tower."""
    outputs = pytest.importorskip("transformers.modeling_outputs")

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(5, 3)

        def forward(self, x, labels):
            logits = self.head(x)
            return outputs.CausalLMOutput(loss=nn.functional.cross_entropy(logits, labels), logits=logits)

    torch.manual_seed(0)
    model = LM()
    x, labels = torch.randn(8, 5), torch.randint(0, 3, (8,))
    with pytest.warns(UserWarning, match="towers returned scalars"):
        out = make_parallel(model, 2)(x, labels=labels)
    assert type(out) is outputs.CausalLMOutput
    torch.testing.assert_close(out.logits, model(x, labels).logits)
    halves = [model(x[i:i + 4], labels[i:i + 4]).loss for i in (0, 4)]
    torch.testing.assert_close(out.loss, torch.stack(halves))


def test_uneven_split_sizes_and_fewer_rows_than_devices():
    seen = []

    class Record(nn.Module):
        def forward(self, x):
            seen.append(len(x))
            return x * 2

    make_parallel(Record(), ["cpu"] * 3)(torch.ones(10, 1))
    assert sorted(seen, reverse=True) == [4, 3, 3]
    seen.clear()
    out = make_parallel(Record(), ["cpu"] * 3)(torch.ones(2, 1))
    assert seen == [1, 1] and out.shape == (2, 1)  # two towers, never an empty one


def test_towers_run_in_their_own_threads_and_one_device_is_a_pass_through():
    threads = []

    class Where(nn.Module):
        def forward(self, x):
            threads.append(threading.get_ident())
            return x

    make_parallel(Where(), ["cpu", "cpu"])(torch.ones(4, 1))
    assert len(set(threads)) == 2
    threads.clear()
    x = torch.ones(4, 1)
    out = make_parallel(Where(), "cpu")(x)
    assert threads == [threading.get_ident()] and out is x  # no thread, no copy


def test_batchnorm_semantics_first_tower_updates_running_statistics():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    twin = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    twin.load_state_dict(plain.state_dict())
    par = make_parallel(twin, ["cpu", "cpu"])
    x = torch.randn(8, 3, dtype=torch.double)
    out = par(x)
    # training mode: each tower normalises with its own slice's statistics ...
    torch.testing.assert_close(out[:4], plain(x[:4]))
    # ... and the running statistics are the first tower's (plain just ran on that slice)
    torch.testing.assert_close(twin[1].running_mean, plain[1].running_mean)
    torch.testing.assert_close(twin[1].running_var, plain[1].running_var)
    assert twin[1].num_batches_tracked.item() == 1
    # eval mode: the model's buffers, so exactly the model's output
    par.eval(), plain.eval()
    torch.testing.assert_close(par(x), plain(x))


def test_state_dict_loads_into_the_bare_model_and_back():
    plain, twin = _pair()
    par = make_parallel(twin, ["cpu", "cpu"])
    assert list(par.state_dict()) == list(plain.state_dict())
    fresh = TwoInputs().double()
    fresh.load_state_dict(par.state_dict())
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v)
    other = TwoInputs().double()
    par.load_state_dict(other.state_dict())
    torch.testing.assert_close(twin.a.weight, other.a.weight)
    assert isinstance(par, nn.Module) and len(list(par.parameters())) == 4


def test_training_with_an_optimizer_matches_the_plain_model():
    plain, twin = _pair(3)
    par = make_parallel(twin, ["cpu"] * 3)
    opt_a = torch.optim.Adam(plain.parameters(), lr=0.05)
    opt_b = torch.optim.Adam(par.parameters(), lr=0.05)
    for _ in range(5):
        x = torch.randn(11, 5, dtype=torch.double)
        for model, opt in ((plain, opt_a), (par, opt_b)):
            opt.zero_grad()
            model(x)[0].pow(2).mean().backward()
            opt.step()
    torch.testing.assert_close(plain.a.weight, twin.a.weight)


def test_a_tower_error_is_raised_in_the_caller():
    class Fails(nn.Module):
        def forward(self, x):
            if x[0, 0] > 0:
                raise ValueError("bad slice")
            return x

    x = torch.tensor([[-1.0], [1.0]])
    with pytest.raises(ValueError, match="bad slice") as info:
        make_parallel(Fails(), ["cpu", "cpu"])(x)
    assert "tower 1" in str(info.value.__notes__)


def test_bad_inputs_are_clear_errors():
    plain, twin = _pair()
    par = make_parallel(twin, ["cpu", "cpu"])
    with pytest.raises(PhalanxError, match="argument y has 99 rows but x has 100"):
        par(torch.randn(100, 5, dtype=torch.double), y=torch.randn(99, 3, dtype=torch.double))
    with pytest.raises(PhalanxError, match="empty batch: x has 0 rows"):
        par(torch.randn(0, 5, dtype=torch.double))
    with pytest.raises(PhalanxError, match="unknown device 'tpu:0'"):
        make_parallel(twin, ["tpu:0"])
    with pytest.raises(PhalanxError, match="cuda:3 requested but no CUDA device exists here"):
        make_parallel(twin, "cuda:3", strict=True)
    spread = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(PhalanxError, match=r"spread over several devices \(cpu, meta\)"):
        make_parallel(spread, ["cpu", "cpu"])


@pytest.mark.gpu
def test_two_towers_on_one_gpu_equal_the_plain_model():
    plain, twin = _pair()
    plain, twin = plain.cuda(), twin.cuda()
    par = make_parallel(twin, ["cuda:0", "cuda:0"])
    x, y = torch.randn(9, 5, dtype=torch.double, device="cuda"), torch.randn(9, 3, dtype=torch.double, device="cuda")
    ref, out = plain(x, y=y), par(x, y=y)
    torch.testing.assert_close(ref[0], out[0])
    ref[0].sum().backward()
    out[0].sum().backward()
    for name, g in _grads(plain).items():
        torch.testing.assert_close(g, _grads(twin)[name])


@pytest.mark.gpu
def test_cpu_model_with_gpu_towers_gathers_back_on_the_cpu():
    plain, twin = _pair()
    par = make_parallel(twin, ["cuda:0", "cuda:0"])
    x = torch.randn(6, 5, dtype=torch.double)
    out = par(x)
    assert out[0].device.type == "cpu"
    torch.testing.assert_close(out[0], plain(x)[0])
    out[0].sum().backward()
    plain(x)[0].sum().backward()
    assert twin.a.weight.grad.device.type == "cpu"
    torch.testing.assert_close(twin.a.weight.grad, plain.a.weight.grad)
