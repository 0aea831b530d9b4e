"""A stacked LSTM split across processes: each stage holds some of its LSTM layers.

    python3 examples/lstm_pipeline.py                                     # 2 stages, 4 micro-batches, 300 steps
    python3 examples/lstm_pipeline.py --stages 3 --layers 5 --schedule 1f1b --balance time

The classifier reads each 8x8 digits image as a sequence of 8 rows of 8 pixels: LSTM layer 1
reads the rows, every further layer reads the sequence the previous one produced, and the last
step of the last layer goes through a linear layer. Its blocks (one per LSTM layer, then the
head) are cut into contiguous stages, one worker process each; every step's batch is cut into
micro-batches that flow through the stages, so the stages work at the same time. The plan
printed at the start says which layers each stage holds and what bubble that predicts.
"""

from __future__ import annotations

import argparse
import sys
import torch

import phalanx
from phalanx.task import models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages, one worker process each")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    p.add_argument("--schedule", default="gpipe", help="gpipe | 1f1b")
    p.add_argument("--balance", default="auto", help="auto | params | time | blocks per stage, e.g. 2,3")
    p.add_argument("--layers", type=int, default=4, help="stacked LSTM layers")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    p.add_argument("--checkpoint-dir", default="checkpoints/lstm_pipeline")
    args = p.parse_args()

    # The digits images are 1x8x8 with 10 classes; the model object is copied to every worker.
    torch.manual_seed(0)
    model = models.lstm((1, 8, 8), 10, hidden=args.hidden, layers=args.layers)
    try:
        strategy = phalanx.Pipeline(stages=args.stages, chunks=args.chunks, schedule=args.schedule,
                                    balance=args.balance)
        config = phalanx.TrainConfig(
            strategy=strategy, model="lstm", data="digits", workers=args.stages, devices="cpu",
            steps=args.steps, batch_size=args.batch_size, optimizer="adam", lr=args.lr, log_every=50,
            checkpoint_dir=args.checkpoint_dir, checkpoint_every=0, progress="lines",
            overwrite=True,  # each run of the example starts over in its own directory
        )
        summary = phalanx.Trainer(config, model=model).fit()
    except phalanx.PhalanxError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code)
    print(f"lstm pipeline: {args.layers} LSTM layers over {args.stages} stages, balance {summary['balance']}, "
          f"test accuracy {summary['test_accuracy']:.4f}")


if __name__ == "__main__":
    main()
