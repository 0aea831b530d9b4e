"""Synchronous training with backup workers: the aggregation rule as pure logic, every gradient
applied once or counted as dropped, and the report of what was dropped. (Backup(0) == sync, with
and without buffers, and a killed worker: tests/test_async.py, beside ssp:0 and ps.)"""

import json
import re

import pytest

from helpers import only_run, run_in_process
from phalanx.strategies.ps.aggregate import Asynchronous, Rounds


def test_asynchronous_rule_takes_every_gradient_alone_scaled_by_one_over_w():
    rule = Asynchronous(3)
    assert rule.admits(used=0, current=9)  # however stale
    assert rule.quorum(live=3) == rule.quorum(live=1) == 1
    assert rule.weight(1) == pytest.approx(1 / 3) and rule.per_step == 3  # W gradients make one step


def test_rounds_average_the_first_w_minus_b_fresh_gradients():
    rule = Rounds(4, 1)
    assert rule.admits(used=5, current=5) and not rule.admits(used=4, current=5)  # a late one is dropped
    assert rule.quorum(live=4) == 3
    assert rule.quorum(live=3) == 3  # a lost worker takes a backup's place first
    assert rule.quorum(live=2) == 2  # then every live worker's gradient is awaited
    assert rule.weight(3) == pytest.approx(1 / 3) and rule.per_step == 1  # the mean; one update is one step
    sync_like = Rounds(3, 0)
    assert sync_like.quorum(live=3) == 3 and sync_like.weight(3) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        Rounds(2, 2)


@pytest.fixture(scope="module")
def straggling_backup(tmp_path_factory):
    """3 workers, 1 backup, worker 3 four times as slow: most of its gradients arrive late."""
    root = tmp_path_factory.mktemp("backup")
    out = run_in_process("train", "--strategy", "backup", "--backup-workers", "1", "--workers", "3", "--straggler",
                         "3:4", "--steps", "40", "--log-every", "20", "--eval-every", "20", cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    events = [json.loads(line) for line in (only_run(root) / "metrics.jsonl").read_text().splitlines()]
    return out.stdout, events


@pytest.mark.slow
def test_every_gradient_is_applied_once_or_counted_as_dropped(straggling_backup):
    _, events = straggling_backup
    s = events[-1]
    pushed = sum(s["gradients_pushed"].values())
    assert pushed == s["gradients_applied_total"] + s["gradients_dropped_total"]
    assert s["gradients_applied_total"] == 40 * 2  # each of the 40 updates averaged W - B = 2 gradients
    assert s["gradients_dropped_total"] == sum(s["gradients_dropped"].values()) > 0
    assert s["staleness_max"] == 0  # only gradients computed on the current parameters are applied
    assert s["reply_versions_out_of_order"] == 0


@pytest.mark.slow
def test_what_was_dropped_is_reported_by_worker(straggling_backup):
    stdout, events = straggling_backup
    s = events[-1]
    total, of = s["gradients_dropped_total"], s["gradients_applied_total"] + s["gradients_dropped_total"]
    line = re.search(r"^dropped (\d+) of (\d+) gradients \((\d+\.\d)%\)(, all from worker \d|: .*)$", stdout, re.M)
    assert line, stdout
    assert (int(line.group(1)), int(line.group(2))) == (total, of)
    assert float(line.group(3)) == round(100 * total / of, 1)
    by_worker = {w: n for w, n in s["gradients_dropped"].items() if n}
    if len(by_worker) == 1:
        assert line.group(4) == f", all from worker {next(iter(by_worker))}"
    assert "strategy backup (parameter server, synchronous with 1 backup worker)" in stdout


@pytest.mark.slow
def test_the_straggler_is_calibrated_compute_and_said_so(straggling_backup):
    stdout, events = straggling_backup
    straggle = next(e for e in events if e["event"] == "straggle")
    assert straggle["scenario"] == "slow:3:4" and list(straggle["calibrated_compute_s"]) == ["3"]
    c = straggle["calibrated_compute_s"]["3"]
    assert re.search(rf"^straggler: rank 3 is 4x as slow: its compute takes {c * 1e3:.1f} ms a step \(calibrated\), so "
                     rf"it sleeps {(4 - 1) * c * 1e3:.1f} ms after every step$", stdout, re.M), stdout
