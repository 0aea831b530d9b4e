"""2-stage pipelines of transformers' BERT (sequence classification) and T5 (issue 41, item 2), built from small
configs and called as their authors call them (``model(**batch)``, their own loss on ``labels``), against one
process on the same global batches (what sync computes at that batch; float64).

BERT names a submodule ``self`` (``BertAttention.self``): the traced graph's generated code named a local variable
after it and crashed in stage 1 (``'Tensor' object has no attribute 'output'``); it is traced under an alias and
its tensors mapped back, so checkpoints keep the model's own keys (``assert_same`` compares them in order)."""

import pytest
import torch
import torch.nn.functional as F

from helpers import run_workers
from test_pipeline_models import K, _pipeline_run, _sgd, assert_same, reference
from phalanx.task.step import DefaultStep

transformers = pytest.importorskip("transformers")

VOCAB = 40


def bert():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).double()


def t5():
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0)).double()


def batches(name: str) -> list:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(K):
        ids = torch.randint(1, VOCAB, (8, 12), generator=g)
        labels = torch.randint(0, 3, (8,), generator=g) if name == "bert" else torch.randint(1, VOCAB, (8, 6),
                                                                                             generator=g)
        out.append({"input_ids": ids, "labels": labels})
    return out


MODELS = {"bert": bert, "t5": t5}


def _workers(ctx) -> dict:
    return {name: _pipeline_run(ctx, make, batches(name), None, _sgd, None) for name, make in MODELS.items()}


@pytest.fixture(scope="module")
def pipelined() -> dict:
    return run_workers(_workers, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_a_two_stage_pipeline_of_a_transformers_model_equals_one_process_at_the_same_global_batch(pipelined, name):
    want = reference(MODELS[name](), batches(name), DefaultStep(F.cross_entropy), _sgd, None)
    assert_same(pipelined[name], want, 1e-9, 1e-12, name)
    assert "into 2 stages" in pipelined[name]["notes"][0]


def test_a_submodule_named_self_is_traced_under_an_alias_and_given_back():
    from phalanx.strategies.pipeline.trace import _original, _unshadowed

    model = bert()
    keys = list(model.state_dict())
    with _unshadowed(model) as aliases:
        assert "bert.encoder.layer.0.attention.self_" in dict(model.named_modules())
        assert model.bert.encoder.layer[0].attention.self is model.bert.encoder.layer[0].attention.self_
    assert _original("bert.encoder.layer.0.attention.self_.query.weight", aliases) == \
        "bert.encoder.layer.0.attention.self.query.weight"
    assert list(model.state_dict()) == keys and "self" not in vars(model.bert.encoder.layer[0].attention)
