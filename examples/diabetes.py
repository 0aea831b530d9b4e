"""Regression through the CLI's import paths: scikit-learn's diabetes data (bundled, no download).

442 patients, 10 measurements each (age, sex, BMI, blood pressure, six blood serum values); the
target is a measure of the disease's progression a year later. Float targets make a regression:
phalanx trains with MSE and reports the loss (and MSE) on the test set. Run from this folder:

    phalanx train --model diabetes:Net --data diabetes:load --optimizer adam --lr 0.01 \\
        --steps 150 --batch-size 16 --eval-every 50 --log-every 50
    phalanx train --strategy ps ...   (the same flags: a parameter server and 2 workers)

Inputs and targets are standardised with the training part's mean and deviation, so predicting
the training mean for every patient scores a test MSE of about 1 (``baseline()`` computes it);
this one ends near 0.54 with sync and with ps (a linear model explains about half the variance
here; tests/test_diabetes_example.py checks it ends below 0.75 of the baseline).
"""

from __future__ import annotations

import numpy as np
from torch import nn

TEST_FRACTION = 0.2


class Net(nn.Module):
    """A small MLP: 10 measurements in, one prediction out (``num_classes``: the values per target)."""

    def __init__(self, input_shape, num_classes=1, hidden=32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(input_shape[-1], hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.body(x)


def load(seed: int = 0):
    """((x_train, y_train), (x_test, y_test)): float64 numpy arrays, a fixed 80/20 split, standardised
    with the training part's statistics (the test part never informs them)."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * TEST_FRACTION))
    test, train = order[:n_test], order[n_test:]
    mean_x, std_x = x[train].mean(0), x[train].std(0)
    mean_y, std_y = y[train].mean(), y[train].std()
    scale = lambda idx: ((x[idx] - mean_x) / std_x, (y[idx] - mean_y) / std_y)  # noqa: E731
    return scale(train), scale(test)


def baseline() -> float:
    """The test MSE of predicting the training targets' mean for everyone: what learning must beat."""
    (_, y_train), (_, y_test) = load()
    return float(((y_test - y_train.mean()) ** 2).mean())


if __name__ == "__main__":
    print(f"predict-the-mean test MSE: {baseline():.4f}")
