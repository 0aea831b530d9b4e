"""pytorch/examples' word-language-model Transformer (word_language_model/model.py), as written there: its
positional encoding is a buffer made by ``pe.unsqueeze(0).transpose(0, 1)``, so it has an odd stride (not
contiguous). Inputs are (sequence, batch) and forward returns log-probabilities."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0).transpose(0, 1)
        self.register_buffer('pe', pe)

    def forward(self, x):
        x = x + self.pe[:x.size(0), :]
        return self.dropout(x)


class TransformerModel(nn.Transformer):
    def __init__(self, ntoken, ninp, nhead, nhid, nlayers, dropout=0.5):
        super().__init__(d_model=ninp, nhead=nhead, dim_feedforward=nhid, num_encoder_layers=nlayers)
        self.model_type = 'Transformer'
        self.src_mask = None
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)
        self.init_weights()

    def _generate_square_subsequent_mask(self, sz):
        return torch.log(torch.tril(torch.ones(sz, sz)))

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.input_emb.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, src, has_mask=True):
        if has_mask:
            device = src.device
            if self.src_mask is None or self.src_mask.size(0) != len(src):
                mask = self._generate_square_subsequent_mask(len(src)).to(device)
                self.src_mask = mask
        else:
            self.src_mask = None
        src = self.input_emb(src) * math.sqrt(self.ninp)
        src = self.pos_encoder(src)
        output = self.encoder(src, mask=self.src_mask)
        output = self.decoder(output)
        return F.log_softmax(output, dim=-1)


VOCAB, LENGTH = 50, 8


def make():
    torch.manual_seed(0)
    return TransformerModel(VOCAB, 16, 2, 32, 2, dropout=0.0)


def load():
    """Token windows as (sequence, batch) pairs, the way the example batches its corpus (transposed)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (96, LENGTH + 1), generator=g)
    train = [(row[:-1], row[1:]) for row in data[:64]]
    test = [(row[:-1], row[1:]) for row in data[64:]]
    return train, test


def step(model, batch):
    x, y = batch
    out = model(x.t().contiguous())
    return F.nll_loss(out.reshape(-1, out.size(-1)), y.t().reshape(-1))


def failing_evaluation():
    """The model, whose evaluation fails in a worker (as the word LM's final evaluation under fsdp once did, after
    every step; the parent's check of the step on an example batch passes)."""
    model = make()
    forward = model.forward

    def forward_that_fails_in_eval(src, has_mask=True):
        if not model.training and torch.distributed.is_initialized():
            raise RuntimeError("this model cannot be evaluated")
        return forward(src, has_mask)

    model.forward = forward_that_fails_in_eval
    return model
