import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def shaping_allowed():
    """Probe once: a namespace, its loopback up, a tbf on it (what --link does); else skip, saying why."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (iproute2, util-linux)")
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up && tc qdisc add dev lo root tbf rate 1mbit "
                            "burst 32kb latency 100ms"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"network namespaces or traffic control not allowed here: {probe.stderr.strip()}")
