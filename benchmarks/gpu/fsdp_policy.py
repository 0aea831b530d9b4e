"""fsdp's mixed precision on a GPU (issue 32): the policy phalanx chooses for ``--precision bf16`` on CUDA, given to
``fully_shard`` on a one-rank NCCL mesh: each block's forward sees bf16 parameters, the sharded parameters and
their gradients stay fp32. UNTESTED: written without a GPU; run by ``benchmarks/gpu/check.sh``.

    python3 benchmarks/gpu/fsdp_policy.py
"""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from phalanx.precision import Precision


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    policy = Precision("bf16", "cuda").sharded_policy()
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).cuda()
    seen = []
    for block in (model[0], model[2]):
        block.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    with Precision("bf16", "cuda").autocast():
        loss = model(torch.randn(8, 64, device="cuda")).float().square().mean()
    loss.backward()
    grads = {p.grad.dtype for p in model.parameters()}
    params = {p.dtype for p in model.parameters()}
    print(f"policy {policy}; forward saw {set(seen)}; sharded parameters {params}; gradients {grads}")
    assert set(seen) == {torch.bfloat16} and params == {torch.float32} and grads == {torch.float32}
    print("ok: bf16 in compute, fp32 parameters and gradients")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
