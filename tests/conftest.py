import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    _longest_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _longest_files_first(items):
    """Files with the most whole-job tests first (a ``long`` test counts as ten ``slow`` ones), the rest in
    their usual order: the suite runs a file per test process (pytest-xdist's loadfile), and a long file
    handed out last would run alone at the end while the other processes idle. The order is the same
    in every process, as xdist needs."""
    slow = Counter()
    for item in items:
        slow[item.nodeid.split("::")[0]] += 10 if "long" in item.keywords else "slow" in item.keywords
    first = {}
    for index, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], index)
    items.sort(key=lambda item: (-slow[item.nodeid.split("::")[0]], first[item.nodeid.split("::")[0]]))
