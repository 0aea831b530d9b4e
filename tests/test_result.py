"""``Trainer.fit()``'s typed result: attributes for the figures, a mapping of exactly the summary's keys, and the
same shape when a restarted attempt finds its run already complete (no processes: summaries as runs record them)."""

import json

import pytest

from phalanx import TrainResult

SUMMARY = {"event": "summary", "time": 1.0, "steps": 60, "test_accuracy": 0.97, "test_metrics": {"accuracy": 0.97},
           "held_out": "test", "examples_per_sec": 5000.0, "checkpoint": "runs/ps-1/step-00000060.pt",
           "metrics": "runs/ps-1/metrics.jsonl", "stopped_by": None, "strategy": "ps", "staleness_mean": 1.5,
           "gradients_applied_total": 121}


def test_the_figures_are_attributes_and_the_summary_reads_as_before():
    result = TrainResult.from_summary(SUMMARY)
    assert (result.steps, result.test_accuracy, result.strategy, result.already_complete) == (60, 0.97, "ps", False)
    assert result.extra == {"staleness_mean": 1.5, "gradients_applied_total": 121}  # the strategy's own figures
    assert result["gradients_applied_total"] == 121 and result["stopped_by"] is None
    assert "memory_bytes_max" not in result and result.memory_bytes_max is None  # not in this summary
    with pytest.raises(KeyError):
        result["memory_bytes_max"]
    expected = {k: v for k, v in SUMMARY.items() if k not in ("event", "time")}
    assert result.to_dict() == expected and dict(result) == expected
    assert json.loads(json.dumps(result.to_dict())) == expected


def test_a_run_found_complete_returns_the_summary_it_wrote(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"event": "step", "step": 60}) + "\n" + json.dumps(SUMMARY) + "\n{\"cut by a k")
    found = TrainResult.complete(60, str(tmp_path / "step-00000060.pt"), None)  # the metrics beside the checkpoint
    assert found.already_complete and found.test_accuracy == 0.97 and found.extra["staleness_mean"] == 1.5
    assert found.checkpoint == str(tmp_path / "step-00000060.pt")
    bare = TrainResult.complete(80, "runs/x/step-00000080.pt", str(metrics))  # its summary is of another step
    assert (bare.steps, bare.test_accuracy, bare.already_complete) == (80, None, True)
    assert set(bare) == {"steps", "checkpoint", "already_complete"}
