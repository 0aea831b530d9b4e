"""Bytes on the wire (wire.py): the pricing table (pure), each collective's count against the loopback's
own counters in a private network namespace, and whole training runs of sync, ps and diloco on a
shaped link, where phalanx's count must be within 10% of what the link itself counted.

The namespace tests are skipped, with the reason, where namespaces or traffic control are not allowed."""

import json
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from helpers import run_cli, run_workers
from phalanx.comm.shaped_link import loopback_counters, parse_rate, shaped
from phalanx.comm.wire import Meter, metering, traffic

MIB4 = 1 << 20  #: float32 elements in 4 MiB
TOLERANCE = 0.10  #: the issue's bound on phalanx's count against the link's


# ---- the table (pure) ----

@pytest.mark.parametrize("kind, size, root, expected", [
    ("all_reduce", 2, False, (1000, 1000)),  # ring: 2 (N - 1) / N x S each way
    ("all_reduce", 4, False, (1500, 1500)),
    ("reduce_scatter", 4, False, (1500, 1500)),  # gloo all-reduces the whole input
    ("reduce", 4, True, (750, 1500)),  # the root: its reduce-scatter share out, every share of its part in
    ("reduce", 4, False, (1000, 750)),  # the others: their share, then their part of the sum to the root
    ("all_gather", 3, False, (2000, 2000)),
    ("all_to_all", 4, False, (750, 750)),
    ("broadcast", 3, True, (2000, 0)), ("broadcast", 3, False, (0, 1000)),
    ("gather", 3, True, (0, 2000)), ("gather", 3, False, (1000, 0)),
    ("send", 2, False, (1000, 0)), ("recv", 2, False, (0, 1000)),
    ("all_reduce", 1, False, (0, 0)),  # one rank: nothing moves
])
def test_each_collective_is_priced_by_its_algorithm(kind, size, root, expected):
    assert traffic(kind, 1000, size, root) == expected


def test_the_meter_counts_only_its_window_and_not_what_is_set_aside():
    meter = Meter()
    meter.add(5, 5)
    meter.begin()
    meter.add(100, 50)
    with meter.aside():
        meter.add(1000, 1000)
    meter.end()
    meter.add(7, 7)
    assert (meter.sent, meter.received, meter.total) == (100, 50, 150)


def test_metering_puts_torch_back_as_it_was():
    before = (dist.all_reduce, dist.isend, dist.distributed_c10d.isend, funcol.all_reduce)
    with metering():
        assert dist.all_reduce is not before[0] and dist.isend is dist.distributed_c10d.isend
        assert funcol.all_reduce is not before[3]
    assert (dist.all_reduce, dist.isend, dist.distributed_c10d.isend, funcol.all_reduce) == before


def _functional(ctx):
    """What the meter counts for torch's functional collectives, the group given as DTensor gives it (a mesh and
    its dimension), as a process group and by its name."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    x = torch.ones(256)  # 1 KiB
    with metering() as meter:
        meter.begin()
        _done(funcol.all_reduce(x, "sum", (mesh, 0)))
        _done(funcol.all_gather_single(x, 0, dist.group.WORLD))
        _done(funcol.reduce_scatter_single(x, "sum", 0, (mesh, 0)))
        _done(funcol.all_reduce(x, "sum", dist.group.WORLD.group_name))  # (a group known by its name)
        _done(funcol.broadcast(x, 0, (mesh, 0)))  # (rank 0, whose meter the test reads, is the root)
        meter.end()
    return meter.sent, meter.received, meter.calls


def _done(tensor):
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def test_torchs_functional_collectives_are_counted_as_the_calls_they_make():
    # Tensor parallelism's traffic (DTensor calls these, never dist.all_reduce) was counted as nothing: a
    # Llama under --tensor-parallel 2 printed 16 B on the wire per step where the link carried 4.2 MB.
    sent, received, calls = run_workers(_functional, 2)
    expected = sum(traffic(kind, 1024, 2)[0] for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_reduce"))
    assert (sent, received, calls) == (expected + 1024, expected, 5)  # the root sends its 1 KiB, receives nothing


# ---- each collective against the loopback's counters ----

def _collectives(ctx):
    """Each collective of 4 MiB tensors, four times: what every rank's meter counted, and what the
    namespace's loopback counted meanwhile (rank 0 reads it; a barrier's few bytes are in it)."""
    n, rank = ctx.world_size, ctx.rank
    x, parts, whole = torch.ones(MIB4), [torch.ones(MIB4) for _ in range(n)], torch.ones(MIB4 * n)
    ops = {
        "all_reduce": lambda: dist.all_reduce(x),
        "broadcast": lambda: dist.broadcast(x, src=1),
        "reduce": lambda: dist.reduce(x, dst=0),
        "all_gather": lambda: dist.all_gather(parts, x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(whole, x),  # calls all_gather_single
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(x, whole),
        "gather": lambda: dist.gather(x, parts if rank == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(x, parts if rank == 2 else None, src=2),
        "all_to_all_single": lambda: dist.all_to_all_single(whole.clone(), whole),
        "send/recv": lambda: dist.send(x, 1) if rank == 0 else dist.recv(x, 0) if rank == 1 else None,
        "all_gather_object": lambda: dist.all_gather_object([None] * n, x),
        "functional all_reduce": lambda: _done(funcol.all_reduce(x, "sum", dist.group.WORLD)),
        "functional all_gather_single": lambda: _done(funcol.all_gather_single(x, 0, dist.group.WORLD)),
        "functional reduce_scatter_single": lambda: _done(funcol.reduce_scatter_single(whole, "sum", 0,
                                                                                         dist.group.WORLD)),
    }
    out = {}
    for name, op in ops.items():
        op()  # warm-up: connections made, buffers sized
        dist.barrier()
        time.sleep(0.2)  # every ack of the warm-up has crossed
        before = loopback_counters() + (_resent(),)
        dist.barrier()  # no rank sends before rank 0 has read the counter (a busy machine delays rank 0)
        with metering() as meter:
            meter.begin()
            for _ in range(4):
                op()
            meter.end()
        dist.barrier()
        time.sleep(0.2)
        after = loopback_counters() + (_resent(),)
        counted = [None] * n
        dist.all_gather_object(counted, meter.sent)
        out[name] = (sum(counted), after[0] - before[0], after[1] - before[1], after[2] - before[2])
    return out


def _resent() -> int:
    """Segments TCP sent again in this thread's namespace (its ``RetransSegs``): on a loaded machine a
    receiver not scheduled in time makes a sender retransmit, and the loopback carries those bytes twice."""
    with open("/proc/thread-self/net/snmp") as f:
        names, values = [line.split() for line in f if line.startswith("Tcp:")][:2]
    return int(values[names.index("RetransSegs")])


#: bytes of a TCP segment on the loopback beyond its payload: Ethernet, IPv4, TCP with timestamps
HEADERS = 14 + 20 + 32
MSS = 1500 - 20 - 32  #: the most payload a segment TCP sends again carries (the shaped loopback's MTU is 1,500)




@pytest.mark.slow
def test_each_collective_matches_the_loopbacks_own_count(shaping_allowed):
    """Three ranks: the sum of what every rank's meter says it sent against the payload the loopback
    carried (a fast link: 10 Gbit/s): its bytes less a TCP/IP header per packet it counted. How many
    packets (a segment of up to 64 kB under segmentation offload, an acknowledgement) depends on how
    busy the machine is: the bytes beyond the meter's count were 0.1% to 0.6% on a quiet machine and
    2.1% (gather) on a loaded one. Less the headers, what is left is gloo's small control messages, a
    barrier and, on a loaded machine, segments the token bucket dropped and TCP sent again (0.45% at
    most measured quiet, 1.0% loaded): within 2%, beyond the segments the kernel counted as sent
    again (at most an MSS each: 2.1% once under the whole suite's load; with 3 busy loops beside it,
    177 kB beyond the count with 135 segments sent again, 566 kB with 406), where a wrong count is off
    by a share of a rank's bytes (a third, here)."""
    with shaped(parse_rate("10gbit")):
        out = run_workers(_collectives, 3)
    for name, (counted, link, packets, resent) in out.items():
        assert counted > 0, name
        payload = link - HEADERS * packets
        again = resent * MSS  # at most a full segment each, sent twice
        assert -0.02 * counted <= payload - counted <= 0.02 * counted + again, \
            f"{name}: counted {counted}, the loopback carried {link} bytes in {packets} packets ({payload} of " \
            f"payload, {resent} segments sent again)"


# ---- whole runs on a shaped link ----

@pytest.mark.slow
def test_training_runs_count_within_ten_percent_of_the_links_counters(tmp_path, shaping_allowed):
    """sync, ps and diloco (2 workers, 8 steps of the digits CNN, 151k parameters) on a 1 Gbit/s shaped
    link, run by compare as a user would. Rank 0 reads the loopback's counters as the first step
    starts (the other ranks wait for it at a barrier, so none has sent a step's bytes yet) and after
    the last one, so rendezvous, start-up, the final evaluation and the checkpoint are outside both
    counts. What remains in the link's count and not in phalanx's: TCP/IP headers
    and acknowledgements, gloo's control messages, the store's progress heartbeats (four a second per
    rank) and stop checks, and the evaluations' small all-reduces (set aside by phalanx): about 0.5%
    here, measured. phalanx's count must be within 10% of the link's."""
    out = run_cli("compare", "--strategies", "sync,ps,diloco:4", "--scenarios", "link:1gbit", "--repeats", "1",
                  "--workers", "2", "--devices", "cpu", "--max-steps", "8", "--eval-every", "4", "--target", "0.99",
                  "--out", "report", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    runs = {run["strategy"]: run for run in report["runs"]}
    assert set(runs) == {"sync", "ps", "diloco:4"}
    for name, run in runs.items():
        events = [json.loads(line) for line in (tmp_path / "report" / run["metrics"]).read_text().splitlines()]
        summary = next(e for e in events if e["event"] == "summary")
        counted, link = summary["wire_bytes"], summary["link_bytes_steps"]
        assert abs(counted - link) <= TOLERANCE * link, f"{name}: phalanx counted {counted}, the link {link}"
        assert run["wire_bytes_per_step"] == counted / summary["steps"]
    gradient = 4 * 151_306  # bytes of the CNN's gradient (and of its parameters)
    per_step = {name: run["wire_bytes_per_step"] for name, run in runs.items()}
    assert per_step["sync"] >= 2 * gradient  # a ring all-reduce: each of 2 ranks sends one gradient a step
    assert per_step["ps"] >= 4 * gradient  # 2 pushes and 2 replies a step
    # diloco:4 over 8 steps syncs after steps 1 and 5 and at the last: 3 all-reduces of the parameters
    assert per_step["diloco:4"] == pytest.approx(3 * 2 * gradient / 8, rel=0.01)
    table = (tmp_path / "report" / "report.md").read_text()
    assert "| bytes/step | bytes to target |" in table
