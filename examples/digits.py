"""The digits task the DDP, Lightning and Accelerate examples share: scikit-learn's 8x8
digits as flat float32 rows in [0, 1], split 3:1 into train and test the same way on every
rank, and the report each example prints (test accuracy and a digest of the parameters,
equal on every rank when the replicas agree)."""

import hashlib

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import TensorDataset


def datasets() -> tuple[TensorDataset, TensorDataset]:
    """(train, test): 64 features per row, labels 0-9."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def evaluate(net: nn.Module, test: TensorDataset) -> tuple[float, str]:
    """net's accuracy on test, and a short digest of its parameters' bytes."""
    with torch.no_grad():
        x, y = test.tensors
        accuracy = (net(x).argmax(1) == y).float().mean().item()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in net.parameters())).hexdigest()[:16]
    return accuracy, digest
