"""The simulation's gradients of W workers on their own parameters: vmap against one worker after another.

``Gradients.each`` (``src/phalanx/simulate/gradients.py``) computes every worker's gradient on its own
parameters (the parameter server's family, local SGD, DiLoCo). It vmaps over the workers, and where an op of the
model has no batching rule (the GPT example's ``scaled_dot_product_attention``) torch loops inside vmap; from
the second call on, ``each`` then computes the workers in turn. Both variants run here on the same parameters
(W copies, each a little apart) and batches, interleaved round by round, one thread (the simulation's share of
2 cores), the first round a warm-up.

    PYTHONPATH=examples python3 benchmarks/simulate_gradients.py --save            # the GPT example, 64 workers
"""

from __future__ import annotations

import time

import torch

from phalanx.simulate.gradients import Gradients
from phalanx.task.step import UserStep

from _common import parser, print_medians, save_result


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import gpt  # examples/gpt.py

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = gpt.make(105)
    (x, y), _ = gpt.load()
    W, B = args.workers, args.batch_size
    shards = [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(W)]
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    rows = torch.stack([flat + 1e-3 * w for w in range(W)])
    in_turn = Gradients(model, None, UserStep(gpt.step))
    in_turn.each(rows, shards)  # its first call vmaps, and learns that attention loops inside vmap
    assert in_turn.vmappable is False
    vmapped = Gradients(model, None, UserStep(gpt.step))
    print(f"the GPT example ({flat.numel():,} parameters), {W} workers x {B} windows, {args.threads} thread(s), "
          f"{args.rounds} interleaved rounds after one warm-up")
    runs: dict[str, list[float]] = {"vmap": [], "in turn": []}
    for r in range(args.rounds + 1):
        for name, grads in (("vmap", vmapped), ("in turn", in_turn)):
            if name == "vmap":
                grads.vmappable = True  # vmap on every call
            began = time.perf_counter()
            grads.each(rows, shards)
            if r:
                runs[name].append((time.perf_counter() - began) * 1000)
    med = print_medians(runs, 8, " ms")
    ratio = med["vmap"] / med["in turn"]
    print(f"vmap / in turn: {ratio:.2f}")
    save_result("simulate_gradients", args, ms_per_call=runs, medians=med, ratio_vmap_over_in_turn=ratio)


if __name__ == "__main__":
    main()
