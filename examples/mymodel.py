"""A user's own model and data, as ``phalanx compare`` (and ``train``, ``estimate``) import them.

Run from this folder:

    phalanx compare --model mymodel:Net --data mymodel:load --strategies sync,ps,local-sgd:4 \\
                    --scenarios none,slow:1:2 --repeats 1 --target 0.9 --max-steps 200

``Net`` takes the ``input_shape`` and ``num_classes`` phalanx offers it; ``load`` returns
``(train, test)``: here scikit-learn's handwritten digits as float64 numpy arrays, which phalanx
casts to the model's float32 once (the header says so).
"""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


class Net(nn.Module):
    """A two-layer perceptron: flatten, 64 hidden units, ReLU, one logit per class."""

    def __init__(self, input_shape=(64,), num_classes=10, hidden=64):
        super().__init__()
        self.fc1 = nn.Linear(int(np.prod(input_shape)), hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def load():
    """1,500 digits to train on, the other 297 to test on (8x8 images scaled to [0, 1])."""
    digits = load_digits()
    x, y = digits.data / 16.0, digits.target
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])
