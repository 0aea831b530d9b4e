"""Hugging Face models from small configs and token data, importable by the CLI (``--model hf_models:bert``)."""

import torch
import transformers

VOCAB, LENGTH = 40, 8


def bert():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=LENGTH, num_labels=2))


def classes():
    """Sequences labelled by whether their first token is in the lower half of the vocabulary."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (96, LENGTH), generator=g)
    labels = (ids[:, 0] < VOCAB // 2).long()
    return {"input_ids": ids[:64], "labels": labels[:64]}, {"input_ids": ids[64:], "labels": labels[64:]}
