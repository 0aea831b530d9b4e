"""fsdp's units by block and activation checkpointing (issue 32, parts 2 and 4).

- By default the units are the model's repeated blocks (the modules of one class a ModuleList or Sequential
  repeats): examples/gpt.py's ``transformer.h``, Hugging Face GPT-2's ``transformer.h`` and BERT's
  ``bert.encoder.layer``; built-in models keep their Sequential's children; ``--blocks`` takes class names;
  an unknown name is one line listing the model's repeated classes; 12 blocks print short.
- ``--precision bf16`` on a GPU gives fully_shard torch's MixedPrecisionPolicy (bf16 parameters, fp32
  reduction); on a CPU nothing (checked as a pure choice here; the GPU run is benchmarks/gpu/check.sh's).
- A forward that builds state from ``next(self.parameters())`` outside a unit (pytorch/examples' word
  language model's ``init_hidden``) ends with one line naming the cause and the fix, exit 2, no traceback;
  the fix it names trains.
- ``--activation-checkpointing``: the GPT example (``make()``) under sync, fsdp, local-sgd and diloco on 2 gloo
  workers ends k steps with exactly the parameters it has without it (float32, torch.equal: the recomputed
  forward runs the same operators on the same values), and keeps less for backward (measured, in the summary).
"""

import copy
import sys

import pytest
import torch
from torch import nn

from helpers import REPO, run_cli, run_in_process
from phalanx import FSDP, DiLoCo, LocalSGD, Sync, TrainConfig, Trainer
from phalanx.errors import PhalanxError
from phalanx.task.models import build_model, describe_blocks, model_blocks_by_default, model_units
from phalanx.precision import Precision
from phalanx.checkpoint import load_checkpoint, tensors
from phalanx.recompute import checkpoint_blocks
from phalanx.strategies.fsdp import shard_units
from phalanx.train.step_errors import explained

sys.path.insert(0, str(REPO / "examples"))
import gpt  # noqa: E402  (the example, importable here and in the spawned workers)

VOCAB = 105  #: the bytes the corpus of examples/gpt.py uses


def names(units):
    return [name for name, _ in units]


def small_gpt(layers: int = 2) -> gpt.GPT:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=layers, n_head=2, n_embd=16))


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))


def hf_bert():
    from transformers import BertConfig, BertForSequenceClassification
    return BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=32, num_labels=3))


# --------------------------------------------------------------------------- units by block


def test_the_units_are_the_repeated_blocks_of_a_wrapper_model_the_rest_stays_with_the_root():
    assert names(shard_units(small_gpt())) == ["transformer.h.0", "transformer.h.1"]
    assert names(shard_units(hf_gpt2())) == ["transformer.h.0", "transformer.h.1"]
    assert names(shard_units(hf_bert())) == ["bert.encoder.layer.0", "bert.encoder.layer.1"]


def test_built_in_models_keep_their_sequential_children():
    for name in ("cnn", "mlp", "cifar10", "lstm"):
        model = build_model(name, (3, 24, 24) if name == "cifar10" else (1, 8, 8), 10)
        assert names(model_units(model)) == [n for n, m in model.named_children() if list(m.parameters())], name


def test_every_block_compile_compiles_runs_in_the_models_forward():
    # --compile compiles units in place; a unit the forward never calls (nanoGPT's transformer ModuleDict) would
    # leave the model eager without a word, as it did until the containers were opened.
    tokens = torch.randint(0, 64, (2, 8))
    for model, batch in ((small_gpt(), (tokens, tokens)), (hf_gpt2(), (tokens,)), (hf_bert(), (tokens,))):
        units = model_blocks_by_default(model)
        called = set()
        for name, unit in units:
            unit.register_forward_hook(lambda m, args, out, name=name: called.add(name))
        model(*batch)
        assert called == set(names(units)), type(model).__name__
    assert names(model_blocks_by_default(small_gpt())) == ["transformer.wte", "transformer.wpe", "transformer.h.0",
                                                           "transformer.h.1", "transformer.ln_f", "lm_head"]


def test_blocks_takes_class_names_as_well_as_submodule_names():
    model = small_gpt()
    assert names(FSDP(blocks="Block").units(model)) == ["transformer.h.0", "transformer.h.1"]
    assert names(FSDP(blocks="Block,transformer.ln_f").units(model)) == [
        "transformer.h.0", "transformer.h.1", "transformer.ln_f"]
    assert names(FSDP(blocks="GPT2Block").units(hf_gpt2())) == ["transformer.h.0", "transformer.h.1"]


def test_an_unknown_name_is_one_line_listing_the_model_s_repeated_classes():
    with pytest.raises(PhalanxError, match=r"^--blocks names 'Blok', neither a submodule nor a module class of GPT "
                                           r"\(its repeated blocks: Block \(transformer.h.0, transformer.h.1\); its "
                                           r"children: transformer, lm_head\); name submodules as"):
        FSDP(blocks="Blok").units(small_gpt())


def test_the_cli_refuses_an_unknown_block_before_any_worker_starts(tmp_path):
    out = run_in_process("train", "--strategy", "fsdp", "--blocks", "Conv", "--steps", "1", "--progress", "none",
                         "--checkpoint-dir", str(tmp_path / "ck"), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "--blocks names 'Conv', neither a submodule nor a module class of Sequential" in out.stderr


def test_the_plan_names_twelve_blocks_in_one_short_phrase():
    units = shard_units(small_gpt(layers=12))
    assert describe_blocks(units) == "transformer.h.0 … transformer.h.11: Block × 12"
    assert describe_blocks(units[:4]) == "transformer.h.0, transformer.h.1, transformer.h.2, transformer.h.3"


# --------------------------------------------------------------------------- mixed precision


def test_bf16_on_a_gpu_gives_fully_shard_bf16_parameters_and_fp32_reductions_and_nothing_elsewhere():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert Precision("bf16", "cuda").sharded_policy() == MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                             reduce_dtype=torch.float32)
    assert Precision("bf16", "cpu").sharded_policy() is None  # a CPU: autocast alone, as before
    assert Precision("fp32", "cuda").sharded_policy() is None
    assert Precision("fp16", "cuda").sharded_policy() is None  # (fsdp refuses fp16 before this is asked)


# --------------------------------------------------------------------------- state built outside a unit

RNN_MODULE = '''
import torch
from torch import nn


class RNNModel(nn.Module):
    """pytorch/examples' word language model, shortened: its init_hidden, called in its own forward."""

    def __init__(self, ntoken=64, ninp=16, nhid=16, nlayers=2):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, batch_first=True)
        self.decoder = nn.Linear(nhid, 10)
        self.nlayers, self.nhid = nlayers, nhid

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))

    def forward(self, x):
        out, _ = self.rnn(self.encoder(x), self.init_hidden(x.size(0)))
        return self.decoder(out[:, -1])


def load():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (256, 6), generator=g)
    return (x[:200], x[:200, 0] % 10), (x[200:], x[200:, 0] % 10)
'''


@pytest.mark.slow
def test_state_built_from_a_sharded_parameter_is_one_line_naming_the_cause_and_the_fix(tmp_path):
    (tmp_path / "rnn.py").write_text(RNN_MODULE)
    args = ("train", "--model", "rnn:RNNModel", "--data", "rnn:load", "--strategy", "fsdp", "--steps", "2",
            "--batch-size", "8", "--devices", "cpu", "--progress", "none")
    out = run_cli(*args, "--checkpoint-dir", str(tmp_path / "a"), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    error = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, out.stderr
    assert "aten.mkldnn_rnn_layer.default a sharded parameter's tensor (a DTensor)" in error[0]
    assert "next(self.parameters()) is encoder.weight" in error[0]
    assert "leave encoder out of --blocks" in error[0]
    # the fix it names: the embedding with the root, gathered for the whole forward
    fixed = run_in_process(*args, "--blocks", "rnn,decoder", "--checkpoint-dir", str(tmp_path / "b"), cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr


def test_other_errors_of_a_step_are_not_explained_away():
    assert explained(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), nn.Linear(2, 2)) is None
    assert explained(ValueError("got mixed torch.Tensor and DTensor"), nn.Linear(2, 2)) is None  # not torch's


# --------------------------------------------------------------------------- activation checkpointing


def test_strategies_whose_engine_does_not_take_it_refuse_it_in_one_line():
    for name in ("ps", "ssp", "backup", "hogwild", "pipeline"):
        with pytest.raises(PhalanxError, match=rf"^--strategy {name} does not take --activation-checkpointing; use "
                                               r"one of sync, .*fsdp"):
            TrainConfig(strategy=name, activation_checkpointing=True)
    for name in ("sync", "fsdp", "local-sgd", "diloco"):
        assert TrainConfig(strategy=name, activation_checkpointing=True).activation_checkpointing


def test_in_one_process_the_gradients_are_the_same_and_less_is_kept_for_backward():
    plain, model = small_gpt(), small_gpt()
    idx = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    done = checkpoint_blocks(model, model_units(model), lambda: gpt.step(model, (idx, idx))[0])
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]  # names kept
    for m in (plain, model):
        gpt.step(m, (idx, idx.roll(-1, 1)))[0].backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert done.count == 2 and 0 < done.saved_with < done.saved_without


def test_measuring_changes_neither_the_buffers_nor_the_random_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)),
                          nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)))
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(16, 4)
    rng = torch.get_rng_state()
    checkpoint_blocks(model, model_units(model), lambda: model(x).sum())
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_plain_forward_that_does_not_fit_is_reported_as_such_and_checkpointing_goes_on():
    model, idx = small_gpt(), torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    calls = []

    def forward():
        calls.append(1)
        if len(calls) == 1:  # the plain forward, as a device too small for it ends it
            raise torch.OutOfMemoryError("CUDA out of memory")
        return gpt.step(model, (idx, idx))[0]

    done = checkpoint_blocks(model, model_units(model), forward)
    assert done.saved_without is None and done.saved_with > 0
    assert "(without checkpointing the forward did not fit the device)" in done.line()


K, PER_WORKER = 3, 4  #: 3 steps of 2 x 4 windows of the example's 64 bytes


def _gpt_run(tmp_path, strategy, checkpointing: bool) -> dict:
    (x, y), (xt, yt) = gpt.load()
    torch.manual_seed(0)
    cfg = TrainConfig(strategy=strategy, workers=2, devices="cpu", steps=K, batch_size=PER_WORKER,
                      clip_grad_norm=1.0, activation_checkpointing=checkpointing, checkpoint_every=0,
                      checkpoint_dir=str(tmp_path / f"{strategy.name}-{checkpointing}"), progress="none")
    summary = Trainer(cfg, model=gpt.make(VOCAB), train_data=(x[:64], y[:64]), test_data=(xt[:16], yt[:16]),
                      training_step=gpt.step, optimizer=gpt.optimizer, lr_scheduler=gpt.schedule).fit()
    return {"model": tensors(load_checkpoint(summary["checkpoint"]))["model"], "summary": summary}  # (fsdp's: sharded)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [Sync(), FSDP(), LocalSGD(sync_every=2), DiLoCo(sync_every=2)],
                         ids=["sync", "fsdp", "local-sgd", "diloco"])
def test_the_gpt_example_ends_k_steps_with_exactly_the_parameters_it_has_without(tmp_path, strategy):
    plain, recomputed = _gpt_run(tmp_path, strategy, False), _gpt_run(tmp_path, strategy, True)
    torch.manual_seed(0)
    start = gpt.make(VOCAB)
    assert not torch.equal(plain["model"]["transformer.h.0.attn.q.weight"],
                           start.state_dict()["transformer.h.0.attn.q.weight"])  # it did train
    assert plain["model"].keys() == recomputed["model"].keys()
    for name, value in plain["model"].items():
        assert torch.equal(recomputed["model"][name], value), name
    measured = recomputed["summary"]["activation_checkpointing"]
    assert measured["blocks"] == 2 and 0 < measured["saved_bytes_with"] < measured["saved_bytes_without"] / 3
    assert "activation_checkpointing" not in plain["summary"]


def test_a_model_of_its_own_without_blocks_is_checkpointed_by_its_children():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Conv1d(1, 1, 3)

        def forward(self, x):
            return self.b(self.a(x).unsqueeze(1))

    assert names(model_units(Two())) == ["a", "b"]  # no repeated class: its top-level children, as before
