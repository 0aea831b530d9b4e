import pytest
import torch

from phalanx.devices import backend_for, resolve_devices
from phalanx.errors import PhalanxError

CPU = torch.device("cpu")


@pytest.fixture
def gpus(monkeypatch):
    """Pretend the machine has n CUDA devices (device parsing only asks for the count)."""

    def set_count(n: int):
        monkeypatch.setattr("phalanx.devices.cuda_count", lambda: n)

    return set_count


def test_cpu_and_counts_without_gpus(gpus):
    gpus(0)
    assert resolve_devices("cpu") == [CPU]
    assert resolve_devices("auto") == [CPU]
    assert resolve_devices(3) == [CPU] * 3
    assert resolve_devices(["cpu", "cpu"]) == [CPU, CPU]
    assert resolve_devices(torch.device("cpu")) == [CPU]


def test_cuda_specs_with_gpus(gpus):
    gpus(4)
    assert resolve_devices("auto") == [torch.device("cuda", i) for i in range(4)]
    assert resolve_devices("cuda") == [torch.device("cuda", i) for i in range(4)]
    assert resolve_devices("cuda:0,2") == [torch.device("cuda", 0), torch.device("cuda", 2)]
    assert resolve_devices(" CUDA:1 ") == [torch.device("cuda", 1)]
    assert resolve_devices(2) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert resolve_devices(["cuda:1", "cuda:1"]) == [torch.device("cuda", 1)] * 2


def test_soft_placement_falls_back_with_one_warning(gpus):
    gpus(0)
    with pytest.warns(UserWarning, match="falling back to the CPU") as record:
        assert resolve_devices("cuda:0,1") == [CPU, CPU]
    assert len(record) == 1


def test_strict_placement_refuses(gpus):
    gpus(0)
    with pytest.raises(PhalanxError, match="no CUDA device exists here; use --devices cpu"):
        resolve_devices("cuda", strict=True)


def test_missing_gpu_index_names_what_exists(gpus):
    gpus(2)
    with pytest.raises(PhalanxError, match=r"cuda:3 requested but only 2 CUDA devices exist \(cuda:0, cuda:1\)"):
        resolve_devices("cuda:3")
    with pytest.raises(PhalanxError, match="3 devices requested but only 2"):
        resolve_devices(3)


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", "cpu:0", "gpu:1", "", [], 0, -1, True])
def test_unknown_specs_are_clear_errors(gpus, bad):
    gpus(0)
    with pytest.raises(PhalanxError):
        resolve_devices(bad)


def test_backend_choice():
    assert backend_for([CPU, CPU]) == "gloo"
    assert backend_for([torch.device("cuda", 0)]) == "nccl"
    with pytest.raises(PhalanxError, match="not a mix"):
        backend_for([CPU, torch.device("cuda", 0)])
