"""CUDA paths (marked gpu: skipped where no CUDA device exists)."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from phalanx import TrainConfig, Trainer
from phalanx.data import Prefetcher, ShardedBatches, load_digits
from phalanx.launcher import WorkerContext
from phalanx.strategies import Sync, runtime_for
from phalanx.checkpoint import latest_checkpoint

pytestmark = pytest.mark.gpu


def test_pinned_prefetch_delivers_the_same_batches_on_the_gpu():
    data = load_digits().train
    cpu = ShardedBatches(data, 32)(0)
    gpu = Prefetcher(ShardedBatches(data, 32)(0), torch.device("cuda", 0), depth=3)
    for _ in range(10):
        (xc, yc), (xg, yg) = next(cpu), next(gpu)
        assert xg.is_cuda and yg.is_cuda
        assert torch.equal(xg.cpu(), xc) and torch.equal(yg.cpu(), yc)
    gpu.close()


def test_train_on_one_gpu(tmp_path):
    cfg = TrainConfig(devices="cuda", steps=200, progress="none", checkpoint_dir=str(tmp_path))
    summary = Trainer(cfg).fit()
    assert summary["world_size"] == 1 and summary["test_accuracy"] >= 0.95
    state = torch.load(latest_checkpoint(tmp_path), weights_only=True)
    assert all(t.device.type == "cpu" for t in state["model"].values())  # loads anywhere


def test_sync_over_nccl_with_world_size_one_matches_plain_training():
    """DDP over a real NCCL group of one rank computes what a bare model computes."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        ctx = WorkerContext(0, 1, 0, torch.device("cuda", 0), "nccl")
        torch.manual_seed(0)
        bare = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).cuda()
        twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).cuda()
        twin.load_state_dict(bare.state_dict())
        loss_fn = torch.nn.functional.cross_entropy
        strategy = runtime_for(Sync(), ctx, twin, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn)
        opt = torch.optim.SGD(bare.parameters(), lr=0.1)
        for step in range(5):
            x = torch.randn(32, 8, device="cuda")
            y = torch.randint(0, 3, (32,), device="cuda")
            strategy.train_step(x, y)
            opt.zero_grad()
            loss_fn(bare(x), y).backward()
            opt.step()
        for a, b in zip(bare.parameters(), strategy.module.parameters()):
            torch.testing.assert_close(a, b)
    finally:
        dist.destroy_process_group()
