"""pytorch/examples' word-language-model Transformer (issue 41): its positional buffer has an odd stride
(``pe.unsqueeze(0).transpose(0, 1)``). DDP's buffer broadcast crashed sync at step 1 and fsdp's buffer broadcast
before its final evaluation crashed after every step, before the final checkpoint was written. A buffer of any
layout trains now, and a failure in the final evaluation keeps the run's last checkpoint."""

import json
from pathlib import Path

import pytest
import torch

from helpers import run_in_process
from phalanx.strategies.replicas import contiguous_buffers

HERE = Path(__file__).parent
FLAGS = ("--data", "word_lm:load", "--training-step", "word_lm:step", "--metric", "loss", "--devices", "cpu",
         "--workers", "2", "--steps", "3", "--batch-size", "4", "--eval-every", "0")


def test_a_buffer_with_an_odd_stride_is_laid_out_afresh_and_stays_shared():
    import word_lm

    model = word_lm.make()
    model.pos_encoder.register_buffer("again", model.pos_encoder.pe)  # one tensor under two names
    assert model.pos_encoder.pe.stride() == (16, 80000, 1) and model.pos_encoder.pe.is_contiguous()
    before = model.pos_encoder.pe.clone()
    contiguous_buffers(model)
    assert model.pos_encoder.pe.stride() == (16, 16, 1) and torch.equal(model.pos_encoder.pe, before)
    assert model.pos_encoder.again is model.pos_encoder.pe


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sync", "fsdp"])
def test_the_word_lm_transformer_trains_and_evaluates_under(strategy, tmp_path):
    out = run_in_process("train", "--model", "word_lm:make", *FLAGS, "--strategy", strategy,
                         "--checkpoint-dir", str(tmp_path / "ck"), cwd=HERE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "test loss" in out.stdout and list((tmp_path / "ck").glob("step-00000003.*"))


@pytest.mark.slow
def test_a_failure_in_the_final_evaluation_keeps_the_last_checkpoint(tmp_path):
    out = run_in_process("train", "--model", "word_lm:failing_evaluation", *FLAGS, "--strategy", "fsdp",
                         "--checkpoint-dir", str(tmp_path / "ck"), cwd=HERE)
    assert out.returncode != 0 and "this model cannot be evaluated" in out.stdout + out.stderr
    assert list((tmp_path / "ck").glob("step-00000003.dcp"))  # written before the evaluation that failed
    records = [json.loads(line) for line in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "checkpoint" and r.get("step") == 3 for r in records), records[-3:]
