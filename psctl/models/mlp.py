"""The classic "mnist replica" MLP: one hidden relu layer, then softmax cross-entropy.

Args: ``hidden_units`` (default 100), and ``num_features`` / ``num_classes`` when the data config does not
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

NAME = "psctl.models.mlp"


def build(args: dict[str, Any], data: dict[str, Any], seed: int) -> Program:
    shape = data_shape(data, seed)
    defaults = {"hidden_units": 100, "num_features": shape.num_features, "num_classes": shape.num_classes}
    opts = resolve_args(NAME, args, defaults)
    return Mlp(opts["num_features"], opts["hidden_units"], opts["num_classes"], dict(data), seed)


@dataclass
class Mlp:
    num_features: int
    hidden_units: int
    num_classes: int
    data: dict[str, Any]
    seed: int

    def variables(self) -> list[VariableDef]:
        f, h, c = self.num_features, self.hidden_units, self.num_classes
        return [
            VariableDef("hid/kernel", (f, h), initializer="glorot_uniform"),
            VariableDef("hid/bias", (h,), initializer="zeros"),
            VariableDef("sm/kernel", (h, c), initializer="glorot_uniform"),
            VariableDef("sm/bias", (c,), initializer="zeros"),
        ]

    def embedding_ids(self, batch: Batch) -> dict[str, np.ndarray]:
        return {}

    def loss_and_grads(self, params: Params, batch: Batch) -> tuple[float, Grads]:
        w1, b1, w2, b2 = (dense(params, n) for n in ("hid/kernel", "hid/bias", "sm/kernel", "sm/bias"))
        x = features(batch, self.num_features, compute_dtype(w1))
        pre = x @ w1 + b1
        hidden = np.maximum(pre, 0)
        loss, _, dlogits = softmax_cross_entropy(hidden @ w2 + b2, labels(batch, self.num_classes))
        dhidden = dlogits @ w2.T
        dhidden[pre <= 0] = 0  # relu passes gradient only where it was active
        grads = {
            "hid/kernel": x.T @ dhidden,
            "hid/bias": dhidden.sum(axis=0),
            "sm/kernel": hidden.T @ dlogits,
            "sm/bias": dlogits.sum(axis=0),
        }
        return loss, {name: g.astype(dense(params, name).dtype, copy=False) for name, g in grads.items()}

    def evaluate(self, params: Params, batch: Batch) -> dict[str, float]:
        w1, b1, w2, b2 = (dense(params, n) for n in ("hid/kernel", "hid/bias", "sm/kernel", "sm/bias"))
        x = features(batch, self.num_features, compute_dtype(w1))
        logits = np.maximum(x @ w1 + b1, 0) @ w2 + b2
        return classification_metrics(logits, labels(batch, self.num_classes))

    def dataset(self, split: str, shard: int, num_shards: int) -> ArrayDataset:
        return load_dataset(self.data, split=split, shard=shard, num_shards=num_shards, seed=self.seed)
