"""A character-level LSTM language model on the Python standard library's own source, split across processes.

    python3 examples/char_lm.py                          # pipeline: 2 stages, one process each
    python3 examples/char_lm.py --strategy sync          # 2 data-parallel workers
    python3 examples/char_lm.py --strategy ps            # a parameter server and 2 workers
    python3 examples/char_lm.py --baselines              # the corpus, and the perplexities to beat

The same model and data through the CLI's import paths (run from this folder):

    phalanx train --model char_lm:CharLM --data char_lm:load --strategy pipeline --stages 2 \\
        --optimizer adam --lr 0.01 --steps 400 --batch-size 64 --stop-at "perplexity<=5" --eval-every 50

This is the model-parallel LSTM of the multi-GPU seeds as what it was: a language model whose
layers live on different devices. The corpus is on every machine without a download: 16 modules
of the standard library (``CORPUS``; 596 KB in Python 3.11), read as bytes (the sources are almost
all ASCII, so a byte is a character); the vocabulary is the bytes that occur (105 in 3.11). The
text is cut into windows of ``--seq-len`` bytes; the target of every position is the next byte;
every tenth window is held out as the test set (a fixed split, the same on every run).

The model is an ``nn.Sequential`` of blocks (embedding, one block per LSTM layer, a linear head), so
``--strategy pipeline`` cuts it into contiguous stages: with 2 layers and 2 stages, the embedding
and the first LSTM layer on one process, the second layer and the head on the other. The outputs
are (batch, time, vocabulary) scores for targets (batch, time): phalanx's default loss is then the
cross-entropy per token, and the test set's perplexity (exp of the mean loss per token, summed over
every rank's part) is reported with the accuracy per token.

What to expect with the defaults (400 steps of 64 windows of 64 bytes, hidden 128, 2 LSTM layers,
Adam 0.01), measured on 2 CPU cores shared with other jobs: test perplexity 4.16 with pipeline, 4.15
with sync (the same batches, so nearly the same run), 4.1 to 4.5 with ps (asynchronous: no two runs
alike); accuracy per byte 0.60 to 0.62; 50 to 90 s of training, about 70 s from the command to the
result. The baselines to beat: a uniform guess over the vocabulary scores 105, a unigram model
(each byte's frequency in the training windows) 23.0. tests/test_char_lm.py checks that a shorter run
(300 steps of 32 windows of 32 bytes, hidden 64) ends below 10 with sync and with pipeline.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

import phalanx
from phalanx.task.models import RowLSTM  # one LSTM layer, (N, T, F) -> (N, T, hidden)

#: The modules read, in this order: long-lived pure-Python modules, present from Python 3.8 to 3.13.
CORPUS = ("argparse.py", "bisect.py", "calendar.py", "contextlib.py", "csv.py", "dataclasses.py", "difflib.py",
          "fractions.py", "functools.py", "heapq.py", "random.py", "shutil.py", "statistics.py", "string.py",
          "textwrap.py", "tokenize.py")
SEQ_LEN = 64
TEST_EVERY = 10  #: every tenth window is a test window


def corpus_text() -> bytes:
    """The modules of ``CORPUS`` that this Python has, concatenated in that order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    present = [root / name for name in CORPUS if (root / name).is_file()]
    if len(present) < len(CORPUS) // 2:
        raise phalanx.PhalanxError(f"only {len(present)} of the {len(CORPUS)} corpus modules are in {root}; "
                                   "this example needs a Python installed with its standard library's sources")
    return b"".join(path.read_bytes() for path in present)


def load(seq_len: int = SEQ_LEN):
    """((x_train, y_train), (x_test, y_test)): int64 windows of ``seq_len`` symbol ids, targets shifted by one.

    Symbols are the corpus's bytes, renumbered 0..V-1 in byte order. Window i reads positions
    [i*T, i*T + T) and predicts [i*T + 1, i*T + T + 1); windows i with i % 10 == 9 are the test set.
    """
    raw = torch.frombuffer(bytearray(corpus_text()), dtype=torch.uint8).long()
    windows = (len(raw) - 1) // seq_len
    raw = raw[: windows * seq_len + 1]
    vocab = torch.unique(raw)  # sorted
    ids = torch.searchsorted(vocab, raw)
    x = ids[:-1].view(windows, seq_len)
    y = ids[1:].view(windows, seq_len)
    # phalanx tells the model as many classes as the targets use: every symbol must be one somewhere
    # (only the corpus's first byte is never a target, and '#' of argparse's first line recurs)
    assert int(y.max()) == len(vocab) - 1, "the corpus's highest symbol is never a target"
    test = torch.arange(windows) % TEST_EVERY == TEST_EVERY - 1
    return (x[~test], y[~test]), (x[test], y[test])


class CharLM(nn.Sequential):
    """Embedding, ``layers`` LSTM layers, a linear head: blocks a pipeline cuts into stages.

    ``input_shape`` (T,) and ``num_classes`` (the vocabulary, inputs and targets alike) are what
    ``--model char_lm:CharLM`` is called with; the outputs are scores (batch, T, vocabulary).
    """

    def __init__(self, input_shape: Sequence[int] = (SEQ_LEN,), num_classes: int = 128, embed: int = 32,
                 hidden: int = 128, layers: int = 2):
        super().__init__(nn.Embedding(num_classes, embed),
                         *[RowLSTM(embed if i == 0 else hidden, hidden) for i in range(layers)],
                         nn.Linear(hidden, num_classes))


def baselines(train: tuple, test: tuple) -> dict[str, float]:
    """The test perplexity of guessing without context: uniformly over the vocabulary, and by each
    symbol's frequency among the training targets (a unigram model, add-one smoothed)."""
    vocab = int(max(train[1].max(), test[1].max())) + 1
    counts = torch.bincount(train[1].flatten(), minlength=vocab).double() + 1
    log_p = (counts / counts.sum()).log()
    return {"uniform": float(vocab), "unigram": math.exp(-float(log_p[test[1].flatten()].mean()))}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="pipeline", choices=("pipeline", "sync", "ps"))
    p.add_argument("--workers", type=int, default=2, help="data-parallel workers (sync, ps)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages, one process each")
    p.add_argument("--chunks", type=int, default=4, help="pipeline micro-batches per step")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64, help="windows per step, split between the workers "
                                                                 "(sync, ps) or into micro-batches (pipeline)")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help="bytes per window")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2, help="stacked LSTM layers")
    p.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: at the end)")
    p.add_argument("--checkpoint-dir", default="checkpoints/char_lm")
    p.add_argument("--baselines", action="store_true", help="print the corpus and the baselines, train nothing")
    return p


def config(args: argparse.Namespace) -> "phalanx.TrainConfig":
    """Every strategy takes the same windows per step: the pipeline all of them (cut into micro-batches),
    each data-parallel worker its part; so the strategies' runs compare step for step."""
    if args.strategy == "pipeline":
        strategy = phalanx.Pipeline(stages=args.stages, chunks=args.chunks)
        workers, per_worker = args.stages, args.batch_size
    else:
        if args.batch_size % args.workers:
            raise phalanx.PhalanxError(f"--batch-size {args.batch_size} does not split between {args.workers} "
                                       "workers; give a multiple of --workers")
        strategy = phalanx.Sync() if args.strategy == "sync" else phalanx.ParameterServer()
        workers, per_worker = args.workers, args.batch_size // args.workers
    return phalanx.TrainConfig(
        strategy=strategy, workers=workers, devices="cpu", steps=args.steps, batch_size=per_worker,
        optimizer="adam", lr=args.lr, log_every=100, eval_every=args.eval_every,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=0, progress="lines",
        overwrite=True,  # each run of the example starts over in its own directory
    )


def run(args: argparse.Namespace) -> dict:
    """Print the corpus and its baselines, train, print the test perplexity; rank 0's summary and the baselines."""
    train, test = load(args.seq_len)
    base = baselines(train, test)
    vocab = int(base["uniform"])
    print(f"corpus: {len(CORPUS)} stdlib modules of Python {sys.version.split()[0]}, {train[0].numel():,} training "
          f"and {test[0].numel():,} test bytes in windows of {args.seq_len}; vocabulary {vocab}; test perplexity "
          f"of a uniform guess {base['uniform']:.1f}, of a unigram model {base['unigram']:.2f}")
    if args.baselines:
        return {"baselines": base}
    cfg = config(args)
    torch.manual_seed(0)  # the model object given is copied to every worker: every run starts from this one
    model = CharLM((args.seq_len,), vocab, hidden=args.hidden, layers=args.layers)
    summary = phalanx.Trainer(cfg, model=model, train_data=train, test_data=test).fit()
    got = summary["test_metrics"]
    print(f"char_lm: {args.strategy}, test perplexity {got['perplexity']:.2f} (unigram {base['unigram']:.2f}, "
          f"uniform {vocab}), accuracy per byte {got['accuracy']:.3f}")
    return {**summary, "baselines": base}


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except phalanx.PhalanxError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code)


if __name__ == "__main__":
    main()
