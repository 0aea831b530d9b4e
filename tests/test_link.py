"""A real slow link (--link RATE, compare's link:RATE): the kernel shapes the job's loopback in a
private network namespace. The rate is checked against gloo's own all-reduce on the shaped link
(and its byte counters), the CLI end to end, and the refusals: bad rates, and a process that may
not make a namespace or shape a link (capabilities really dropped with setpriv).

Skipped, with the reason, where this machine does not allow namespaces and traffic control."""

import json
import os
import shutil
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from helpers import phalanx_cmd, run_cli, run_in_process, run_workers
from phalanx import PhalanxError
from phalanx.cli import main
from phalanx.compare.tokens import parse_scenarios
from phalanx.comm.shaped_link import parse_rate, shaped

SIZE_BYTES = 2 * 1024 * 1024  #: the all-reduced tensor: 2 MiB of float32
REPEATS = 3
RATE = "50mbit"


# ---- the rate (pure) ----

@pytest.mark.parametrize("text, bits", [("50mbit", 50e6), ("1gbit", 1e9), ("250kbit", 250e3), ("12mbps", 96e6),
                                        ("1.5Mbit", 1.5e6), (" 100MBIT ", 100e6)])
def test_rates_are_tcs_units(text, bits):
    assert parse_rate(text).bits_per_s == bits


@pytest.mark.parametrize("text, message", [
    ("fast", "--link fast is not a rate: give a number and a unit, kbit, mbit or gbit"),
    ("100", "--link 100 is not a rate"),
    ("100mbits", "--link 100mbits is not a rate"),
    ("0mbit", "--link 0mbit: a link's rate must be positive"),
    ("0.5kbit", "--link 0.5kbit: a link's rate must be at least 1kbit"),
    ("1e999mbit", "--link 1e999mbit is not a finite rate"),
])
def test_bad_rates_name_the_fix(text, message):
    with pytest.raises(PhalanxError, match=message):
        parse_rate(text)


def test_link_scenarios_parse_like_the_flag():
    none, link = parse_scenarios("none,link:50MBIT")
    assert (link.token, link.slowness, link.link.bits_per_s) == ("link:50mbit", None, 50e6) and none.link is None
    assert link.describe() == "a real 50 Mbit/s link shared by every worker"
    with pytest.raises(PhalanxError, match="--scenarios: link:fast is not a rate"):
        parse_scenarios("link:fast")


def test_the_namespace_is_left_on_the_way_out_even_on_error(shaping_allowed):
    home = os.readlink("/proc/thread-self/ns/net")
    with shaped(parse_rate("10mbit")) as link:
        assert os.readlink("/proc/thread-self/ns/net") != home
        assert link.bytes() == 0  # a fresh loopback: nothing has crossed it yet
        assert "tbf" in subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    assert os.readlink("/proc/thread-self/ns/net") == home
    with pytest.raises(RuntimeError), shaped(parse_rate("10mbit")):
        raise RuntimeError("the job failed")
    assert os.readlink("/proc/thread-self/ns/net") == home


# ---- gloo's all-reduce on the shaped link ----

def _lo_bytes() -> int:
    for line in open("/proc/self/net/dev"):
        name, _, values = line.partition(":")
        if name.strip() == "lo":
            return int(values.split()[8])
    raise AssertionError("no lo")


def _timed_all_reduce(ctx, numel, repeats):
    """Rank 0's seconds for ``repeats`` all-reduces, the bytes its loopback sent meanwhile, and its parent's pid."""
    x = torch.ones(numel)
    dist.all_reduce(x)  # warm-up: gloo's connections are made and its buffers sized
    dist.barrier()
    before, began = _lo_bytes(), time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(x)
    # Rank 0's last all-reduce returns once its final send is queued, possibly still waiting in the
    # shaper: the barrier returns only once rank 1 has received it, so the counters include it.
    dist.barrier()
    return time.perf_counter() - began, _lo_bytes() - before, os.getppid()


@pytest.mark.slow
def test_all_reduce_on_a_shaped_link_runs_at_the_links_rate(shaping_allowed):
    """Two ranks all-reduce 2 MiB three times. Whatever gloo's algorithm, each rank must send the other
    at least half of the buffer in each of two phases (reduce-scatter, all-gather): 2 x (W-1)/W x size
    per rank, 2 x size for W = 2 on the one shared link. The counters must show at least that, and
    bytes / time must be the link's rate; the unshaped loopback, in the same test, is far faster. The workers are
    forks of the fork server (not this process's children), started outside the namespace they joined."""
    rate = parse_rate(RATE)
    numel = SIZE_BYTES // 4
    with shaped(rate):
        seconds, sent, parent = run_workers(_timed_all_reduce, 2, numel, REPEATS)
    unshaped_seconds, _, _ = run_workers(_timed_all_reduce, 2, numel, REPEATS)
    assert parent != os.getpid()
    least = 2 * SIZE_BYTES * REPEATS
    assert sent >= least, f"{sent} bytes crossed the link, fewer than the all-reduces must send ({least})"
    achieved = sent * 8 / seconds
    assert 0.5 * rate.bits_per_s <= achieved <= 1.1 * rate.bits_per_s, \
        f"{achieved / 1e6:.1f} Mbit/s achieved on a {rate.describe()} link ({sent} bytes in {seconds:.2f} s)"
    assert seconds >= 0.8 * least * 8 / rate.bits_per_s
    assert seconds > 5 * unshaped_seconds, f"shaped {seconds:.2f} s vs unshaped {unshaped_seconds:.3f} s"


# ---- the command ----

def _one_line_refusal(code, stdout, stderr) -> str:
    assert code == 2, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.mark.parametrize("flags, message", [
    (["--link", "fast"], "--link fast is not a rate"),
    (["--link", "0mbit"], "--link 0mbit: a link's rate must be positive"),
    (["--link", "50mbit", "--workers", "1"], "--link 50mbit shapes the traffic between processes, and this job"),
    (["--link", "50mbit", "--master-addr", "10.1.2.3"], "--master-addr 10.1.2.3 does not exist"),
])
def test_train_refuses_a_link_it_cannot_run_in_one_line(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["train", "--devices", "cpu", "--steps", "2", *flags])
    except SystemExit as e:  # argparse's usage error
        code = e.code
    out = capsys.readouterr()
    assert message in _one_line_refusal(code, out.out, out.err)
    assert not os.listdir(tmp_path)  # nothing started, nothing written


@pytest.mark.parametrize("dropped, says", [
    ("-sys_admin,-net_admin", "needs a private network namespace, which this process may not create (unshare: "
                              "Operation not permitted)"),
    ("-net_admin", "could not be set up (ip: RTNETLINK answers: Operation not permitted)"),
], ids=["no-namespace", "no-traffic-control"])
@pytest.mark.slow
def test_where_links_are_not_allowed_nothing_starts(tmp_path, shaping_allowed, dropped, says):
    """The capabilities really dropped (as root, setpriv's bounding set; as another user, none to drop)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the capabilities")
    out = subprocess.run(["setpriv", f"--bounding-set={dropped}", *phalanx_cmd(), "train", "--link", "50mbit",
                          "--devices", "cpu", "--workers", "2", "--steps", "2"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    line = _one_line_refusal(out.returncode, out.stdout, out.stderr)
    assert says in line and "the simulation (compare --simulate)" in line, line
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_train_on_a_shaped_link_reports_the_links_bytes(tmp_path, shaping_allowed):
    out = run_cli("train", "--link", "100mbit", "--steps", "5", "--devices", "cpu", "--workers", "2",
                  "--checkpoint-dir", "ck", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "link 100mbit (100 Mbit/s, kernel-shaped loopback): " in out.stdout
    events = [json.loads(line) for line in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    summary, link = events[-2], events[-1]
    assert (summary["event"], link["event"], link["link"], link["link_steps"]) == ("summary", "link", "100mbit", 5)
    # DDP all-reduces every gradient each step: at least 2 x the gradients' bytes cross the link per step (W = 2)
    assert link["link_bytes_per_step"] >= 2 * summary["memory_bytes"]["gradients"]
    assert link["link_bytes"] == link["link_bytes_per_step"] * 5


@pytest.mark.slow
def test_compare_runs_a_link_scenario_on_the_shaped_link(tmp_path, shaping_allowed):
    out = run_in_process("compare", "--strategies", "sync", "--scenarios", "link:100mbit", "--repeats", "1",
                         "--workers", "2", "--devices", "cpu", "--max-steps", "4", "--eval-every", "2", "--target",
                         "0.99", "--out", "report", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "link:100mbit (a real 100 Mbit/s link shared by every worker)" in out.stdout
    run, = json.loads((tmp_path / "report" / "report.json").read_text())["runs"]
    assert run["scenario"] == "link:100mbit" and run["link_bytes"] > 0
    events = [json.loads(line) for line in (tmp_path / "report" / run["metrics"]).read_text().splitlines()]
    assert events[-1]["event"] == "link" and events[-1]["link_bytes"] == run["link_bytes"]
