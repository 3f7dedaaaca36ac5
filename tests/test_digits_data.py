"""The demo's digits are scikit-learn's, read without importing scikit-learn."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits as sklearn_load_digits

from lightning_prague.demo.digits import load_digits


def test_digits_read_from_the_shipped_file_equal_scikit_learns():
    x, y = load_digits()
    data, target = sklearn_load_digits(return_X_y=True)
    torch.testing.assert_close(x, torch.tensor(data, dtype=torch.float32) / 16.0, rtol=0, atol=0)
    assert torch.equal(y, torch.tensor(target, dtype=torch.long))
    assert x.shape == (1797, 64) and set(y.tolist()) == set(range(10))
