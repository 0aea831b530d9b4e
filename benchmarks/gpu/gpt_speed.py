"""phalanx's one-GPU loop against the loop a user writes by hand, on the GPT example at about 100 M parameters.

Three ways a user trains it: ``eager`` (fp32), ``bf16`` (autocast to bf16, fp32 weights) and ``compiled``
(bf16 and compiled: the hand-written loop ``torch.compile``s the whole model as nanoGPT does, phalanx's
``--compile`` compiles each of its blocks in place). Both loops train the same ``GPT`` (examples/gpt.py, 14
layers of width 768: 99 M parameters) from the same seed, with the example's ``step`` and fused AdamW
(``configure_optimizers``), clipping the gradient norm to 1.0, on windows of the stdlib's source: the hand-written
loop draws a batch of random windows a step and copies it from pinned memory without waiting (nanoGPT's
``get_batch``); phalanx feeds its own way. The variants alternate (hand, phalanx, for each mode, each round) so
drift hits both alike; the first ``--warmup`` steps of every run, where compilation happens, are left out.

phalanx's time is its metrics file's step intervals (a log step reads the loss, so the GPU's queue is drained
at both ends of an interval); the hand-written loop synchronises before reading the clock.

    python3 benchmarks/gpu/gpt_speed.py --save               # on a GPU: 2 rounds, each mode
    python3 benchmarks/gpu/gpt_speed.py --device cpu --layers 2 --width 64 --block 64 --batch 8 --steps 4 \
        --warmup 2 --rounds 1
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples")]

import gpt  # noqa: E402  (examples/gpt.py: the model as GPT code is written, and its glue)
from phalanx import TrainConfig, Trainer  # noqa: E402

from _common import parser, save_result  # noqa: E402

MODES = {"eager": ("fp32", False), "bf16": ("bf16", False), "compiled": ("bf16", True)}


def build(args, vocab: int) -> gpt.GPT:
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(vocab_size=vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                                 n_embd=args.width))


def hand_written(args, data, vocab: int, mode: str) -> float:
    """tokens/s of the plain loop after its warm-up steps."""
    precision, compiled = MODES[mode]
    device = torch.device(args.device)
    model = build(args, vocab).to(device)
    opt = gpt.optimizer(model)
    run = torch.compile(model) if compiled else model
    x_all, y_all = data
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    start = 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            _wait(device)
            start = time.perf_counter()
        pick = torch.randint(len(x_all), (args.batch,))
        x, y = x_all[pick], y_all[pick]
        if device.type == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        with autocast:
            loss, _ = gpt.step(run, (x, y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    _wait(device)
    return args.steps * args.batch * args.block / (time.perf_counter() - start)


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def phalanx_loop(args, data, test, vocab: int, mode: str) -> float:
    """tokens/s of ``Trainer`` with one worker, from its metrics file's step intervals after the warm-up."""
    precision, compiled = MODES[mode]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(workers=1, devices=args.device, steps=args.warmup + args.steps, batch_size=args.batch,
                          precision=precision, compile=compiled, clip_grad_norm=1.0, log_every=args.warmup,
                          progress="none", checkpoint_dir=tmp, checkpoint_every=0)
        Trainer(cfg, model=build(args, vocab), train_data=data, test_data=test, training_step=gpt.step,
                optimizer=gpt.optimizer).fit()
        events = [json.loads(line) for line in Path(cfg.metrics).read_text().splitlines()]
    logged = [e for e in events if e["event"] == "step"]
    seconds = sum(e["sec_per_batch"] * (e["step"] - before["step"]) for before, e in zip(logged, logged[1:]))
    return (logged[-1]["step"] - logged[0]["step"]) * args.batch * args.block / seconds


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default=",".join(MODES), help="of " + ", ".join(MODES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--compiled-rounds", type=int, default=None,
                   help="rounds of the compiled mode (each compiles twice; default: --rounds)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of each run's time (the timed steps "
                                                          "must be a multiple of it: phalanx logs every --warmup)")
    p.add_argument("--batch", type=int, default=32, help="windows per step")
    p.add_argument("--block", type=int, default=256, help="bytes per window")
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    args = p.parse_args()
    if args.steps % args.warmup:
        p.error("--steps must be a multiple of --warmup (phalanx's log steps bound its timed interval)")
    modes = args.modes.split(",")
    data, test = gpt.load(args.block)
    vocab = int(torch.cat([data[0].flatten(), test[0].flatten()]).max()) + 1
    params = sum(t.numel() for t in build(args, vocab).parameters())
    print(f"GPT {args.layers}x{args.width}, {params / 1e6:.1f} M parameters, batch {args.batch} x {args.block} "
          f"bytes, {len(data[0])} windows; {args.device}", flush=True)

    runs = {f"{mode} {loop}": [] for mode in modes for loop in ("hand-written", "phalanx")}
    rounds = {mode: args.compiled_rounds if mode == "compiled" and args.compiled_rounds else args.rounds
              for mode in modes}
    for r in range(max(rounds.values())):
        for mode in (m for m in modes if r < rounds[m]):
            for loop in ("hand-written", "phalanx"):
                began = time.perf_counter()
                rate = (hand_written(args, data, vocab, mode) if loop == "hand-written"
                        else phalanx_loop(args, data, test, vocab, mode))
                runs[f"{mode} {loop}"].append(rate)
                print(f"round {r + 1}/{rounds[mode]}  {mode:<8} {loop:<12} {rate:12,.0f} tokens/s "
                      f"({time.perf_counter() - began:.1f} s with start-up)", flush=True)

    # A round's two runs are neighbours in time, so their ratio cancels the machine's drift; the spread of
    # those paired ratios around their median says how far one measurement can be trusted.
    print(f"\n{'mode':<9} {'hand-written':>14} {'phalanx':>14} {'ratio':>7} {'paired':>7} {'spread':>14}"
          f"   (median tokens/s; paired: the median of each round's ratio, spread its min-max)")
    ratios, paired = {}, {}
    for mode in modes:
        hand, ours = (statistics.median(runs[f"{mode} {loop}"]) for loop in ("hand-written", "phalanx"))
        ratios[mode] = ours / hand
        per_round = [o / h for h, o in zip(runs[f"{mode} hand-written"], runs[f"{mode} phalanx"])]
        mid = statistics.median(per_round)
        paired[mode] = {"median": mid, "rounds": per_round,
                        "spread_pct": [100 * (min(per_round) / mid - 1), 100 * (max(per_round) / mid - 1)]}
        low, high = paired[mode]["spread_pct"]
        print(f"{mode:<9} {hand:14,.0f} {ours:14,.0f} {ratios[mode]:7.3f} {mid:7.3f}  {low:+5.1f}%/{high:+5.1f}%"
              f"  ({rounds[mode]} rounds of {args.steps} timed steps)")
    save_result("gpt_speed", args, parameters=params, tokens_per_sec=runs, ratio_phalanx_over_hand=ratios,
                paired_ratio=paired)

if __name__ == "__main__":
    main()
