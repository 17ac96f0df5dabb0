"""Softmax regression: the smallest useful program, and the reference for writing one.

Args: ``num_features`` and ``num_classes``, both inferred from the data config unless given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from psctl.models import compute_dtype, dense, resolve_args
from psctl.models.data import ArrayDataset, data_shape, load_dataset
from psctl.runtime.program import Batch, Grads, Params, Program, VariableDef

NAME = "psctl.models.softmax"


def build(args: dict[str, Any], data: dict[str, Any], seed: int) -> Program:
    shape = data_shape(data, seed)
    opts = resolve_args(NAME, args, {"num_features": shape.num_features, "num_classes": shape.num_classes})
    return SoftmaxRegression(opts["num_features"], opts["num_classes"], dict(data), seed)


@dataclass
class SoftmaxRegression:
    num_features: int
    num_classes: int
    data: dict[str, Any]
    seed: int

    def variables(self) -> list[VariableDef]:
        f, c = self.num_features, self.num_classes
        return [
            VariableDef("softmax/kernel", (f, c), initializer="glorot_uniform"),
            VariableDef("softmax/bias", (c,), initializer="zeros"),
        ]

    def embedding_ids(self, batch: Batch) -> dict[str, np.ndarray]:
        return {}

    def loss_and_grads(self, params: Params, batch: Batch) -> tuple[float, Grads]:
        kernel, bias = dense(params, "softmax/kernel"), dense(params, "softmax/bias")
        x = features(batch, self.num_features, compute_dtype(kernel))
        loss, _, dlogits = softmax_cross_entropy(x @ kernel + bias, labels(batch, self.num_classes))
        return loss, {
            "softmax/kernel": (x.T @ dlogits).astype(kernel.dtype, copy=False),
            "softmax/bias": dlogits.sum(axis=0).astype(bias.dtype, copy=False),
        }

    def evaluate(self, params: Params, batch: Batch) -> dict[str, float]:
        kernel, bias = dense(params, "softmax/kernel"), dense(params, "softmax/bias")
        logits = features(batch, self.num_features, compute_dtype(kernel)) @ kernel + bias
        return classification_metrics(logits, labels(batch, self.num_classes))

    def dataset(self, split: str, shard: int, num_shards: int) -> ArrayDataset:
        return load_dataset(self.data, split=split, shard=shard, num_shards=num_shards, seed=self.seed)


def features(batch: Batch, num_features: int, dtype: np.dtype) -> np.ndarray:
    """The batch's inputs as a (batch, num_features) matrix of ``dtype``."""
    x = np.asarray(batch["x"])
    x = x.reshape(len(x), -1)
    if x.shape[1] != num_features:
        raise ValueError(f"batch has {x.shape[1]} features but the model expects {num_features}")
    return x.astype(dtype, copy=False)


def labels(batch: Batch, num_classes: int) -> np.ndarray:
    """The batch's integer class labels, checked against the number of classes."""
    y = np.asarray(batch["y"]).reshape(-1)
    if y.dtype.kind not in "iu":
        if not np.all(y == np.round(y)):
            raise ValueError("classification labels must be integers")
        y = y.astype(np.int64)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must be in [0, {num_classes}), got [{y.min()}, {y.max()}]")
    return y


def softmax_cross_entropy(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Mean cross-entropy, class probabilities and d(loss)/d(logits).

    Subtracting each row's max before exp (log-sum-exp) keeps large logits from overflowing.
    """
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(y))
    loss = -float(log_probs[rows, y].mean())
    probs = np.exp(log_probs)
    dlogits = probs.copy()
    dlogits[rows, y] -= 1
    dlogits /= len(y)
    return loss, probs, dlogits


def classification_metrics(logits: np.ndarray, y: np.ndarray) -> dict[str, float]:
    loss, _, _ = softmax_cross_entropy(logits, y)
    return {"loss": loss, "accuracy": float((logits.argmax(axis=1) == y).mean())}
