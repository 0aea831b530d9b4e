"""Models as their authors wrote them, given with a factory and the data alone (issue 41).

- A forward that takes the targets second (nanoGPT's and minGPT's ``forward(idx, targets=None) -> (logits,
  loss)``) is called ``model(x, y)`` for a pair batch, and its own loss is the loss: a model written in their
  style (not a copy) under sync on 2 workers ends K steps where one process ends them on the whole batch, and the
  Trainer trains it from ``model=functools.partial(TinyGPT, config)`` although the model holds a lambda, as
  minGPT's does (the object itself cannot be sent: the message names the factory that can).
"""

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import run_workers
from phalanx import Sync, TrainConfig, Trainer
from phalanx.strategies import runtime_for
from phalanx.task.step import DefaultStep, calls_model_alone, targets_parameter

K, BATCH, V, T = 3, 8, 16, 8


@dataclasses.dataclass
class TinyConfig:
    vocab_size: int = V
    block_size: int = T
    n_embd: int = 16
    n_head: int = 2
    n_layer: int = 2


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(config.n_embd), nn.LayerNorm(config.n_embd)
        self.attn = nn.MultiheadAttention(config.n_embd, config.n_head, batch_first=True)
        self.c_fc, self.c_proj = nn.Linear(config.n_embd, 4 * config.n_embd), nn.Linear(4 * config.n_embd,
                                                                                        config.n_embd)
        self.mlpf = lambda x: self.c_proj(F.gelu(self.c_fc(x)))  # minGPT's style: a lambda on the module
        self.register_buffer("mask", torch.triu(torch.ones(config.block_size, config.block_size, dtype=torch.bool), 1))

    def forward(self, x):
        t = x.size(1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        return x + self.mlpf(self.ln_2(x))


class TinyGPT(nn.Module):
    """nanoGPT's and minGPT's interface: ``forward(idx, targets=None) -> (logits, loss)``, the loss only where
    targets are given (ignore_index=-1, as theirs), the last position's logits only where they are not."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte, self.wpe = nn.Embedding(config.vocab_size, config.n_embd), nn.Embedding(config.block_size,
                                                                                           config.n_embd)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f, self.lm_head = nn.LayerNorm(config.n_embd), nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def tiny() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyConfig())


def windows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token the last + 1: (idx, the next tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, V, (n, 1), generator=g) + torch.arange(T + 1)) % V
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def test_a_forward_that_takes_the_targets_gets_them_and_its_loss_is_the_loss():
    model, (x, y) = tiny(), windows(4, 0)
    never = lambda out, t: torch.tensor(1e9)  # noqa: E731 (the model's own loss must win)
    result = DefaultStep(never)(model, (x, y))
    logits, loss = model(x, y)
    assert torch.equal(result.loss, loss) and result.outputs.shape == (4, T, V) and result.targets is y
    assert targets_parameter(model) == "targets" and not calls_model_alone(DefaultStep(never), model)

    class Labels(nn.Module):  # a second parameter named labels, an output with .loss; a model that returns logits
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 4)

        def forward(self, x, labels=None):
            return dataclasses.make_dataclass("Out", ["logits", "loss"])(self.lin(x), self.lin(x).sum() * 0 + 7.0)

    out = DefaultStep(never)(Labels(), (torch.ones(2, 3), torch.zeros(2, dtype=torch.long)))
    assert out.loss.item() == 7.0 and out.outputs.shape == (2, 4)
    plain = nn.Linear(3, 4)  # forward(input): called model(x), scored by the task's loss
    assert targets_parameter(plain) is None and calls_model_alone(DefaultStep(never), plain)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def reference() -> dict:
    model = tiny()
    opt = sgd(model.parameters())
    for k in range(K):
        model(*windows(BATCH, k))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def _sync_run(ctx) -> dict:
    n = BATCH // ctx.world_size
    mine = lambda b: tuple(t[ctx.rank * n:(ctx.rank + 1) * n] for t in b)  # noqa: E731
    runtime = runtime_for(Sync(), ctx, tiny(), sgd, example=mine(windows(BATCH, 0)))
    for k in range(K):
        runtime.train_step(mine(windows(BATCH, k)))
    return runtime.state_dict()["model"]


@pytest.mark.slow
def test_a_model_in_nanogpts_style_under_sync_on_two_workers_equals_one_process_on_the_whole_batch():
    got, want = run_workers(_sync_run, 2), reference()
    assert not torch.equal(want["lm_head.weight"], tiny().state_dict()["lm_head.weight"])  # (it trained)
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_the_trainer_trains_it_from_a_factory_and_the_data_alone(tmp_path):
    cfg = TrainConfig(strategy="sync", workers=2, devices="cpu", steps=40, batch_size=16, optimizer="adamw",
                      lr=3e-3, progress="none", checkpoint_dir=str(tmp_path / "c"))
    summary = Trainer(cfg, model=functools.partial(TinyGPT, TinyConfig()), train_data=windows(256, 1),
                      test_data=windows(64, 2)).fit()
    assert summary["test_metrics"]["perplexity"] < math.sqrt(V)  # (from about V: it learned the rule)


# --------------------------------------------------------------------------- the model's own methods under sync


class WordLM(nn.Module):
    """pytorch/examples' word language model's interface: ``init_hidden(bsz)`` and ``forward(input, hidden) ->
    (output, hidden)``, called by a step of the user's as its own training script calls it."""

    def __init__(self, ntoken: int = V, nhid: int = 16):
        super().__init__()
        self.nhid = nhid
        self.encoder, self.rnn, self.decoder = nn.Embedding(ntoken, nhid), nn.LSTM(nhid, nhid, batch_first=True), \
            nn.Linear(nhid, ntoken)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return self.decoder(output), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return weight.new_zeros(1, bsz, self.nhid), weight.new_zeros(1, bsz, self.nhid)


def word_lm_step(model, batch):
    x, y = batch
    output, _ = model(x, model.init_hidden(x.size(0)))  # the model's own method, through the strategy's wrapper
    return F.cross_entropy(output.reshape(-1, V), y.reshape(-1))


def word_lm() -> WordLM:
    torch.manual_seed(0)
    return WordLM()


def _word_lm_run(ctx) -> dict:
    n = BATCH // ctx.world_size
    mine = lambda b: tuple(t[ctx.rank * n:(ctx.rank + 1) * n] for t in b)  # noqa: E731
    runtime = runtime_for(Sync(), ctx, word_lm(), sgd, example=mine(windows(BATCH, 0)), training_step=word_lm_step)
    for k in range(K):
        runtime.train_step(mine(windows(BATCH, k)))
    wrapper = runtime.model
    return {"model": runtime.state_dict()["model"], "wrapper": type(wrapper).__name__,
            "nhid": wrapper.nhid, "own": wrapper.init_hidden(2)[0].shape}


@pytest.mark.slow
def test_a_step_reaches_the_models_own_methods_under_sync_and_its_forward_is_ddps():
    got = run_workers(_word_lm_run, 2)
    model = word_lm()
    opt = sgd(model.parameters())
    for k in range(K):
        word_lm_step(model, windows(BATCH, k)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert got["wrapper"] == "ModelDDP" and got["nhid"] == 16 and got["own"] == (1, 2, 16)
    for name, p in model.state_dict().items():  # the gradients were reduced: the two ranks stepped as one
        torch.testing.assert_close(got["model"][name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
