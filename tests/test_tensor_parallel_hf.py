"""fsdp's ``--tensor-parallel 2`` on the transformers people bring (issue 41, item 1), built from small configs:
Llama (grouped-query attention: 4 query heads, 2 key/value heads; the plan its config declares), GPT-2 (fused q,k,v
and transposed ``Conv1D`` projections, by structure), BERT (q, k, v in one module, the output projection in the
next, by structure), T5 (its relative position bias split by heads with them), Qwen3 (per-head q and k norms kept
whole, their gradients summed over the tp ranks) and Phi-3 (fused q,k,v and gate-up projections, their outputs
gathered: the plan it declares). fsdp x tensor parallel 2 on 4 gloo workers ends where fsdp on 4 workers ends, which
is where one process ends on the whole batch (tests/test_fsdp.py): that process is the reference (float64, AdamW,
clipping; one spawn trains every model)."""

import pytest
import torch

from helpers import run_workers
from phalanx import FSDP, PhalanxError
from phalanx.strategies import Job, runtime_for
from phalanx.strategies.fsdp import shard_units, tensor_parallel

transformers = pytest.importorskip("transformers")

K, BATCH, LENGTH, VOCAB = 3, 8, 8, 64
CPU4 = (torch.device("cpu"),) * 4


def llama(**changes):
    torch.manual_seed(0)
    config = {**dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                     intermediate_size=64, vocab_size=VOCAB), **changes}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32,
                                                                n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def bert():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=LENGTH, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def t5():
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0))


def qwen3():  # per-head q and k norms, kept whole on every tp rank (replicated_with_grad_allreduce)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=LENGTH))


def phi3():  # fused q,k,v and fused gate and up, their outputs gathered (colwise_gather_output, rowwise_split_input)
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LENGTH, pad_token_id=0, bos_token_id=0, eos_token_id=0))


MODELS = {"llama": llama, "gpt2": gpt2, "bert": bert, "t5": t5, "qwen3": qwen3, "phi3": phi3}


def batch(name: str, part: int, parts: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    labels = torch.randint(0, 3, (BATCH,), generator=g) if name == "bert" else ids
    n = BATCH // parts
    return {"input_ids": ids[part * n:(part + 1) * n], "labels": labels[part * n:(part + 1) * n]}


def sgd(params):
    return torch.optim.AdamW(params, lr=1e-2)


def hf_step(model, batch):
    return model(**batch).loss


def train(ctx, tp: int) -> dict:
    """K steps of each model in float64; data group ``rank // tp`` reads its share of the batch."""
    torch.set_default_dtype(torch.float64)
    try:
        groups, out = ctx.world_size // tp, {}
        for name, make in MODELS.items():
            model = make()
            runtime = runtime_for(FSDP(tensor_parallel=tp), ctx, model, sgd, training_step=hf_step,
                                  example=batch(name, 0, groups), clip_grad_norm=1.0)
            for _ in range(K):
                runtime.train_step(batch(name, ctx.rank // tp, groups))
            state = runtime.state_dict()
            out[name] = None if state is None else {"model": state["model"], "notes": runtime.notes}
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def one_process() -> dict:
    """What fsdp on 4 workers computes (tests/test_fsdp.py): the plain model on the whole batch, clipped as fsdp
    clips, in this process."""
    torch.set_default_dtype(torch.float64)
    try:
        out = {}
        for name, make in MODELS.items():
            model = make()
            opt = sgd(model.parameters())
            for _ in range(K):
                hf_step(model, batch(name, 0, 1)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            out[name] = {"model": model.state_dict()}
        return out
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.fixture(scope="module")
def runs():
    return {1: one_process(), 2: run_workers(train, 4, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_fsdp_by_tensor_parallel_2_on_4_workers_equals_fsdp_on_4_workers(runs, name):
    """(fsdp on 4 workers equals one process on the whole batch: tests/test_fsdp.py; the reference is that.)"""
    want, got = runs[1][name]["model"], runs[2][name]["model"]
    start = MODELS[name]().state_dict()
    assert max((want[k] - start[k].to(want[k].dtype)).abs().max().item() for k in want) > 1e-3  # trained
    assert any("mesh (2 shard x 2 tp)" in note for note in runs[2][name]["notes"])
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-4, msg=key)


# --------------------------------------------------------------------------- the plan, in the parent


def plan(model, n=2):
    return tensor_parallel.model_plan(model, shard_units(model), n)


def test_llamas_declared_plan_is_used_and_its_key_value_heads_counted():
    first = plan(llama())["model.layers.0"]
    assert first["self_attn.k_proj"] == "column-wise" and first["self_attn.o_proj"] == "row-wise"
    assert first["mlp.down_proj"] == "row-wise" and "model.embed_tokens" not in first
    with pytest.raises(PhalanxError, match=r"LlamaForCausalLM has 3 key/value heads, which do not split between 2"):
        plan(llama(hidden_size=48, num_attention_heads=6, num_key_value_heads=3))


def test_the_splits_transformers_declares_beyond_colwise_and_rowwise_are_planned_and_the_others_refused():
    first = plan(qwen3())["model.layers.0"]
    assert first["self_attn.q_norm"] == first["self_attn.k_norm"] == "whole (gradient summed over the tp ranks)"
    assert first["self_attn.q_proj"] == "column-wise" and first["self_attn.o_proj"] == "row-wise"
    assert plan(phi3())["model.layers.1"] == {
        "self_attn.qkv_proj": "column-wise (output gathered)", "self_attn.o_proj": "row-wise (input split here)",
        "mlp.gate_up_proj": "column-wise (output gathered)", "mlp.down_proj": "row-wise (input split here)"}
    moe = llama()
    moe._tp_plan = {**moe._tp_plan, "model.layers.*.mlp.gate_proj": "packed_colwise"}  # (as an MoE's experts declare)
    with pytest.raises(PhalanxError) as refused:
        plan(moe)
    assert str(refused.value) == (
        "--tensor-parallel: LlamaForCausalLM declares 'model.layers.*.mlp.gate_proj': 'packed_colwise', a split "
        "phalanx does not apply inside a block (it applies colwise, rowwise, colwise_gather_output, "
        "rowwise_split_input and replicated_with_grad_allreduce); drop --tensor-parallel")


def test_gpt2_and_bert_are_planned_by_structure():
    assert plan(gpt2())["transformer.h.0"] == {"attn.c_attn": "fused q,k,v (whole, split by heads)",
                                               "attn.c_proj": "row-wise", "mlp.c_fc": "column-wise",
                                               "mlp.c_proj": "row-wise"}
    assert plan(bert())["bert.encoder.layer.1"] == {
        "attention.self.query": "column-wise", "attention.self.key": "column-wise",
        "attention.self.value": "column-wise", "attention.output.dense": "row-wise",
        "intermediate.dense": "column-wise", "output.dense": "row-wise"}


def test_t5s_relative_position_bias_is_split_by_heads_with_them():
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0))
    first = plan(t5)["encoder.block.0"]
    assert first["layer.0.SelfAttention.relative_attention_bias"] == "column-wise"
    assert first["layer.0.SelfAttention.o"] == "row-wise"
    with pytest.raises(PhalanxError, match=r"'encoder.block.0.layer.0.SelfAttention' has 4 heads, .* between 8"):
        FSDP(tensor_parallel=8).layout(Job((torch.device("cpu"),) * 8, 8, model=t5))
