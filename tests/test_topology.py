"""Topology: parsing real nvidia-smi outputs, islands, the CPU description, the CLI."""

import json
import os
from pathlib import Path

import pytest

from helpers import REPO, run_cli, run_in_process
from phalanx.errors import PhalanxError
from phalanx.topology import (Topology, cpu_info, order_by_islands, parse_p2p_matrix, parse_topo_matrix,
                              rank_islands)

SHARED = REPO.parent / "shared" / "fixtures" / "topology"
LOCAL = REPO / "tests" / "fixtures" / "topology"


def fixture(name: str) -> str:
    path = LOCAL / name if (LOCAL / name).exists() else SHARED / name
    if not path.exists():
        pytest.skip(f"fixture {name} not found (shared/ is expected beside the repository)")
    return path.read_text()


def test_dgx1_hybrid_cube_mesh():
    topo = Topology.from_nvidia_smi(fixture("nvlink-8gpu-dgx1-v100-hybrid-cube-mesh.txt"))
    assert topo.gpus == list(range(8))
    assert topo.links[0][:5] == ["X", "NV1", "NV1", "NV2", "NV2"] and topo.links[0][5] == "SYS"
    assert topo.cpu_affinity[0] == "0-19,40-59" and topo.cpu_affinity[7] == "20-39,60-79"
    assert topo.direct(0, 4) and not topo.direct(0, 5)  # the cross link 0-4 is NVLink, 0-5 is not
    assert topo.islands() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_two_pcie_gpus_through_the_host_bridge_tab_layout():
    text = fixture("pcie-2gpu-rtx5090-phb.txt")
    m = parse_topo_matrix(text)
    assert m.links == [["X", "PHB"], ["PHB", "X"]]
    assert m.cpu_affinity == ["0-63", "0-63"] and m.numa_affinity == ["0", "0"]
    peer = parse_p2p_matrix(fixture("pcie-2gpu-rtx5090-phb.p2p-rw.txt"))
    assert peer == [[True, False], [False, True]]  # GNS: GPU not supported
    topo = Topology.from_nvidia_smi(text, fixture("pcie-2gpu-rtx5090-phb.p2p-rw.txt"))
    assert topo.islands() == [[0], [1]]


def test_five_gpus_on_two_sockets():
    topo = Topology.from_nvidia_smi(fixture("pcie-5gpu-dual4090.txt"))
    assert topo.numa_affinity == ["1", "0", "0", "0", "0"]
    assert topo.links[1][2] == "PHB" and topo.links[1][3] == "NODE" and topo.links[0][1] == "SYS"
    assert topo.islands() == [[0], [1], [2], [3], [4]]  # nothing but host bridges between them


def test_h100_output_with_terminal_underline_codes():
    topo = Topology.from_nvidia_smi(fixture("h100-1gpu-ansi.txt"))
    assert topo.gpus == [0] and topo.cpu_affinity == ["0-15"] and topo.islands() == [[0]]


def test_pcie_pairs_from_a_peer_access_matrix():
    pairs = [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    assert Topology.from_peer_matrix(pairs).islands() == [[0, 1], [2, 3]]
    crossed = [[1, 0, 0, 1], [0, 1, 1, 0], [0, 1, 1, 0], [1, 0, 0, 1]]
    topo = Topology.from_peer_matrix(crossed)
    assert topo.islands() == [[0, 3], [1, 2]]
    order = order_by_islands([0, 1, 2, 3], topo.islands())
    assert order == [0, 3, 1, 2]  # workers follow islands, so islands are contiguous ranks
    assert rank_islands(order, topo.islands()) == [[0, 1], [2, 3]]


def test_peer_matrix_overrides_the_link_type():
    topo = Topology.from_nvidia_smi(fixture("nvlink-8gpu-dgx1-v100-hybrid-cube-mesh.txt"))
    topo.peer = [[True] * 8 for _ in range(8)]
    topo.peer[1][2] = topo.peer[2][1] = False
    assert not topo.direct(1, 2)
    islands = topo.islands()
    assert sorted(g for i in islands for g in i) == list(range(8))
    for island in islands:  # every island is still a clique
        assert all(topo.direct(a, b) for a in island for b in island)
    assert [4, 5, 6, 7] in islands


def test_garbage_is_a_clear_error():
    with pytest.raises(PhalanxError, match="no 'GPU0' header found"):
        parse_topo_matrix("hello\nworld\n")


def test_cpu_description_is_true():
    cpu = cpu_info()
    assert cpu.threads == os.cpu_count()
    assert cpu.usable == len(os.sched_getaffinity(0))
    assert 1 <= cpu.sockets <= cpu.cores <= cpu.threads
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    assert cpu.numa_nodes == nodes


@pytest.mark.slow
def test_cli_on_this_machine(tmp_path):
    out = run_cli("topology", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cpu = cpu_info()
    assert f"{cpu.threads} logical CPU" in out.stdout and f"{cpu.cores} core" in out.stdout
    as_json = json.loads(run_in_process("topology", "--json", cwd=tmp_path).stdout)  # (printed by this process)
    assert as_json["cpu"]["threads"] == cpu.threads
    if not as_json["gpus"]:
        assert "GPUs: none" in out.stdout


@pytest.mark.slow
def test_cli_from_a_saved_file(tmp_path):
    path = LOCAL / "h100-1gpu-ansi.txt"
    out = run_in_process("topology", "--from-file", str(path), cwd=tmp_path)
    assert out.returncode == 0 and "islands (devices that all reach each other directly): [0]" in out.stdout
    missing = run_in_process("topology", "--from-file", "nope.txt", cwd=tmp_path)
    assert missing.returncode == 2 and "error: cannot read nope.txt" in missing.stderr


@pytest.mark.parametrize("flags, message", [
    (["--probe", "--probe-mb", "-1"], "--probe-mb must be at least 1 MiB, got -1"),
    (["--probe", "--probe-mb", "0"], "--probe-mb must be at least 1 MiB, got 0"),
    (["--probe", "--probe-mb", ""], "--probe-mb takes a whole number of MiB"),
    (["--probe-mb", "64"], "--probe-mb 64 sizes the buffer of --probe: add --probe"),
    (["--from-file", ""], "--from-file '' names no file"),
    (["--p2p-file", "p2p.txt"], "--p2p-file goes with --from-file"),
])
def test_bad_flags_are_refused_in_one_line_before_anything_runs(flags, message, capsys):
    from phalanx.cli import main

    try:
        code = main(["topology", *flags])
    except SystemExit as e:  # argparse's own usage errors exit directly
        code = e.code
    out = capsys.readouterr()
    assert code == 2 and out.out == "", out
    assert len(out.err.strip().splitlines()) == 1 and message in out.err, out.err
