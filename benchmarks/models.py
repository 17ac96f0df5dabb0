"""Benchmark programs the built-in models do not cover.

W3 needs a dense MLP with two hidden relu layers (1024-1024-1024-10); the built-in ``psctl.models.mlp`` has
one. This module implements the Program protocol of :mod:`psctl.runtime.program` and is loaded by every
role from its file path (``"program": "<repo>/benchmarks/models.py"``), so it imports nothing but psctl.

Args: ``hidden_units`` (default 1024), and ``num_features`` / ``num_classes`` when the data config does not
imply them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from psctl.models import compute_dtype, dense, resolve_args
from psctl.models.data import ArrayDataset, data_shape, load_dataset
from psctl.models.softmax import classification_metrics, features, labels, softmax_cross_entropy
from psctl.runtime.program import Batch, Grads, Params, Program, VariableDef

NAME = "benchmarks.models"
LAYERS = ("h1", "h2", "out")


def build(args: dict[str, Any], data: dict[str, Any], seed: int) -> Program:
    shape = data_shape(data, seed)
    defaults = {"hidden_units": 1024, "num_features": shape.num_features, "num_classes": shape.num_classes}
    opts = resolve_args(NAME, args, defaults)
    return DeepMlp(opts["num_features"], opts["hidden_units"], opts["num_classes"], dict(data), seed)


@dataclass
class DeepMlp:
    """x -> relu(x W1 + b1) -> relu(. W2 + b2) -> . W3 + b3 -> softmax cross-entropy."""

    num_features: int
    hidden_units: int
    num_classes: int
    data: dict[str, Any]
    seed: int

    def variables(self) -> list[VariableDef]:
        f, h, c = self.num_features, self.hidden_units, self.num_classes
        return [
            VariableDef("h1/kernel", (f, h), initializer="glorot_uniform"),
            VariableDef("h1/bias", (h,), initializer="zeros"),
            VariableDef("h2/kernel", (h, h), initializer="glorot_uniform"),
            VariableDef("h2/bias", (h,), initializer="zeros"),
            VariableDef("out/kernel", (h, c), initializer="glorot_uniform"),
            VariableDef("out/bias", (c,), initializer="zeros"),
        ]

    def embedding_ids(self, batch: Batch) -> dict[str, np.ndarray]:
        return {}

    def _weights(self, params: Params) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(dense(params, f"{layer}/kernel"), dense(params, f"{layer}/bias")) for layer in LAYERS]

    def loss_and_grads(self, params: Params, batch: Batch) -> tuple[float, Grads]:
        (w1, b1), (w2, b2), (w3, b3) = self._weights(params)
        x = features(batch, self.num_features, compute_dtype(w1))
        pre1 = x @ w1 + b1
        a1 = np.maximum(pre1, 0)
        pre2 = a1 @ w2 + b2
        a2 = np.maximum(pre2, 0)
        loss, _, dlogits = softmax_cross_entropy(a2 @ w3 + b3, labels(batch, self.num_classes))
        da2 = dlogits @ w3.T
        da2[pre2 <= 0] = 0  # relu passes gradient only where it was active
        da1 = da2 @ w2.T
        da1[pre1 <= 0] = 0
        grads = {
            "h1/kernel": x.T @ da1,
            "h1/bias": da1.sum(axis=0),
            "h2/kernel": a1.T @ da2,
            "h2/bias": da2.sum(axis=0),
            "out/kernel": a2.T @ dlogits,
            "out/bias": dlogits.sum(axis=0),
        }
        return loss, {name: g.astype(dense(params, name).dtype, copy=False) for name, g in grads.items()}

    def evaluate(self, params: Params, batch: Batch) -> dict[str, float]:
        (w1, b1), (w2, b2), (w3, b3) = self._weights(params)
        x = features(batch, self.num_features, compute_dtype(w1))
        logits = np.maximum(np.maximum(x @ w1 + b1, 0) @ w2 + b2, 0) @ w3 + b3
        return classification_metrics(logits, labels(batch, self.num_classes))

    def dataset(self, split: str, shard: int, num_shards: int) -> ArrayDataset:
        return load_dataset(self.data, split=split, shard=shard, num_shards=num_shards, seed=self.seed)
