"""The strategy's first step rehearsed in the parent (issue 41, item 3): a tensor-parallel plan applied to a copy
of the model under torch's fake process group, a pipeline's split graph run stage after stage, each on the example
batch; what would crash in a worker is one line naming the feature and the fix, before any worker starts."""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx import FSDP, PhalanxError
from phalanx.strategies import Pipeline
from phalanx.task.step import DefaultStep


class Attention(nn.Module):
    """Separate q, k, v as tensor parallelism wants them, but the heads put back with the whole width
    (nanoGPT's ``view(B, T, C)``), which a rank holding half of the heads does not have."""

    def __init__(self, width=16, heads=4):
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(width, width) for _ in range(4))
        self.n_head = heads

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (p(x).view(B, T, -1, C // 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.blocks = nn.ModuleList([nn.ModuleDict({"attn": Attention()}) for _ in range(2)])
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block["attn"](h)
        return self.head(h).transpose(1, 2)


def test_a_tensor_parallel_plan_that_cannot_run_is_refused_in_the_parent_in_one_line():
    example = (torch.randint(0, 10, (2, 6)), torch.randint(0, 10, (2, 6)))
    step, hook = DefaultStep(F.cross_entropy), sys.excepthook
    with pytest.raises(PhalanxError) as caught:
        FSDP(tensor_parallel=2).rehearse(Net(), example, step)
    message = str(caught.value)
    assert message.startswith("--tensor-parallel 2: a first step of Net with its layers split this way fails")
    assert "view(B, T, -1, head_dim)" in message and "\n" not in message
    FSDP(tensor_parallel=1).rehearse(Net(), example, step)  # (nothing split: nothing to rehearse)
    assert not torch.distributed.is_initialized()  # the fake group is gone again
    # ... and torch's hook with it, which wrote a user's later traceback as "[rank0]: Traceback ..."
    assert sys.excepthook is hook


@pytest.mark.slow
def test_a_pipeline_whose_split_graph_fails_is_refused_in_the_parent_in_one_line(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from phalanx.strategies.pipeline import trace

    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=8, num_labels=2))
    example = {"input_ids": torch.randint(0, 20, (2, 6)), "labels": torch.tensor([0, 1])}
    Pipeline(stages=2).rehearse(bert, example, DefaultStep(F.cross_entropy))  # BERT's 'self' traced under an alias
    monkeypatch.setattr(trace, "SHADOWING", ())  # as it was traced before: the crash issue 41 saw in stage 1
    with pytest.raises(PhalanxError, match=r"^--strategy pipeline: BertForSequenceClassification split at "
                                           r"bert.encoder.layer.0, bert.encoder.layer.1 fails in its first step "
                                           r"\(AttributeError: 'Tensor' object has no attribute 'output'\)"):
        Pipeline(stages=2).rehearse(bert, example, DefaultStep(F.cross_entropy))


@pytest.mark.slow
@pytest.mark.parametrize("flags, plan", [
    (("--strategy", "fsdp", "--tensor-parallel", "2"), "attention.self.query column-wise"),
    (("--strategy", "pipeline", "--stages", "2"), "into 2 stages"),
])
def test_bert_trains_through_the_cli_under(flags, plan, tmp_path):
    pytest.importorskip("transformers")
    from pathlib import Path

    from helpers import run_in_process

    out = run_in_process("train", "--model", "hf_models:bert", "--data", "hf_models:classes", "--metric", "loss",
                         "--devices", "cpu", "--workers", "2", "--steps", "2", "--batch-size", "4", "--eval-every",
                         "0", *flags, "--checkpoint-dir", str(tmp_path / "ck"), cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert plan in out.stdout and "test loss" in out.stdout
