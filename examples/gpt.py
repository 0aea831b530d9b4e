"""A small GPT, written the way GPT code usually is (nanoGPT's shape), trained on the standard library's source.

    python3 examples/gpt.py                        # sync, 2 workers, 400 steps of 64 windows of 64 bytes
    python3 examples/gpt.py --strategy fsdp        # also local-sgd, diloco (--sync-every 8), ps
    python3 examples/gpt.py --dry-run              # 10 steps of 8 windows: it runs

The model is what nanoGPT users write: ``GPT(GPTConfig(...))``, causal self-attention by
``F.scaled_dot_product_attention`` (q, k and v as three projections, where nanoGPT fuses them, so that
``--tensor-parallel`` can split them by heads: the same weights for the same seed), the output layer
tied to the input embedding, ``forward(idx,
targets=None) -> (logits, loss)`` (every position's logits with targets, the last one's without), and
``configure_optimizers(weight_decay, learning_rate, betas, device_type)``: AdamW, decay on the matrices
only. Nothing in it knows phalanx. What phalanx is given sits below it: ``make`` and ``load`` (the model
from its config; char_lm's byte windows of 16 stdlib modules, every tenth held out), ``step`` (the
forward as nanoGPT's train.py calls it: 4 lines, because ``model(idx)`` alone returns the last position
only), ``optimizer`` (the model's own groups) and ``schedule`` (nanoGPT's warmup, then a cosine to a
tenth). The same through the CLI, from this folder:

    phalanx train --model gpt:make --data gpt:load --training-step gpt:step --optimizer gpt:optimizer \\
        --lr-scheduler gpt:schedule --clip-grad-norm 1.0 --strategy sync --steps 400 --batch-size 32
    # --strategy fsdp | local-sgd --sync-every 8 | diloco --sync-every 8 | ps (2 workers each)
    # --strategy fsdp --tensor-parallel 2 (q, k, v, the MLP split over 2 ranks; 4 workers: 2 fsdp x 2 tp)
    # --strategy fsdp --init-device meta --init-weights gpt:init_weights (no rank builds the model whole)
    phalanx compare --model gpt:make --data gpt:load --training-step gpt:step --optimizer gpt:optimizer \\
        --lr-scheduler gpt:schedule --clip-grad-norm 1.0 --strategies sync,fsdp,ps --scenarios none \\
        --repeats 1 --target "perplexity<=8" --max-steps 400 --eval-every 50 --batch-size 32

The API, as ``run`` below calls it (under ``if __name__ == "__main__":``; workers are spawned):

    train, test = load()
    phalanx.Trainer(phalanx.TrainConfig(strategy=phalanx.FSDP(), workers=2, steps=400, batch_size=32,
                                        clip_grad_norm=1.0),
                    model=make(105), train_data=train, test_data=test, training_step=step,
                    optimizer=optimizer, lr_scheduler=schedule).fit()

What to expect, measured on 2 CPU cores shared with other jobs (``benchmarks/gpt_quality.py --seeds 2``:
400 steps of 64 windows, 2 workers of 32, seeds 0 and 1, the same initial model as the plain PyTorch
loop's of the same seed): test perplexity, the plain loop 5.91 and 6.41; sync 6.08 and 6.39 (ratio of
medians 1.01), fsdp the same as sync to 4 digits, local-sgd 6.50 and 6.95 (1.09), diloco 6.85 and 7.38
(1.16), ps 10.83 and 12.06 (1.86). ps's gap is asynchrony, not phalanx: ssp with staleness 0 and backup
with 0 backup workers (the same server) end exactly where sync ends (100 steps of 2 x 16: 11.589 all
three), and the plain loop run as ps runs it (2 AdamW updates a step on 32 windows each, every gradient
one update stale: ``--stale``) scores 11.41 and 11.79 (1.88). The unigram model scores 22.97, a uniform
guess 105. About 40 to 70 s a run; ``python3 examples/gpt.py`` is the benchmark's sync run of seed 0
(6.08). The compare above: sync reaches perplexity 8 at step 250 (28 s of
training), fsdp at 250 (32 s), ps not in 400 steps (best 10.5).
"""
from __future__ import annotations

import argparse
import inspect
import math
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.checkpoint import load_checkpoint, tensors

import char_lm  # the example beside this one: its corpus reader, the stdlib's source as byte windows

# --------------------------------------------------------------------------- the model, as GPT code is written


@dataclass
class GPTConfig:
    block_size: int = 64  #: the longest context, in tokens (here bytes)
    vocab_size: int = 256  #: every byte; make() is told the corpus's own count
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0  #: 0 keeps every strategy's runs comparable step for step
    bias: bool = True  #: biases in the linear layers and LayerNorms, as GPT-2 has them


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must split evenly between the heads"
        # q, k and v as three projections (torchtitan's wq, wk, wv; nanoGPT fuses them in one c_attn): tensor
        # parallelism splits each by output columns, so a rank's slice of each is whole heads of q, k and v
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.head_dim, self.dropout = config.n_head, config.n_embd // config.n_head, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        # -1, not n_head: under tensor parallelism a rank holds n_head / N of the heads (torchtitan's view)
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # the heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.n_layer = config.n_layer  #: GPT-2 scales the residual projections by the depth they add up over

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # pre-norm residual blocks, as GPT-2
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying (Press & Wolf 2017): the output layer scores a token by its own input embedding
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by the depth they add up over
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        b, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than block_size {self.config.block_size}")
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:  # training: every position's logits, and the mean loss over its tokens
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:  # generating: only the last position is needed
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple,
                             device_type: str) -> torch.optim.AdamW:
        """AdamW with weight decay on the matrices (linear weights, embeddings) and none on biases and norms."""
        params = [p for p in self.parameters() if p.requires_grad]  # the tied matrix once
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if fused else {}))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        """Continue ``idx`` (B, T) by sampling ``max_new_tokens`` tokens, each from the last position's logits."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


# --------------------------------------------------------------------------- what phalanx is given: the glue

LEARNING_RATE, WARMUP, MIN_LR_RATIO = 6e-3, 30, 0.1  # nanoGPT's cosine: warm up, then decay to a tenth


def make(num_classes: int = 256) -> GPT:
    """The model for ``--model gpt:make``: phalanx passes the vocabulary the targets use as ``num_classes``."""
    return GPT(GPTConfig(vocab_size=num_classes))


def load(block_size: int = GPTConfig.block_size):
    """((x_train, y_train), (x_test, y_test)): windows of the stdlib's source, targets the next byte (char_lm's)."""
    return char_lm.load(block_size)


def init_weights(module: nn.Module) -> None:
    """``--init-weights gpt:init_weights`` (with ``--init-device meta``): GPT-2's initialisation of one module, the
    distributions GPT.__init__ gives (N(0, 0.02) matrices, zero biases, residual projections scaled by depth), called
    on each module children first, so a block's projections are scaled after its Linear layers are drawn."""
    GPT._init_weights(None, module)  # (it reads nothing of the model)
    if isinstance(module, Block):
        for proj in (module.attn.c_proj, module.mlp.c_proj):
            nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * module.n_layer))


def step(model: GPT, batch):
    idx, targets = batch
    logits, loss = model(idx, targets)
    return loss, logits


def optimizer(model: GPT) -> torch.optim.AdamW:
    return model.configure_optimizers(weight_decay=0.1, learning_rate=LEARNING_RATE, betas=(0.9, 0.99),
                                      device_type=next(model.parameters()).device.type)


def schedule(optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over WARMUP steps, then a cosine from the peak down to MIN_LR_RATIO of it at ``total_steps``."""
    def factor(it: int) -> float:
        if it < WARMUP:
            return (it + 1) / WARMUP
        progress = min(1.0, (it - WARMUP) / max(1, total_steps - WARMUP))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------- run as a script: phalanx's API

STRATEGIES = {"sync": lambda a: phalanx.Sync(), "fsdp": lambda a: phalanx.FSDP(),
              "local-sgd": lambda a: phalanx.LocalSGD(sync_every=a.sync_every),
              "diloco": lambda a: phalanx.DiLoCo(sync_every=a.sync_every), "ps": lambda a: phalanx.ParameterServer()}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="sync", choices=tuple(STRATEGIES))
    p.add_argument("--workers", type=int, default=2, help="training processes (ps: and a server besides)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64, help="windows per step, split between the workers")
    p.add_argument("--sync-every", type=int, default=8, help="local steps between averages (local-sgd, diloco)")
    p.add_argument("--checkpoint-dir", default="checkpoints/gpt")
    p.add_argument("--sample", type=int, default=200, help="bytes the trained model writes after a prompt (0: none)")
    p.add_argument("--dry-run", action="store_true", help="10 steps of 8 windows: check that it runs")
    return p


def config(args: argparse.Namespace) -> "phalanx.TrainConfig":
    if args.batch_size % args.workers:
        raise phalanx.PhalanxError(f"--batch-size {args.batch_size} does not split between {args.workers} workers; "
                                   "give a multiple of --workers")
    return phalanx.TrainConfig(
        strategy=STRATEGIES[args.strategy](args), workers=args.workers, devices="cpu", steps=args.steps,
        batch_size=args.batch_size // args.workers, clip_grad_norm=1.0, log_every=100,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=0, progress="lines",
        overwrite=True,  # each run of the example starts over in its own directory
    )


def sample(model: GPT, prompt: bytes, symbols: torch.Tensor, length: int) -> str:
    """``length`` bytes the model writes after ``prompt``, drawn from its distribution (a fixed seed)."""
    lookup = {int(b): i for i, b in enumerate(symbols)}
    idx = torch.tensor([[lookup[b] for b in prompt]])
    torch.manual_seed(0)
    out = model.eval().generate(idx, length, temperature=0.8)[0, len(prompt):]
    return bytes(symbols[out].tolist()).decode("utf-8", errors="replace")


def run(args: argparse.Namespace) -> dict:
    """Train with the strategy asked for; print the test perplexity beside the baselines, and a sample."""
    if args.dry_run:
        args.steps, args.batch_size, args.sample = 10, 8, 0
    train, test = load()
    base = char_lm.baselines(train, test)
    vocab = int(base["uniform"])
    torch.manual_seed(0)  # the model given is copied to every worker: every run starts from this one
    model = make(vocab)
    summary = phalanx.Trainer(config(args), model=model, train_data=train, test_data=test, training_step=step,
                              optimizer=optimizer, lr_scheduler=schedule).fit()
    got = summary["test_metrics"]
    print(f"gpt: {args.strategy}, test perplexity {got['perplexity']:.2f} (unigram {base['unigram']:.2f}, "
          f"uniform {vocab}) after {summary['steps']} steps")
    if args.sample:
        # (phalanx's reader: under fsdp or a pipeline on 2+ workers the checkpoint is a sharded directory)
        model.load_state_dict(tensors(load_checkpoint(summary["checkpoint"]))["model"])
        symbols = torch.unique(torch.frombuffer(bytearray(char_lm.corpus_text()), dtype=torch.uint8))
        print(f"sample: def {sample(model, b'def ', symbols, args.sample)}")
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
