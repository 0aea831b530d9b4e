"""The simulation's gradients of W workers: on their own parameters, vmap against one worker after another; on the
same parameters (sync), shard by shard against one pass of the whole batch.

``Gradients.each`` (``src/phalanx/simulate/gradients.py``) computes every worker's gradient on its own
parameters (the parameter server's family, local SGD, DiLoCo). It vmaps over the workers, and where an op of the
model has no batching rule (the GPT example's ``scaled_dot_product_attention``) torch loops inside vmap; from
the second call on, ``each`` then computes the workers in turn, N at once on N threads (each with its own copy
of the model; ``--pool``, every core by default, as the simulation does). ``Gradients.mean`` (simulated sync)
computes a user's step on the whole batch the shards were split from where its loss is their mean (the GPT's,
checked on its first call), else shard by shard; the simulation computes it on every core ("xN"). Every
variant runs here on the same parameters (W copies, each a little apart) and batches, interleaved round by
round, torch on one thread unless "xN" says otherwise, the first round a warm-up.

    PYTHONPATH=examples python3 benchmarks/simulate_gradients.py --save            # the GPT example, 64 workers
"""

from __future__ import annotations

import os
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
    p.add_argument("--pool", type=int, default=os.cpu_count(), help="workers computed at once, in turn (every core)")
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
    pooled = Gradients(model, None, UserStep(gpt.step), threads=args.pool)
    pooled.vmappable = False  # (what the first call learns)
    whole = (torch.cat([b[0] for b in shards]), torch.cat([b[1] for b in shards]))
    one_pass = Gradients(model, None, UserStep(gpt.step))
    one_pass.mean(flat, shards, whole)  # its first call compares the whole batch with the shards' mean
    assert one_pass.whole_is_mean is True
    by_shard = Gradients(model, None, UserStep(gpt.step))
    whole_pooled = Gradients(model, None, UserStep(gpt.step), threads=args.pool)
    whole_pooled.mean(flat, shards, whole)
    print(f"the GPT example ({flat.numel():,} parameters), {W} workers x {B} windows, {args.threads} thread(s), "
          f"{args.rounds} interleaved rounds after one warm-up")
    calls = {"vmap": lambda: vmapped.each(rows, shards), "in turn": lambda: in_turn.each(rows, shards),
             f"in turn x{args.pool}": lambda: pooled.each(rows, shards),
             "sync by shard": lambda: by_shard.mean(flat, shards),
             "sync whole": lambda: one_pass.mean(flat, shards, whole),
             f"sync whole x{args.pool}": lambda: whole_pooled.mean(flat, shards, whole)}
    runs: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.rounds + 1):
        for name, call in calls.items():
            vmapped.vmappable = True  # vmap on every call
            began = time.perf_counter()
            call()
            if r:
                runs[name].append((time.perf_counter() - began) * 1000)
    med = print_medians(runs, 14, " ms")
    ratio = med["vmap"] / med["in turn"]
    sync = med["sync by shard"] / med["sync whole"]
    pool = med["in turn"] / med[f"in turn x{args.pool}"]
    threads = med["sync whole"] / med[f"sync whole x{args.pool}"]
    print(f"vmap / in turn: {ratio:.2f}; in turn / {args.pool} at once: {pool:.2f}; sync by shard / whole: {sync:.2f}; "
          f"whole on 1 thread / {args.pool}: {threads:.2f}")
    save_result("simulate_gradients", args, ms_per_call=runs, medians=med, ratio_vmap_over_in_turn=ratio,
                ratio_in_turn_over_pool=pool, ratio_sync_by_shard_over_whole=sync,
                ratio_whole_one_thread_over_pool=threads)


if __name__ == "__main__":
    main()
