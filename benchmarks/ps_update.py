"""The parameter server's update, as it was and as it is, side by side on one model.

The server applies each pushed gradient (a flat vector it received) with the run's optimizer, then
copies the parameters for the reply. Until stop 28 the update stacked the gradients, summed them,
scaled the sum and cloned every parameter's slice: four new buffers of the model's size, whose first
touch costs page faults beyond the pass itself. ``apply_gradients`` (``strategies/ps/server.py``)
sums into the first gradient and scales it in place, and the parameters' gradients are views of it.
Both variants run on the same parameters and optimizer (SGD with momentum), interleaved round by
round; each timed update starts from a freshly received-like vector (a new buffer, written once, as
``recv`` leaves it), and ends with the reply's copy of the parameters.

    python3 benchmarks/ps_update.py                 # the 20.1 M-parameter mlp of benchmarks/estimate.py
    python3 benchmarks/ps_update.py --model cnn     # the digits cnn (151 k parameters)
"""

from __future__ import annotations

import time

import torch
from torch.nn.utils import parameters_to_vector

from phalanx.task.models import build_model
from phalanx.strategies.ps.server import apply_gradients

from _common import parser, print_medians, save_result

SHAPES = {"mlp": (1, 280, 280), "cnn": (1, 8, 8)}


def stacked(params, optimizer, grads, weight) -> None:
    """The update before stop 28 (``Server._apply``), kept here as the baseline."""
    grad = torch.stack(grads).sum(0) * weight
    offset = 0
    for p in params:
        p.grad = grad[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


VARIANTS = {"stack, sum, scale, clone (before)": stacked, "in place, views (now)": apply_gradients}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", choices=sorted(SHAPES), default="mlp")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--gradients", type=int, default=1, help="gradients per update (ps: 1; backup and ssp:0: W - B)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a server beside 2 workers on 2 cores: 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(args.model, SHAPES[args.model], 10)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    size = sum(q.numel() for q in params)
    print(f"{args.model}: {size:,} parameters ({size * 4 / 1e6:.1f} MB per gradient), {args.gradients} gradient(s) "
          f"per update, {args.threads} thread(s), {args.rounds} interleaved rounds after one warm-up")
    runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds + 1):
        for name, update in VARIANTS.items():
            grads = [torch.empty(size).fill_(1e-3) for _ in range(args.gradients)]  # received: new, written once
            t = time.perf_counter()
            update(params, optimizer, grads, 1.0 / max(args.gradients, 2))
            parameters_to_vector(params).detach().contiguous()  # the reply's copy
            if r:
                runs[name].append((time.perf_counter() - t) * 1e3)
    print("ms per update (median, min-max):")
    med = print_medians(runs, max(map(len, VARIANTS)), " ms")
    before, now = (med[name] for name in VARIANTS)
    print(f"now / before: {now / before:.3f}")
    save_result(f"ps_update-{args.model}", args, ms_per_update=runs, medians=med, ratio_now_over_before=now / before)


if __name__ == "__main__":
    main()
