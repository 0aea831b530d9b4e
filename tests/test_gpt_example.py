"""examples/gpt.py (issue 31, part 6): a GPT written as GPT code is written (nanoGPT's shape) is a proper language
model in plain PyTorch: causal, its input and output embeddings one tensor through training and checkpoints,
weight decay on the matrices only, nanoGPT's warmup-then-cosine schedule, and its plain loop (the reference of
benchmarks/gpt_quality.py) learns well below the unigram baseline. Under phalanx it trains with nothing but its
import paths (``--training-step gpt:step --optimizer gpt:optimizer --lr-scheduler gpt:schedule``) and
``--clip-grad-norm 1.0``, and sync on 2 workers computes what one process computes on the whole batch."""

import copy
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO, python_script, run_cli, run_in_process
from phalanx import Sync, TrainConfig, Trainer
from phalanx.data.loader import epoch_generator

sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))
import char_lm  # noqa: E402
import gpt  # noqa: E402  (the example, importable here and in the spawned workers)
import gpt_quality  # noqa: E402  (the plain PyTorch loop the strategies are measured against)

VOCAB = 105  #: the bytes the 16 corpus modules of Python 3.11 use


def small(seed: int = 0) -> gpt.GPT:
    torch.manual_seed(seed)
    return gpt.GPT(gpt.GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=16))


# --------------------------------------------------------------------------- the model, as its authors wrote it


def test_with_targets_every_position_is_scored_and_the_loss_is_their_mean_cross_entropy():
    model, g = small(), torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, VOCAB, (3, 16), generator=g), torch.randint(0, VOCAB, (3, 16), generator=g)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, VOCAB)
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)))
    last, none = model(idx)  # generating: the last position only, as nanoGPT's forward returns it
    assert none is None and last.shape == (3, 1, VOCAB) and torch.allclose(last[:, 0], logits[:, -1], atol=1e-6)


def test_attention_is_causal_a_later_token_changes_no_earlier_logit():
    model, g = small(), torch.Generator().manual_seed(2)
    idx = torch.randint(0, VOCAB, (2, 16), generator=g)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB
    a, _ = model(idx, idx)
    b, _ = model(changed, changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:], atol=1e-3)  # and it does change the positions that see it


def test_a_sequence_longer_than_the_block_is_refused_naming_both_lengths():
    with pytest.raises(ValueError, match="a sequence of 17 tokens is longer than block_size 16"):
        small()(torch.zeros(1, 17, dtype=torch.long))


def test_the_tied_embeddings_are_one_tensor_through_training_and_a_checkpoint():
    model = small()
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = gpt.optimizer(model)
    assert sum(len(group["params"]) for group in opt.param_groups) == len(list(model.parameters()))  # tied once
    idx = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
    before = model.lm_head.weight.detach().clone()
    for _ in range(3):
        loss, _ = gpt.step(model, (idx, idx.roll(-1, 1)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model.lm_head.weight is model.transformer.wte.weight and not torch.equal(model.lm_head.weight, before)
    restored = small(seed=9)
    restored.load_state_dict(model.state_dict())
    assert restored.lm_head.weight is restored.transformer.wte.weight
    assert torch.equal(restored.lm_head.weight, model.transformer.wte.weight)


def test_configure_optimizers_decays_the_matrices_and_not_the_biases_or_norms():
    model = small()
    decayed, plain = gpt.optimizer(model).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {names[id(p)] for p in decayed["params"]} == {n for n, p in model.named_parameters() if p.dim() == 2}
    assert all(names[id(p)].endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")) for p in plain["params"])
    assert decayed["lr"] == gpt.LEARNING_RATE and decayed["betas"] == (0.9, 0.99)


def test_the_schedule_warms_up_linearly_then_falls_by_a_cosine_to_a_tenth():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = gpt.schedule(opt, total_steps=130)
    lrs = []
    for _ in range(140):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1 / gpt.WARMUP) and lrs[gpt.WARMUP - 1] == pytest.approx(1.0)
    assert lrs[gpt.WARMUP + 50] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))  # half way: 0.55
    assert lrs[130] == pytest.approx(gpt.MIN_LR_RATIO) and lrs[139] == pytest.approx(gpt.MIN_LR_RATIO)
    assert all(a >= b for a, b in zip(lrs[gpt.WARMUP - 1:], lrs[gpt.WARMUP:]))


def test_make_and_load_give_the_corpus_windows_and_a_model_of_its_vocabulary():
    (x, y), (xt, yt) = gpt.load()
    assert x.shape[1] == gpt.GPTConfig.block_size and torch.equal(x[:, 1:], y[:, :-1])
    (cx, _), _ = char_lm.load(gpt.GPTConfig.block_size)
    assert torch.equal(x, cx)  # char_lm's reader, not a second one
    model = gpt.make(gpt_quality.vocabulary((x, y), (xt, yt)))
    assert model.lm_head.out_features == VOCAB and model.config.n_layer == 2


# --------------------------------------------------------------------------- the plain PyTorch loop learns


@pytest.mark.slow
def test_the_plain_loop_learns_well_below_the_unigram_baseline():
    """150 steps of 32 windows (the benchmark's reference loop, shortened): 10.7 here (seed 0; 250 steps gave 9.0,
    at two thirds more of the suite's longest test); the unigram model scores 23.0 and a uniform guess 105, the
    untrained model about 105 too."""
    train, test = gpt.load()
    base = char_lm.baselines(train, test)
    torch.manual_seed(0)
    untrained = gpt_quality.perplexity(gpt.make(VOCAB), test)
    trained = gpt_quality.perplexity(gpt_quality.plain_loop(150, 32, seed=0), test)
    assert untrained > 0.8 * base["uniform"]
    assert trained < base["unigram"] / 2, (trained, base)


# --------------------------------------------------------------------------- under phalanx

K, PER_WORKER = 4, 4  #: the equivalence run: 4 steps of 2 x 4 windows


def one_process(model: gpt.GPT, train: tuple, steps: int, global_batch: int, seed: int = 0) -> dict:
    """The plain loop on phalanx's global batches (each epoch's shuffle, cut in global batches), clipped to 1.0."""
    opt = gpt.optimizer(model)
    sched = gpt.schedule(opt, steps)
    order = torch.randperm(len(train[0]), generator=epoch_generator(seed, 0, 0))
    for k in range(steps):
        idx = order[k * global_batch:(k + 1) * global_batch]
        loss, _ = gpt.step(model, (train[0][idx], train[1][idx]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return model.state_dict()


@pytest.mark.slow
def test_sync_on_two_workers_equals_one_process_on_the_whole_batch(tmp_path):
    """float64, so the only difference left is the order of a sum: 2 workers' mean gradients averaged by DDP ==
    the mean over the 8 windows (each worker's loss is a mean over as many tokens), clipped after the average."""
    (x, y), (xt, yt) = gpt.load(16)
    train, test = (x[:64], y[:64]), (xt[:16], yt[:16])
    model = small().double()
    start = copy.deepcopy(model)
    cfg = TrainConfig(strategy=Sync(), workers=2, devices="cpu", steps=K, batch_size=PER_WORKER, clip_grad_norm=1.0,
                      checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=0, progress="none")
    summary = Trainer(cfg, model=model, train_data=train, test_data=test, training_step=gpt.step,
                      optimizer=gpt.optimizer, lr_scheduler=gpt.schedule).fit()
    got = torch.load(summary["checkpoint"], weights_only=False)["model"]
    want = one_process(copy.deepcopy(start), train, K, 2 * PER_WORKER)
    assert torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])  # still one tensor
    assert not torch.allclose(want["lm_head.weight"], start.state_dict()["lm_head.weight"])  # it did train
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")


STEPS = 100
#: the test perplexity a CLI run of STEPS steps of 2 x 16 windows stays under: measured sync 11.6 (deterministic);
#: ps only below the unigram model's 23.0: measured 15.4, 16.5 and, on a loaded machine, 21.4, where the run sat
#: on the small transformer's plateau (loss 3.0-3.1 from step 40 on) that sync leaves by then: asynchronous, each
#: worker's gradient an update of its own, a step stale, so the order of updates and the escape vary by run
BAR = {"sync": 14.0, "ps": None}
CLI = ("--model", "gpt:make", "--data", "gpt:load", "--training-step", "gpt:step", "--optimizer", "gpt:optimizer",
       "--lr-scheduler", "gpt:schedule", "--clip-grad-norm", "1.0", "--steps", str(STEPS), "--batch-size", "16",
       "--workers", "2", "--devices", "cpu", "--log-every", "1", "--progress", "none", "--checkpoint-every", "0")


def rates(steps: int) -> list[float]:
    """The learning rate of each step under gpt.schedule."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=gpt.LEARNING_RATE)
    sched, out = gpt.schedule(opt, steps), []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sync", "ps"])
def test_the_example_trains_through_the_cli_with_nothing_but_its_import_paths(tmp_path, strategy):
    run = run_cli if strategy == "sync" else run_in_process  # (the installed command once; the same main() here)
    out = run("train", *CLI, "--strategy", strategy, "--checkpoint-dir", str(tmp_path), cwd=REPO / "examples")
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["lr"] for e in steps] == pytest.approx(rates(STEPS))  # the example's schedule, once per global step
    assert all(e["grad_norm"] > 0 for e in steps)  # clipped (the norm before clipping is logged)
    summary = next(e for e in events if e["event"] == "summary")
    base = char_lm.baselines(*gpt.load())
    bar = BAR[strategy] or base["unigram"]
    assert summary["test_metrics"]["perplexity"] < bar <= base["unigram"], summary["test_metrics"]
    state = torch.load(summary["checkpoint"], weights_only=False)
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.1, 0.0]  # configure_optimizers'
    model = gpt.make(VOCAB)
    model.load_state_dict(state["model"])
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(state["model"]["lm_head.weight"], state["model"]["transformer.wte.weight"])


@pytest.mark.slow
def test_the_example_runs_standalone(tmp_path):
    out = python_script(REPO / "examples" / "gpt.py", "--dry-run", "--checkpoint-dir", str(tmp_path / "ck"),
                        cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "gpt: sync, test perplexity" in out.stdout and "after 10 steps" in out.stdout
