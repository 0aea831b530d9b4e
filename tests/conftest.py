import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Before torch loads OpenMP (its libgomp reads this once): idle OpenMP threads sleep at once instead of spinning.
# The suite runs 3 test processes on 2 cores, each with a torch of 2 threads, and the phalanx jobs they start
# beside them; spinning threads then take the cores from the ones with work. Measured on the GPT example's plain
# loop test, beside other work (load average 4): 44 s spinning (the default), 12 s passive. A test setting, not
# phalanx's: its workers are given the cores to themselves (threads per worker = cores / workers).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _compile_the_package() -> None:
    """Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE, set on the machines this suite runs on), every
    interpreter the suite starts (a command, its fork server, a torchrun worker, a script: 238 a run, counted) would
    compile phalanx from its sources, as nothing compiled the editable install: importing its modules takes 0.46 to
    0.63 s of CPU so, 0.22 to 0.31 s from bytecode (measured on this 2-core machine). Compiled here once, as pip
    compiles an installed package (``__pycache__``, ignored by git; a module whose source changed since is compiled
    again)."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTEST_XDIST_WORKER"):
        import compileall

        compileall.compile_dir(Path(__file__).resolve().parents[1] / "src" / "phalanx", quiet=1)


_compile_the_package()

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_finish(session):
    # What collection imported (torch, transformers, every test module: millions of objects) lives as long as the
    # process: out of the collector's sight, a full collection scans only what the tests made. Measured on four
    # in-process files (test_fsdp, test_any_model, test_pipeline_models, test_training): 1.23 -> 0.84 s of GC.
    gc.freeze()


#: The files whose tests take longest, longest first: the wall seconds of their tests on this 2-core machine under the
#: whole suite at -n 4 (test_exit.py 223 s down to test_hf_models.py 39 s; the rest take less). xdist hands out whole
#: files (--dist loadfile, --no-loadscope-reorder) in the order collected: these start first and the short files fill in
#: at the end (by default xdist orders files by their number of tests, and test_torchrun_elastic.py, 2 tests and 77 s,
#: would start last and run alone for a minute).
LONGEST_FIRST = ("test_exit.py", "test_faults.py", "test_async.py", "test_estimate.py", "test_recipes.py",
                 "test_gpt_example.py", "test_pipeline_models.py", "test_torchrun_elastic.py", "test_pipeline_cli.py",
                 "test_examples.py", "test_startup.py", "test_fsdp.py", "test_any_model.py", "test_rundir.py",
                 "test_pipeline_checkpoint.py", "test_cli.py", "test_flags.py", "test_sharded_checkpoint.py",
                 "test_pipeline_dp.py", "test_hot_path.py", "test_pipeline_hf.py", "test_hf_models.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest as collected)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _each_test_imports_its_own_project(tmp_path_factory):
    """What resolving a test project's import paths in this process leaves (``sys.path``, ``PYTHONPATH``, its
    modules) is undone after the test, as a process of its own would leave nothing: xdist runs many files in one
    process, and a later file's ``mymod`` must be imported from its own folder, not found cached from another's."""
    path, pythonpath = list(sys.path), os.environ.get("PYTHONPATH")
    yield
    sys.path[:] = path
    if pythonpath is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = pythonpath
    base = str(tmp_path_factory.getbasetemp())
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(base):
            del sys.modules[name]


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
