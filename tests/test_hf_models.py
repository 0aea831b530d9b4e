"""Hugging Face's Llama (grouped-query attention), GPT-2, T5 and BERT, built from small configs (no downloads),
under the features for big models (issue 41): what each declares is read first, the structural rule after.

- ``--activation-checkpointing``: each model's own ``activation_checkpointing_enable()`` (non-reentrant, the
  cache off) where it declares ``supports_gradient_checkpointing``; the structural rule (torch's checkpoint on the
  blocks ``_no_split_modules`` names, cache inputs turned off, keyword inputs passed through) where it does not.
  Either way 10 SGD steps on padded batches end within 1e-5 of the steps without it, in one process; and through
  the Trainer under fsdp on 2 workers (Llama, whose padded mask met a twice-filled cache: 128 keys against 64).
- ``--init-device meta`` with no ``--init-weights``: each module initialised by ``reset_parameters()`` and then
  the ``_init_weights`` of the model that declares it (Llama's RMSNorm, GPT-2's Conv1D were refused); Llama,
  GPT-2 and T5 then train to within 10% of the eagerly built model's test perplexity, tied weights still tied
  (in one process, 20 AdamW steps; and Llama under fsdp on 2 workers through the Trainer).
"""

import importlib.util
import math
import warnings

import pytest
import torch

from phalanx import FSDP, TrainConfig, Trainer
from phalanx import recompute
from phalanx.recompute import checkpoint_blocks
from phalanx.strategies import meta_init
from phalanx.task.models import model_units
from phalanx.task.step import DefaultStep
from phalanx.checkpoint import load_checkpoint, tensors

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install -e '.[dev]')")
V, T, STEPS = 128, 24, 10  #: vocabulary, sequence length, steps


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                        num_hidden_layers=2, intermediate_size=128, vocab_size=V))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=64, n_layer=2, n_head=4))


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_heads=4, decoder_start_token_id=0, pad_token_id=0))


def bert():
    from transformers import BertConfig, BertForSequenceClassification
    return BertForSequenceClassification(BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=128,
                                                    max_position_embeddings=T, num_labels=3))


MODELS = {"llama": llama, "gpt2": gpt2, "t5": t5, "bert": bert}


def lm_data(n: int, seed: int, kind: str = "llama") -> dict:
    """Rows padded at the end by different amounts (mask 0, labels -100): each token the last + 1."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, V, (n, 1), generator=g) + torch.arange(T)) % V
    mask = (torch.arange(T) < torch.randint(T // 2, T + 1, (n, 1), generator=g)).long()
    if kind == "bert":
        return {"input_ids": ids, "attention_mask": mask, "labels": ids[:, 0] % 3}
    if kind == "t5":  # (the targets: the same sequence shifted by one, shorter)
        return {"input_ids": ids, "attention_mask": mask, "labels": ((ids[:, :T // 2] + 1) % V).contiguous()}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def train_alone(kind: str, checkpointing: bool, declared: bool = True) -> dict:
    """STEPS steps of SGD in this process (dropout on: the recomputation must draw the same masks)."""
    torch.manual_seed(0)
    model, step = MODELS[kind](), DefaultStep(torch.nn.functional.cross_entropy)
    model.train()
    if checkpointing:
        units = model_units(model)
        if not declared:  # the structural rule on the same model
            for module in model.modules():
                module.supports_gradient_checkpointing = False
        done = checkpoint_blocks(model, units, lambda: step(model, lm_data(4, 0, kind)).loss)
        assert ("'s own activation_checkpointing_enable()" in done.line()) == declared
        assert 0 < done.saved_with < done.saved_without
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in range(STEPS):
        torch.manual_seed(100 + k)
        step(model, lm_data(4, k, kind)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_activation_checkpointing_ends_ten_steps_where_the_plain_model_does(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, declared, structural = (train_alone(kind, False), train_alone(kind, True),
                                       train_alone(kind, True, declared=False))
    start = MODELS[kind]().state_dict()
    assert any(not torch.equal(start[n], plain[n]) for n in plain)  # (it trained)
    for got in (declared, structural):
        for name, want in plain.items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-5, msg=lambda m: f"{kind} {name}: {m}")


def test_the_blocks_are_the_ones_transformers_declares_and_a_cache_input_is_turned_off():
    assert [n for n, _ in model_units(llama())] == ["model.layers.0", "model.layers.1"]  # LlamaDecoderLayer
    assert [n for n, _ in model_units(t5())] == ["encoder.block.0", "encoder.block.1", "decoder.block.0",
                                                 "decoder.block.1"]
    assert [n for n, _ in model_units(bert())] == ["bert.encoder.layer.0", "bert.encoder.layer.1"]  # (embeddings: 1)
    assert recompute.declares_recompute(gpt2())

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x, cache=None, mask=None, use_cache=False):
            return self.lin(x)

    block, seen = Block(), []
    block.register_forward_pre_hook(lambda m, a, kw: seen.append((a, kw)), with_kwargs=True)
    recompute._checkpoint_each([block])
    block(torch.ones(1, 2), "a cache", mask="m", use_cache=True)
    (args, kwargs), = seen
    assert args[1] is None and kwargs == {"mask": "m", "use_cache": False}


def test_a_model_that_recomputes_by_its_own_switch_is_told_that_training_uses_no_cache():
    """Else transformers turns the cache off itself at each process's first training step, with a warning on the
    job's output from each (``use_cache=True`` is incompatible with gradient checkpointing)."""
    for make in (llama, gpt2, t5):
        model = make()
        assert model.config.use_cache  # (transformers' default)
        checkpoint_blocks(model, model_units(model))
        assert model.config.use_cache is False, make.__name__


def meta_perplexity(kind: str, meta: bool, steps: int = 20) -> float:
    """Test perplexity after ``steps`` AdamW steps in this process, the model built eagerly or on the meta device
    and materialised as fsdp's runtime does (reset_parameters, then the model's own _init_weights)."""
    torch.manual_seed(0)
    with meta_init.building(meta):
        model = MODELS[kind]()
    if meta:
        meta_init.check_initialisable(model, None)  # (the parent's check: refused before issue 41)
        meta_init.materialise(model, torch.device("cpu"))
        if kind != "llama":  # (Llama's config ties nothing)
            assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for k in range(steps):
        model(**lm_data(16, 10 + k, kind)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        return math.exp(model(**lm_data(64, 999, kind)).loss.item())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5"])
def test_built_on_meta_with_no_init_weights_it_trains_as_the_eagerly_built_model(kind):
    eager, meta = meta_perplexity(kind, False), meta_perplexity(kind, True)
    assert eager < V / 4 and abs(meta / eager - 1) < 0.10, (eager, meta)  # (measured: 0.98, 1.04, 1.01)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """Llama under fsdp on 2 workers through the Trainer, from its factory: plain, with activation checkpointing,
    and built on the meta device with no --init-weights."""
    def run(name: str, **options) -> dict:
        checkpointing = options.pop("activation_checkpointing", False)
        cfg = TrainConfig(strategy=FSDP(**options), workers=2, devices="cpu", steps=STEPS, batch_size=4,
                          optimizer="sgd", lr=0.1, activation_checkpointing=checkpointing, checkpoint_every=0,
                          progress="none", checkpoint_dir=str(tmp_path_factory.mktemp(name)))
        summary = Trainer(cfg, model=llama, train_data=lm_data(64, 1), test_data=lm_data(16, 2)).fit()
        return {"model": tensors(load_checkpoint(summary["checkpoint"]))["model"], "summary": summary}
    return {"plain": run("plain"), "recomputed": run("recomputed", activation_checkpointing=True),
            "meta": run("meta", init_device="meta")}


@pytest.mark.slow
def test_llama_under_fsdp_on_two_workers_with_activation_checkpointing_ends_where_it_does_without(fsdp_runs):
    plain, recomputed = fsdp_runs["plain"], fsdp_runs["recomputed"]
    for name, want in plain["model"].items():
        torch.testing.assert_close(recomputed["model"][name], want, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    measured = recomputed["summary"]["activation_checkpointing"]
    assert measured["blocks"] == 2 and 0 < measured["saved_bytes_with"] < measured["saved_bytes_without"]


@pytest.mark.slow
def test_llama_under_fsdp_built_on_meta_with_no_init_weights_trains_as_the_eagerly_built_one(fsdp_runs):
    eager, meta = (fsdp_runs[k]["summary"]["test_metrics"]["perplexity"] for k in ("plain", "meta"))
    assert abs(meta / eager - 1) < 0.10, (eager, meta)


# --------------------------------------------------------------------------- tokens weighed across ranks

B = 8  #: the global batch: 2 ranks x 4 rows


def tiny_gpt2() -> torch.nn.Module:
    """No dropout, float64: the comparison is exact."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)).double()


def padded(k: int) -> dict:
    """Rank 0's rows long, rank 1's short: their means over tokens weigh the tokens unequally."""
    batch = lm_data(B, k)
    lengths = torch.tensor([T, T, T - 2, T - 3, 4, 5, 3, 6])
    mask = (torch.arange(T) < lengths[:, None]).long()
    return {"input_ids": batch["input_ids"], "attention_mask": mask, "labels": batch["input_ids"].masked_fill(
        mask == 0, -100)}


def _token_run(ctx, options, accumulate: int) -> dict:
    from phalanx.strategies import runtime_for

    n = B // ctx.world_size
    mine = lambda b: {key: t[ctx.rank * n:(ctx.rank + 1) * n] for key, t in b.items()}  # noqa: E731
    runtime = runtime_for(options, ctx, tiny_gpt2(), lambda p: torch.optim.SGD(p, lr=0.5), accumulate=accumulate,
                          example=mine(padded(0)))
    for k in range(3):
        runtime.train_step(mine(padded(k)))
    state = runtime.state_dict()
    return None if state is None else state["model"]


@pytest.mark.slow
@pytest.mark.parametrize("options,accumulate", [("sync", 1), ("fsdp", 2)], ids=["sync", "fsdp accumulate 2"])
def test_ranks_with_fewer_tokens_weigh_as_many_tokens_as_one_process_on_the_whole_batch(options, accumulate):
    from helpers import run_workers
    from phalanx import Sync

    got = run_workers(_token_run, 2, Sync() if options == "sync" else FSDP(), accumulate)
    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for k in range(3):
        model(**padded(k)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(got[name], p, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")
