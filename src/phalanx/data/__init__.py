"""Data: the built-in data sets, deterministic sharding, prefetching."""

from .datasets import ArrayDataset, DataBundle, load_cifar10, load_data, load_digits, load_synthetic
from .loader import Prefetcher, ShardedBatches, eval_batches

__all__ = ["ArrayDataset", "DataBundle", "Prefetcher", "ShardedBatches", "eval_batches", "load_cifar10",
           "load_data", "load_digits", "load_synthetic"]
